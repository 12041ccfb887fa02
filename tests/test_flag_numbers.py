"""Numbers the CLI takes and the JSON it writes (issue #23).

A float flag of any command refuses ``inf``, ``-inf`` and ``nan`` (from the command line or a
``--config`` file) and ``--seed`` of ``run`` and ``train`` refuses what vLLM's workers would: one line
naming the flag, exit 2, before any work (reaching the work fails the test). Every JSON file
written is strict JSON: a non-finite float is written as null.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app

runner = CliRunner()
INF, NAN = float("inf"), float("nan")
MAX_SEED = 2**32 - 1  # vLLM's workers: "Seed must be between 0 and 2**32 - 1"


@pytest.fixture
def no_work(monkeypatch):
    """The commands' work (and the engine and trainer under it) is a test failure here."""

    def reached(*args, **kwargs):
        raise AssertionError("bad input reached the command's work")

    for target in ("verbatim.cli.run.run_command", "verbatim.cli.train.train_command",
                   "verbatim.engine.generate.generate_once", "verbatim.bench.learn.run_all",
                   "verbatim.engine.inproc.InprocEngine.start", "verbatim.trainer.reference.load_model"):
        monkeypatch.setattr(target, reached)


def refused(args: list[str], *needles: str) -> str:
    """``verbatim ARGS`` exits 2 with one line of output holding every needle."""
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def strict_load(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as a strict JSON parser does."""

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("args,flag,value", [
    (["train", "--env", "guess", "--lr", "inf"], "--lr", "inf"),
    (["train", "--env", "guess", "--lr", "-inf"], "--lr", "-inf"),
    (["train", "--env", "guess", "--lr", "nan"], "--lr", "nan"),
    (["train", "--env", "guess", "--token-tis-cap", "inf"], "--token-tis-cap", "inf"),
    (["train", "--env", "guess", "--kl-coef", "nan"], "--kl-coef", "nan"),
    (["train", "--env", "guess", "--max-grad-norm", "Infinity"], "--max-grad-norm", "inf"),
    (["run", "--env", "guess", "--temperature", "inf"], "--temperature", "inf"),
    (["run", "--env", "guess", "--stop-grace", "inf"], "--stop-grace", "inf"),
    (["generate", "--temperature", "inf"], "--temperature", "inf"),
    (["bench", "learn", "--lr", "inf"], "--lr", "inf"),
])
def test_a_non_finite_float_flag_is_refused_naming_it(tmp_path, monkeypatch, args, flag, value):
    monkeypatch.chdir(tmp_path)
    refused(args, f"'{flag}'", f"{value} is not a finite number")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("command,name,text,key,value", [
    ("train", "c.toml", 'env = "guess"\nlr = inf\n', "lr", "inf"),
    ("train", "c.yaml", "env: guess\nlr-final: .nan\n", "lr-final", "nan"),
    ("run", "c.yaml", "env: guess\ntemperature: .inf\n", "temperature", "inf"),
    ("train", "c.toml", 'env = "guess"\nmax_grad_norm = -inf\n', "max_grad_norm", "-inf"),
])
def test_a_non_finite_float_in_a_config_file_is_refused_naming_the_key(tmp_path, monkeypatch, command, name,
                                                                        text, key, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    refused([command, "--config", name, "--out", "out"], f"{name}: {key}", f"{value} is not a finite number")
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("seed", ["-1", str(MAX_SEED + 1)])
def test_a_seed_vllm_would_refuse_is_refused_first(tmp_path, monkeypatch, command, seed):
    monkeypatch.chdir(tmp_path)
    refused([command, "--env", "guess", "--seed", seed, "--out", "out"], f"--seed {seed} must be in [0, {MAX_SEED}]")
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("no_work")
def test_a_seed_vllm_would_refuse_in_a_config_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('env = "guess"\nseed = -1\n')
    refused(["train", "--config", "c.toml", "--out", "out"], "c.toml: seed")


@pytest.mark.parametrize("command,where", [("run", "verbatim.cli.run.run_command"),
                                           ("train", "verbatim.cli.train.train_command")])
def test_the_largest_seed_and_finite_floats_pass(monkeypatch, command, where):
    seen = []
    monkeypatch.setattr(where, lambda options, *rest, **given: seen.append(options))
    result = runner.invoke(app, [command, "--env", "guess", "--seed", str(MAX_SEED), "--temperature", "0.5"])
    assert result.exit_code == 0 and len(seen) == 1, (result.output, result.exception)


def test_strict_json_writes_non_finite_floats_as_null():
    from verbatim.durable import strict_json

    text = strict_json({"a": INF, "b": [NAN, 1.5, -INF], "c": (INF, "x"), "d": {"e": NAN}, "f": 2}, indent=1)
    assert strict_load(text) == {"a": None, "b": [None, 1.5, None], "c": [None, "x"], "d": {"e": None}, "f": 2}


def test_strict_json_still_refuses_what_json_cannot_write():
    from verbatim.durable import strict_json

    with pytest.raises(TypeError):
        strict_json({"a": object()})


def test_summary_json_is_strict_json(tmp_path):
    from verbatim.cli.run import write_summary_json

    path = tmp_path / "s" / "summary.json"
    write_summary_json(str(path), {"mean_reward": NAN, "tokens_per_s": INF, "rollouts": 3})
    assert strict_load(path.read_text()) == {"mean_reward": None, "tokens_per_s": None, "rollouts": 3}


def test_bench_learn_answers_and_records_are_strict_json(tmp_path, monkeypatch):
    from verbatim.bench import learn

    result = {"run": {"label": "seed 0"}, "reward": [0.5, NAN], "gain": -INF}
    monkeypatch.setattr(learn, "train_run", lambda *args: dict(result))
    run, settings = learn.LearnRun(label="seed 0", seed=0), learn.LearnSettings()
    answer = tmp_path / "answer.json"
    learn._child({"run": run.model_dump(mode="json"), "settings": settings.model_dump(mode="json"),
                  "model": "default", "root": str(tmp_path), "answer": str(answer)})
    assert strict_load(answer.read_text())["reward"] == [0.5, None]

    record = tmp_path / "record.jsonl"
    monkeypatch.setattr(learn, "_train_in_child", lambda *args: dict(result))
    learn.run_all([run], settings, "default", record=record)
    assert strict_load(record.read_text())["gain"] is None


def test_metrics_lines_and_checkpoint_state_are_strict_json(tmp_path):
    """A step whose loss went non-finite is recorded as null in metrics.jsonl and in the checkpoint's state.json."""
    import torch

    from verbatim.harness.metrics_log import append_metrics, metrics_path
    from verbatim.trainer.checkpoint import save_checkpoint

    record = {"step": 1, "version": 1, "loss": NAN, "grad_norm": INF, "lr": 1e-5}
    append_metrics(tmp_path, record)
    assert strict_load(metrics_path(tmp_path).read_text())["loss"] is None
    model = torch.nn.Linear(2, 2)
    folder = save_checkpoint(tmp_path / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()),
                             {"version": 1, "metrics": [record]})
    state = strict_load((folder / "state.json").read_text())
    assert state["metrics"][0]["grad_norm"] is None and state["metrics"][0]["lr"] == 1e-5


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "inf"])
def test_a_non_finite_env_arg_is_refused(value):
    refused(["train", "--env", "guess", "--env-arg", f"high={value}"], f"--env-arg 'high={value}'",
            "is not a finite number")


def test_a_task_file_with_nan_is_refused_naming_its_line(tmp_path, monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("bad input reached the engine")

    monkeypatch.setattr("verbatim.engine.inproc.InprocEngine.start", reached)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"secret": 3}\n{"secret": NaN}\n')
    refused(["run", "--env", "guess", "--tasks", str(tasks), "--out", str(tmp_path / "r")],
            "tasks.jsonl line 2: NaN is not a JSON number")
