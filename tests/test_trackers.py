"""``--log``: each tracker written through its library, read back with the library's own reader.

The engine tests train 2 steps (and play one run) with all four trackers in their offline modes and compare
what each reader gives with ``metrics.jsonl`` (the run's summary for ``run``), the rollout tables with the
trace, and the config with the run's.
"""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import tracker_readers as read
from rich.console import Console

from verbatim.cli.run import run_command
from verbatim.datamodel import Rollout, TokenColumns
from verbatim.errors import InputError
from verbatim.harness.store import read_run
from verbatim.jobs.config import RunOptions, TrainConfig
from verbatim.jobs.train import run_training
from verbatim.rl.plan import TrainPlan
from verbatim.trackers.fanout import Trackers, open_trackers, tracker_names
from verbatim.trackers.records import ROLLOUT_COLUMNS, ROLLOUTS_SHOWN, flat_config, markdown_table, scalars, table_rows

ALL = ("tensorboard", "mlflow", "wandb", "trackio")


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """One trackio store for the session: trackio reads TRACKIO_DIR once, when first imported (the reader here),
    so every test's runs go to the same store, told apart by their names."""
    return tmp_path_factory.mktemp("trackio")


@pytest.fixture
def offline(tmp_path, monkeypatch, trackio_dir):
    """Every tracker offline, its files under tmp_path (also for the subprocesses, which inherit it)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    for name, folder in (("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_CACHE_DIR", "wandb-cache"),
                         ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(name, str(tmp_path / folder))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the readers open the same local store
    return tmp_path


def test_scalars_flatten_nested_numbers_and_leave_out_the_rest():
    record = {"loss": 0.5, "ok": True, "ratio_quantiles": {"p01": 0.9, "p99": 1.1}, "statuses": {"ok": 3},
              "trainer_path": "prefixflow", "mismatch": None, "nan": float("nan"), "by_step": [1, 2]}
    assert scalars(record) == {"loss": 0.5, "ok": 1.0, "ratio_quantiles/p01": 0.9, "ratio_quantiles/p99": 1.1,
                               "statuses/ok": 3.0}
    assert flat_config({"lr": 1e-5, "plan": {"seed": 5}, "empty": {}}) == {"lr": "1e-05", "plan.seed": "5",
                                                                           "empty": "{}"}


def test_a_steps_table_shows_the_first_rollouts_by_id_and_markdown_escapes_cells():
    rows = [{"rollout": f"g0-r{i:02d}", "reward": i, "status": "ok", "turns": 1, "tokens": 3, "sampled": 1,
             "text": "a|b\nc"} for i in reversed(range(ROLLOUTS_SHOWN + 3))]
    table = table_rows(rows)
    assert [row[0] for row in table] == [f"g0-r{i:02d}" for i in range(ROLLOUTS_SHOWN)]
    assert len(table[0]) == len(ROLLOUT_COLUMNS)
    assert "a\\|b<br>c" in markdown_table(table[:1])


def test_an_unknown_or_missing_tracker_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    with pytest.raises(InputError, match="--log comet: no such tracker"):
        tracker_names(["comet"])
    assert tracker_names(["wandb", "mlflow", "wandb"]) == ("wandb", "mlflow")
    real = importlib.import_module

    def without_wandb(name, *args):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_wandb)
    with pytest.raises(InputError) as refused:
        open_trackers(["wandb"], tmp_path, {})
    assert "needs the wandb package" in str(refused.value)
    assert "pip install 'verbatim-rl[wandb]'" in refused.value.one_line()


class _Failing:
    name = "broken"

    def log(self, step, metrics, rollouts):
        raise RuntimeError("disk full")

    def close(self):
        pass


class _Kept:
    name = "kept"

    def __init__(self):
        self.steps = []

    def log(self, step, metrics, rollouts):
        self.steps.append((step, metrics, rollouts))

    def close(self):
        pass


def _rollout(rollout_id: str, step: int) -> Rollout:
    tokens = TokenColumns(token_id=np.array([1, 2, 3]), source=np.array([0, 2, 2]),
                          logprob=np.array([np.nan, -0.5, -0.25]), policy_version=np.array([-1, 0, 0]),
                          turn=np.array([-1, 0, 0]))
    return Rollout(run_id="r", group_id="g", rollout_id=rollout_id, tokens=tokens, reward=1.0,
                   info={"step": step, "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "3"}]})


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_others_go_on():
    kept, lines = _Kept(), []
    trackers = Trackers([_Failing(), kept], warn=lines.append)
    trackers.rollout(_rollout("s0001-g0000-r00", 1))
    trackers.rollout(_rollout("s0002-g0000-r00", 2))
    trackers.step({"step": 1, "loss": 0.5})
    trackers.step({"step": 2, "loss": 0.25})
    assert len(lines) == 1 and "--log broken failed at step 1" in lines[0] and "metrics.jsonl" in lines[0]
    assert [(s, m) for s, m, _ in kept.steps] == [(1, {"loss": 0.5}), (2, {"loss": 0.25})]
    assert kept.steps[0][2] == [["s0001-g0000-r00", 1.0, "ok", 0, 3, 2, "user: hi\nassistant: 3"]]


def _close(logged: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert logged.keys() == expected.keys()
    for step, numbers in expected.items():
        got = {k: v for k, v in logged[step].items() if not k.startswith("_")}
        assert got.keys() == numbers.keys(), step
        assert all(got[k] == pytest.approx(v, rel=1e-6, abs=1e-12) for k, v in numbers.items()), step


def _read_all(out: Path, run_name: str):
    return {"tensorboard": read.tensorboard(out), "mlflow": read.mlflow(out), "wandb": read.wandb(out),
            "trackio": read.trackio("verbatim", run_name)}


def _table_ids(name: str, table) -> list[str]:
    if name == "tensorboard":
        return [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]
    if name == "mlflow":
        return [row["rollout"] for row in table]
    if name == "wandb":
        return [row[0] for row in table["data"]]
    return [row["rollout"] for row in table["_value"]]


@pytest.mark.engine
@pytest.mark.slow
def test_train_logs_every_step_to_each_tracker_as_metrics_jsonl_has_it(offline, engine_runner):
    """``verbatim train --log …`` for every tracker, through its entry point, given the session's engine; with
    ``--eval-every 2`` the evaluations (step 0's before the first step, step 2's after the last) are scalars too."""
    out = offline / "logged"
    run_training(TrainConfig(play={"env": "graded_env:GradedFactory"}, sampling={"max_tokens": 8},
                             engine={"max_model_len": 1024}, output={"out": str(out), "log": ALL},
                             plan=TrainPlan(steps=2, groups=2, group_size=2, seed=3),
                             evaluation={"eval_every": 2, "eval_groups": 1, "eval_samples": 2}),
                 engine=engine_runner.engine)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {r["step"]: scalars({k: v for k, v in r.items() if k != "step"}) for r in records}
    assert [step for step, found in expected.items() if "eval/mean_reward" in found] == [0, 2]
    trace = read_run(out)
    ids = {step: sorted(r.rollout_id for r in trace.rollouts if r.info["step"] == step)[:ROLLOUTS_SHOWN]
           for step in expected if step > 0}  # step 0 played no training rollouts: no table
    for name, (steps, tables, config) in _read_all(out, "logged").items():
        _close(steps, expected)
        assert {step: _table_ids(name, table) for step, table in tables.items()} == ids, name
        assert '"seed": 3' in config if name == "tensorboard" else \
            ("plan.seed", "3") in config.items() if name == "mlflow" else config["plan"]["seed"] == 3, name


@pytest.mark.engine
@pytest.mark.slow
def test_run_logs_its_summary_and_rollouts_to_each_tracker(offline, engine_runner):
    """``verbatim run --log … --summary-json`` for every tracker, as the CLI runs it, given the session's engine."""
    out = offline / "played"
    options = RunOptions(play={"env": "guess", "max_turns": 1}, sampling={"max_tokens": 8},
                         engine={"max_model_len": 1024}, output={"out": str(out), "log": ALL}, groups=1, group_size=2)
    run_command(options, Console(file=io.StringIO()), str(offline / "summary.json"), engine=engine_runner.engine)
    expected = {0: scalars(json.loads((offline / "summary.json").read_text()))}
    ids = sorted(r.rollout_id for r in read_run(out).rollouts)
    for name, (steps, tables, _) in _read_all(out, "played").items():
        _close(steps, expected)
        assert _table_ids(name, tables[0]) == ids, name
