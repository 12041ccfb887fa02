"""A training run's metrics.jsonl (append, torn lines, atomic rewrite) and `verbatim plot`."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.errors import InputError, TraceError
from verbatim.harness.curves import evaluations, plot_training, series
from verbatim.harness.metrics_log import append_metrics, read_metrics, rewrite_metrics
from verbatim.harness.store import RunManifest, TraceWriter

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(step: int, **extra) -> dict:
    return {"step": step, "version": step + 1, "reward_mean": 0.1 * step, "success_rate": 0.2 * step,
            "mismatch_mean_abs": 1e-3 / (step + 1), "cache_hit_rate": 0.5 + 0.05 * step, "entropy": 2.0 - 0.1 * step,
            **extra}


def _run(tmp_path, steps: int = 5, **extra):
    for step in range(1, steps + 1):  # steps count from 1 (step 0's line is an evaluation's)
        append_metrics(tmp_path, _record(step, **extra))
    return tmp_path


# ---------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------


def test_records_round_trip(tmp_path):
    records = [_record(0), _record(1, note="ünïcode", nested={"a": [1, None]}), {"step": 2, "success_rate": None}]
    for record in records:
        append_metrics(tmp_path, record)
    assert read_metrics(tmp_path) == records
    assert (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").count("\n") == 3


def test_a_torn_last_line_is_skipped_and_cut_by_the_next_append(tmp_path):
    _run(tmp_path, steps=2)
    with open(tmp_path / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"step": 3, "reward_me')  # the writer was killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    append_metrics(tmp_path, _record(3))
    assert read_metrics(tmp_path) == [_record(1), _record(2), _record(3)]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    _run(tmp_path, steps=1)
    with open(tmp_path / "metrics.jsonl", "ab") as handle:
        handle.write(json.dumps(_record(2)).encode())
    assert read_metrics(tmp_path) == [_record(1), _record(2)]
    append_metrics(tmp_path, _record(3))
    assert read_metrics(tmp_path) == [_record(1), _record(2), _record(3)]


def test_a_torn_first_line_leaves_an_empty_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"st')
    assert read_metrics(tmp_path) == []
    append_metrics(tmp_path, _record(0))
    assert read_metrics(tmp_path) == [_record(0)]


def test_a_damaged_middle_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n{"step": 2}\n')
    with pytest.raises(TraceError, match="metrics.jsonl line 2 is not a JSON object"):
        read_metrics(tmp_path)


def test_a_missing_log_is_not_a_training_run(tmp_path):
    with pytest.raises(InputError, match="has no metrics.jsonl: it is not a training run"):
        read_metrics(tmp_path)


def test_rewrite_keeps_only_the_given_records(tmp_path):
    _run(tmp_path, steps=5)
    kept = read_metrics(tmp_path)[:3]
    rewrite_metrics(tmp_path, kept)
    assert read_metrics(tmp_path) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("broken", ["os.replace", "os.fsync"])
def test_a_failed_rewrite_leaves_the_old_file(tmp_path, monkeypatch, broken):
    _run(tmp_path, steps=3)
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(broken, full)
    with pytest.raises(TraceError, match="cannot rewrite .*metrics.jsonl: No space left on device; it is unchanged"):
        rewrite_metrics(tmp_path, [_record(0)])
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_records_that_are_not_json_are_refused(tmp_path):
    with pytest.raises(InputError, match="metrics record of step 3 is not JSON data"):
        append_metrics(tmp_path, {"step": 3, "bad": object()})
    assert not (tmp_path / "metrics.jsonl").exists() or read_metrics(tmp_path) == []


def test_metrics_jsonl_has_the_mode_of_every_other_run_file_after_append_and_rewrite(tmp_path):
    def mode(name: str) -> int:
        return stat.S_IMODE((tmp_path / name).stat().st_mode)

    old = os.umask(0o022)
    try:
        TraceWriter(tmp_path, RunManifest(run_id="run"))
        _run(tmp_path, steps=3)
        assert mode("metrics.jsonl") == mode("manifest.json") == 0o644
        rewrite_metrics(tmp_path, read_metrics(tmp_path)[:2])  # --resume drops the steps never checkpointed
        assert mode("metrics.jsonl") == mode("manifest.json") == 0o644
    finally:
        os.umask(old)


finite = st.floats(allow_nan=False, allow_infinity=False)  # a non-finite float is written as null (strict JSON)
json_values = st.none() | st.booleans() | st.integers() | finite | st.text(max_size=5)
records = st.lists(st.dictionaries(st.text(max_size=4), json_values, max_size=4), max_size=5)


@given(records, st.binary(max_size=20).filter(lambda b: b"\n" not in b))
def test_any_torn_tail_keeps_every_whole_record(tmp_path_factory, written, tail):
    run_dir = tmp_path_factory.mktemp("run")
    for record in written:
        append_metrics(run_dir, record)
    with open(run_dir / "metrics.jsonl", "ab") as handle:
        handle.write(tail)
    got = read_metrics(run_dir)
    assert got[:len(written)] == written and len(got) - len(written) in (0, 1)
    append_metrics(run_dir, {"step": 99})
    assert read_metrics(run_dir) == [*got, {"step": 99}]


# ---------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------


def test_series_turns_missing_and_null_into_gaps():
    values = series([{"x": 1}, {"x": None}, {}, {"x": True}, {"x": 0.5}], "x")
    assert values[0] == 1.0 and values[4] == 0.5
    assert all(v != v for v in values[1:4])  # NaN


def test_plot_command_writes_a_png(tmp_path):
    _run(tmp_path)
    out = tmp_path / "plots" / "c.png"
    out.parent.mkdir()
    result = runner.invoke(app, ["plot", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {out} (5 steps)"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_command_defaults_to_curve_png_in_the_run(tmp_path):
    _run(tmp_path, steps=2)
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "curve.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_with_evaluations_plots_them_beside_the_reward(tmp_path):
    """--eval-every: step 0's line holds only the evaluation before the first step; evaluated steps are points."""
    held = {"version": 0, "tasks": 2, "samples": 2, "mean_reward": 0.5, "pass_at_k": {"1": 0.25, "2": 0.5}}
    _run(tmp_path, steps=3)
    records = read_metrics(tmp_path)
    records[2]["eval"] = {**held, "version": 2, "pass_at_k": None, "mean_reward": 0.75}  # no "solved": avg@K
    records = [{"step": 0, "version": 0, "eval": held}, *records]
    rewrite_metrics(tmp_path, records)
    assert evaluations([r["step"] for r in records], records) == [(0, 0.25), (3, 0.75)]
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {tmp_path / 'curve.png'} (3 steps, 2 evaluations)"


@pytest.mark.parametrize("extra", [
    {"success_rate": None, "mismatch_mean_abs": None},  # no success signal, no mismatch: both panels still draw
    {"entropy": None},  # a run trained before the entropy metric
    {"mismatch_mean_abs": 0.0},  # a zero cannot go on a log axis
])
def test_plots_with_gaps_and_zeros(tmp_path, extra):
    _run(tmp_path, steps=3, **extra)
    out = plot_training(read_metrics(tmp_path), tmp_path / "x.png", title="gaps")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_of_a_directory_without_metrics_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "has no metrics.jsonl" in lines[0], result.stderr
    assert "verbatim train --out" in lines[0]
    assert not (tmp_path / "curve.png").exists()


@pytest.mark.parametrize("content,needle", [
    ("", "metrics.jsonl is empty"),
    ('{"reward_mean": 1.0}\n', "metrics record 1 has no integer 'step'"),
])
def test_unplottable_logs_are_one_line(tmp_path, content, needle):
    (tmp_path / "metrics.jsonl").write_text(content)
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2 and needle in result.stderr, result.output


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    _run(tmp_path, steps=1)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    with pytest.raises(InputError) as caught:
        plot_training(read_metrics(tmp_path), tmp_path / "x.png", title="t")
    assert caught.value.one_line() == ("verbatim plot needs matplotlib (pip install 'verbatim-rl[report]', "
                                       "or pip install 'matplotlib>=3.7')")
    assert not os.path.exists(tmp_path / "x.png")


@pytest.mark.parametrize("damage,needle", [
    ("file", "is not a directory"),
    ("line", "metrics.jsonl line 2 is not a JSON object"),
])
def test_a_run_dir_that_is_a_file_or_a_damaged_log_is_one_line_exit_2(tmp_path, damage, needle):
    if damage == "file":
        run_dir = tmp_path / "notes.txt"
        run_dir.write_text("mine")
    else:
        run_dir = tmp_path
        (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n{"step": 2}\n')
    result = runner.invoke(app, ["plot", str(run_dir)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "(" in lines[0]  # the hint: what to fix
    assert not (tmp_path / "curve.png").exists()
