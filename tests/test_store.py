"""Trace storage: lossless round trips, damaged files, and crashes between batches."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verbatim.datamodel import SCHEMA_VERSION, Rollout, Source, TokenColumns, Turn
from verbatim.errors import TraceFormatError
from verbatim.harness.store import RunManifest, TraceWriter, read_manifest, read_run

FORMATS = ["parquet", "jsonl"]


@st.composite
def rollouts(draw, index: int = 0) -> Rollout:
    n_turns = draw(st.integers(0, 4))
    tokens = {k: [] for k in ("token_id", "source", "logprob", "policy_version", "turn")}
    turns = []

    def add(ids, source, turn, logprobs=None, versions=None):
        tokens["token_id"] += ids
        tokens["source"] += [int(source)] * len(ids)
        tokens["turn"] += [turn] * len(ids)
        tokens["logprob"] += logprobs if logprobs is not None else [math.nan] * len(ids)
        tokens["policy_version"] += versions if versions is not None else [-1] * len(ids)

    ids = st.lists(st.integers(0, 2**31 - 1), max_size=12)
    add(draw(ids.filter(bool)), Source.PROMPT, 0)
    for k in range(n_turns):
        prompt_end = len(tokens["token_id"])
        sampled = draw(ids)
        lps = draw(st.lists(st.floats(-1e4, 0.0, width=32), min_size=len(sampled), max_size=len(sampled)))
        add(sampled, Source.MODEL, k, lps, [draw(st.integers(0, 2**31 - 1))] * len(sampled))
        turns.append(Turn(index=k, prompt_end=prompt_end, completion_end=len(tokens["token_id"]),
                          cached_tokens=draw(st.integers(0, prompt_end)),
                          cache_salt=draw(st.none() | st.text(max_size=8)),
                          finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
                          kv_versions=tuple(draw(st.lists(st.integers(0, 5), max_size=3))),
                          total_s=draw(st.floats(0, 100)), reward=draw(st.none() | st.floats(-1, 1))))
        add(draw(ids), Source.ENV, k + 1)
    status = draw(st.sampled_from(["ok", "truncated", "error"]))
    json_values = st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=10)
    return Rollout(
        run_id="run", group_id=f"g{index // 2}", rollout_id=draw(st.text(min_size=1, max_size=12)),
        task=draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
        info=draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
        tokens=TokenColumns(**{k: np.asarray(v) for k, v in tokens.items()}),
        turns=tuple(turns), reward=draw(st.none() | st.floats(-5, 5)),
        status=status, error=None if status == "ok" else draw(st.text(min_size=1, max_size=30)),
    )


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(rollouts(), min_size=1, max_size=4))
def test_round_trip_is_lossless(tmp_path_factory, fmt, batch):
    run_dir = tmp_path_factory.mktemp(fmt)
    writer = TraceWriter(run_dir, RunManifest(run_id="run", format=fmt, config={"g": 2}))
    writer.write_batch(batch[:2])
    writer.write_batch(batch[2:])
    trace = read_run(run_dir)
    assert trace.problems == []
    assert trace.manifest.config == {"g": 2}
    assert len(trace.rollouts) == len(batch)
    for written, read in zip(batch, trace.rollouts):
        assert read.same_as(written)
        assert np.isnan(read.tokens.logprob[read.tokens.source != Source.MODEL]).all()


def _sample(i: int) -> Rollout:
    tokens = TokenColumns(token_id=np.arange(i, i + 6), source=[0, 0, 2, 2, 1, 1],
                          logprob=[np.nan, np.nan, -0.5, -1.5, np.nan, np.nan],
                          policy_version=[-1, -1, 3, 3, -1, -1], turn=[0, 0, 0, 0, 1, 1])
    return Rollout(run_id="run", group_id="g", rollout_id=f"r{i}", tokens=tokens,
                   turns=(Turn(index=0, prompt_end=2, completion_end=4),), reward=float(i))


def _run_with_batches(run_dir: Path, fmt: str, batches: int = 3) -> TraceWriter:
    writer = TraceWriter(run_dir, RunManifest(run_id="run", format=fmt))
    for b in range(batches):
        writer.write_batch([_sample(10 * b + k) for k in range(2)])
    return writer


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_last_file_is_reported_and_the_rest_returned(tmp_path, fmt):
    _run_with_batches(tmp_path, fmt)
    last = tmp_path / f"rollouts-000003.{fmt}"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) * 2 // 3])
    trace = read_run(tmp_path)
    assert len(trace.problems) == 1 and "rollouts-000003" in trace.problems[0]
    assert "\n" not in trace.problems[0]
    ids = [r.rollout_id for r in trace.rollouts]
    expected = ["r0", "r1", "r10", "r11"] + (["r20"] if fmt == "jsonl" else [])
    assert ids == expected  # JSONL keeps the intact first line of the damaged file


def test_reading_a_run_loads_no_pandas(tmp_path):
    """pyarrow's ``read_table`` goes through its dataset layer, which imports pandas (0.3-0.6 s of every
    ``verbatim run --resume``, ``lint`` or ``show`` process); a run's files are read without it."""
    from fakes import tiny_rollout

    writer = TraceWriter(tmp_path / "run", RunManifest(run_id="r", format="parquet"))
    writer.write_batch([tiny_rollout(0), tiny_rollout(1)])
    code = ("import sys\nfrom verbatim.harness.store import read_run\nrun = read_run(sys.argv[1])\n"
            "print(len(run.rollouts), sorted(m for m in ('pandas', 'pyarrow.dataset') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split("\n")[0] == "2 []"


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_middle_file_is_skipped(tmp_path, fmt):
    _run_with_batches(tmp_path, fmt)
    (tmp_path / f"rollouts-000002.{fmt}").write_bytes(b"\x00garbage\xff" * 20)
    trace = read_run(tmp_path)
    assert [r.rollout_id for r in trace.rollouts] == ["r0", "r1", "r20", "r21"]
    assert len(trace.problems) == 1 and "rollouts-000002" in trace.problems[0]


_CRASH = textwrap.dedent("""
    import os, sys
    import numpy as np
    import pyarrow.parquet as pq
    sys.path.insert(0, {tests!r})
    from test_store import _sample
    from verbatim.harness.store import RunManifest, TraceWriter
    writer = TraceWriter({run_dir!r}, RunManifest(run_id="run", format={fmt!r}))
    writer.write_batch([_sample(0), _sample(1)])
    real_write_table = pq.write_table
    def dying_write(table, path, **kw):      # the process dies half-way through batch 2
        real_write_table(table, path, **kw)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os._exit(9)
    pq.write_table = dying_write
    import pathlib
    pathlib.Path.write_text = lambda self, text, **kw: (open(self, "w").write(text[: len(text) // 2]),
                                                        os._exit(9))
    writer.write_batch([_sample(10), _sample(11)])
""")


@pytest.mark.parametrize("fmt", FORMATS)
def test_crash_while_writing_a_batch_loses_only_that_batch(tmp_path, fmt):
    script = _CRASH.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path), fmt=fmt)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    trace = read_run(tmp_path)
    assert [r.rollout_id for r in trace.rollouts] == ["r0", "r1"]
    assert all(r.same_as(_sample(i)) for i, r in enumerate(trace.rollouts))
    assert len(trace.problems) == 1 and "unfinished write" in trace.problems[0]
    # the next writer on the same run continues after the intact batch
    writer = TraceWriter(tmp_path, trace.manifest)
    assert writer.write_batch([_sample(5)]).name == f"rollouts-000002.{fmt}"
    assert [r.rollout_id for r in read_run(tmp_path).rollouts] == ["r0", "r1", "r5"]


def test_not_a_run_and_newer_schema_are_one_line_input_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="not a verbatim run"):
        read_run(tmp_path)
    with pytest.raises(TraceFormatError, match="not a directory"):
        read_run(tmp_path / "missing")
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "run_id": "x"}))
    with pytest.raises(TraceFormatError, match="newer than this verbatim reads") as info:
        read_manifest(tmp_path)
    assert info.value.exit_code == 2
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match="unreadable"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("text,kind", [("[]", "list"), ('"run"', "str"), ("3", "int"), ("null", "NoneType")])
def test_a_manifest_that_is_not_a_json_object_says_so_in_one_line(tmp_path, text, kind):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(TraceFormatError) as info:
        read_manifest(tmp_path)
    line = info.value.one_line()
    assert f"manifest.json: a manifest must be a JSON object, got {kind}" in line, line
    assert '"run_id"' in line and info.value.exit_code == 2


def test_manifest_records_versions_and_updates_atomically(tmp_path):
    writer = TraceWriter(tmp_path, RunManifest(run_id="run", model="m", renderer="chatml"))
    assert "python" in read_manifest(tmp_path).versions
    writer.write_manifest(writer.manifest.model_copy(update={"status": "completed"}))
    manifest = read_manifest(tmp_path)
    assert manifest.status == "completed" and manifest.model == "m"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_run_directory_lock_refuses_a_second_writer_and_dies_with_its_holder(tmp_path):
    """The lock is the kernel's: a writer killed by SIGKILL leaves no stale lock behind."""
    from verbatim.errors import InputError
    from verbatim.harness.store import RunLock

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from verbatim.harness.store import RunLock
        with RunLock({str(out)!r}):
            print("locked", flush=True)
            time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InputError, match="being written by another verbatim run"):
            RunLock.check_free(out)
        with pytest.raises(InputError):
            RunLock(out).__enter__()
    finally:
        holder.kill()
        holder.wait(30)
    RunLock.check_free(out)
    with RunLock(out):
        with pytest.raises(InputError):  # one writer even within one process
            RunLock.check_free(out)
    assert list(out.iterdir()) == []  # the lock adds no file to the run directory


def test_a_jsonl_line_has_the_parquet_rows_columns_and_an_older_nested_line_still_reads():
    from verbatim.harness.tracefile import ROLLOUT_SCHEMA, from_json_line, to_json_line, to_table

    rollout = _sample(3)
    line = json.loads(to_json_line(rollout))
    assert set(line) == set(ROLLOUT_SCHEMA.names) == set(to_table([rollout]).column_names)
    assert line["token_id"] == rollout.tokens.token_id.tolist() and isinstance(line["info"], dict)
    assert [x is None for x in line["logprob"]] == np.isnan(rollout.tokens.logprob).tolist()
    older = {k: v for k, v in line.items() if k not in ("token_id", "source", "logprob", "policy_version", "turn")}
    older["tokens"] = {k: line[k] for k in ("token_id", "source", "logprob", "policy_version", "turn")}
    for text in (json.dumps(line), json.dumps(older)):
        back = from_json_line(text)
        assert back.model_dump(exclude={"tokens"}) == rollout.model_dump(exclude={"tokens"})
        assert np.array_equal(back.tokens.logprob, rollout.tokens.logprob, equal_nan=True)
        assert np.array_equal(back.tokens.token_id, rollout.tokens.token_id)


def test_a_table_whose_token_columns_have_another_type_or_several_chunks_reads_the_same():
    """Files verbatim writes are read from their Arrow buffers; a column of another type (a writer of its own, a
    float64 logprob) goes through pyarrow's conversion, and a table of several chunks reads the same."""
    import pyarrow as pa

    from verbatim.harness.tracefile import from_table, to_table

    rollouts = [_sample(3), _sample(4)]
    table = to_table(rollouts)
    at = table.schema.get_field_index("logprob")
    wider = table.set_column(at, "logprob", table.column("logprob").cast(pa.list_(pa.float64())))
    chunked = pa.concat_tables([to_table(rollouts[:1]), to_table(rollouts[1:])])
    for other in (wider, chunked):
        for back, rollout in zip(from_table(other), rollouts, strict=True):
            for name in ("token_id", "source", "policy_version", "turn"):
                assert np.array_equal(getattr(back.tokens, name), getattr(rollout.tokens, name)), name
            assert back.tokens.logprob.dtype == np.float32
            assert np.array_equal(back.tokens.logprob, rollout.tokens.logprob, equal_nan=True)


def test_setting_interrupted_rollouts_aside_touches_only_the_play_being_resumed(tmp_path):
    """A training run resumes one step: an interrupted rollout of an earlier step (trained on as it was) stays;
    the step's own go aside in their whole file, and its finished neighbours come back, each once."""
    from fakes import tiny_rollout

    from verbatim.harness.store import set_aside_interrupted

    def cut(r: Rollout) -> Rollout:
        return r.model_copy(update={"status": "interrupted", "error": "interrupted by SIGINT", "reward": None})

    writer = TraceWriter(tmp_path / "run", RunManifest(run_id="r", engine={"block_size": 16}))
    earlier = writer.write_batch([cut(tiny_rollout(0)), tiny_rollout(1)])
    now = writer.write_batch([cut(tiny_rollout(2)), tiny_rollout(3)])
    kept, moved = earlier.read_bytes(), now.read_bytes()
    assert set_aside_interrupted(writer, {"r2", "r3"}) == ["r2"]
    assert earlier.read_bytes() == kept and not now.exists()
    assert (tmp_path / "run" / "discarded" / "interrupted" / now.name).read_bytes() == moved
    after = read_run(tmp_path / "run").rollouts
    assert sorted((r.rollout_id, r.status) for r in after) == [("r0", "interrupted"), ("r1", "ok"), ("r3", "ok")]
