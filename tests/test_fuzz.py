"""Fuzzing the parsers of untrusted input: completions, trace files, task files.

Each target may refuse input only with verbatim's own errors (``VerbatimError``
subclasses) or report it as data (a ``Message``'s problems, a trace's problems);
any other exception, or a call slower than its deadline, fails the test.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from fakes import PARSER_MARKUP, tiny_rollout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verbatim.datamodel import Message
from verbatim.envs.guess import GuessTask
from verbatim.envs.python import PythonTask
from verbatim.envs.taskfile import load_tasks, parse_task
from verbatim.errors import InputError, TraceFormatError, VerbatimError
from verbatim.harness.store import RunManifest, TraceWriter, read_run
from verbatim.renderers.registry import FAMILIES, get_renderer

FUZZ = settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])



@pytest.fixture(scope="module")
def renderers(default_model_dir):
    return {name: get_renderer(name, model_dir=default_model_dir) for name in sorted(FAMILIES)}


@pytest.mark.slow  # loads every family's tokenizer (about a minute alone; shared with the renderer tests in one run)
@pytest.mark.parametrize("name", sorted(FAMILIES))
@FUZZ
@given(data=st.data())
def test_parse_completion_of_any_text_or_tokens_returns_a_message(renderers, name, data):
    renderer = renderers[name]
    pieces = data.draw(st.lists(st.one_of(st.sampled_from(PARSER_MARKUP), st.text(max_size=20)), max_size=12))
    ids = list(renderer.tokenizer.encode("".join(pieces), add_special_tokens=False))
    size = len(renderer.tokenizer)
    ids += data.draw(st.lists(st.integers(0, size - 1), max_size=8))
    ids += data.draw(st.lists(st.sampled_from(renderer.stop_token_ids), max_size=1))
    try:
        message = renderer.parse_completion(ids)
    except VerbatimError:
        return
    assert isinstance(message, Message) and message.role == "assistant"


# -- trace files -------------------------------------------------------------------


def _written_run(fmt: str) -> tuple[Path, Path]:
    root = Path(tempfile.mkdtemp(prefix="verbatim-fuzz-"))
    writer = TraceWriter(root / "run", RunManifest(run_id="fuzz", format=fmt))
    path = writer.write_batch([tiny_rollout(i) for i in range(3)])
    return root, path


def _read_quietly(run_dir: Path):
    try:
        return read_run(run_dir)
    except VerbatimError:
        return None


@FUZZ
@given(fmt=st.sampled_from(["parquet", "jsonl"]), cut=st.floats(0, 1, exclude_max=True))
def test_a_truncated_batch_file_keeps_every_intact_rollout(fmt, cut):
    root, path = _written_run(fmt)
    try:
        data = path.read_bytes()
        keep = int(len(data) * cut)
        path.write_bytes(data[:keep])
        trace = read_run(path.parent)
        if fmt == "jsonl":
            whole_lines = data[:keep].count(b"\n")
            assert len(trace.rollouts) >= whole_lines
            assert [r.rollout_id for r in trace.rollouts[:whole_lines]] == [f"r{i}" for i in range(whole_lines)]
        else:
            assert trace.rollouts == [] and len(trace.problems) == 1
        assert all("\n" not in problem for problem in trace.problems)
    finally:
        shutil.rmtree(root)


FLIPS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4)


@FUZZ
@given(fmt=st.sampled_from(["parquet", "jsonl"]), flips=FLIPS)
def test_a_corrupted_batch_file_never_raises_anything_but_verbatim_errors(fmt, flips):
    root, path = _written_run(fmt)
    try:
        data = bytearray(path.read_bytes())
        for where, value in flips:
            data[int(len(data) * where)] = value
        path.write_bytes(bytes(data))
        trace = _read_quietly(path.parent)
        assert trace is None or len(trace.rollouts) <= 3
    finally:
        shutil.rmtree(root)


@FUZZ
@given(name=st.sampled_from(["rollouts-000001.parquet", "rollouts-000002.jsonl", "manifest.json"]),
       content=st.binary(max_size=600))
def test_random_bytes_in_a_run_directory_never_raise_anything_but_verbatim_errors(name, content):
    root, _ = _written_run("jsonl")
    try:
        (root / "run" / name).write_bytes(content)
        try:
            trace = read_run(root / "run")
        except TraceFormatError:
            assert name == "manifest.json"
            return
        assert len(trace.rollouts) <= 4
    finally:
        shutil.rmtree(root)


# -- task files ----------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=10)


@FUZZ
@given(content=st.one_of(st.binary(max_size=400),
                         st.lists(st.one_of(JSON_VALUES.map(json.dumps), st.text(max_size=30)),
                                  max_size=6).map(lambda lines: "\n".join(lines).encode())))
def test_task_files_load_or_fail_with_an_input_error_naming_the_line(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "tasks.jsonl")
        path.write_bytes(content)
        try:
            tasks = load_tasks(path)
        except InputError as exc:
            assert "\n" not in exc.one_line() and "tasks.jsonl" in exc.one_line()
            return
        assert tasks and all(isinstance(task, dict) for task in tasks)


@FUZZ
@given(task=st.dictionaries(st.sampled_from(["id", "prompt", "expected", "kind", "max_attempts", "target",
                                             "low", "high", "other"]), JSON_VALUES, max_size=6),
       spec=st.sampled_from([PythonTask, GuessTask]))
def test_typed_tasks_validate_or_fail_with_an_input_error(task, spec):
    try:
        parsed = parse_task(spec, task, "fuzz")
    except InputError as exc:
        assert exc.one_line().startswith("fuzz task")
        return
    assert isinstance(parsed, spec)


# -- inputs coverage-guided fuzzing pointed at (tests/test_fuzz_coverage.py) --------------------------

HOSTILE_LINES = [
    '{"tokens": {"token_id": [99999999999999999999999], "logprob": []}}',  # OverflowError in NumPy
    "[" * 100_000 + "]" * 100_000,  # RecursionError in the JSON decoder
    '{"tokens": {"logprob": 5}}',
    "\xff\xfe not utf-8",
]


@pytest.mark.parametrize("line", HOSTILE_LINES, ids=["overflow", "deep-json", "wrong-type", "not-utf8"])
def test_a_hostile_jsonl_line_is_a_reported_problem(tmp_path, line):
    root, path = _written_run("jsonl")
    try:
        raw = line.encode("latin-1") if line.startswith("\xff") else line.encode()
        path.write_bytes(path.read_bytes() + raw + b"\n")
        trace = read_run(path.parent)
        assert len(trace.rollouts) == 3 and len(trace.problems) == 1 and "line(s) (4)" in trace.problems[0]
    finally:
        shutil.rmtree(root)


def test_a_parquet_batch_with_a_task_nested_too_deep_is_a_reported_problem():
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, path = _written_run("parquet")
    try:
        table = pq.read_table(path)
        deep = pa.array(["[" * 100_000 + "]" * 100_000] * table.num_rows, type=table.schema.field("task").type)
        pq.write_table(table.set_column(table.schema.get_field_index("task"), "task", deep), path)
        trace = read_run(path.parent)
        assert trace.rollouts == [] and len(trace.problems) == 1 and "RecursionError" in trace.problems[0]
    finally:
        shutil.rmtree(root)


def test_json_nested_too_deep_in_a_task_file_or_a_manifest_is_a_one_line_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "tasks.jsonl").write_text('{"id": 1}\n' + deep + "\n")
    with pytest.raises(InputError, match="tasks.jsonl line 2: JSON nested too deep"):
        load_tasks(tmp_path / "tasks.jsonl")
    (tmp_path / "manifest.json").write_text(deep)
    with pytest.raises(TraceFormatError, match="is unreadable") as caught:
        read_run(tmp_path)
    assert "\n" not in caught.value.one_line()
