"""Bad input to ``verbatim train``: exit 2, one line naming what to fix, nothing written, and all
of it before an engine starts or a model loads (reaching either fails the test)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from command_config import config_of
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.harness.store import RunManifest, TraceWriter

runner = CliRunner()


@pytest.fixture(autouse=True)
def nothing_heavy(monkeypatch):
    """Loading the trainer's model or starting the engine is a test failure here."""

    def reached(*args, **kwargs):
        raise AssertionError("bad input reached the model or the engine")

    monkeypatch.setattr("verbatim.trainer.reference.load_model", reached)
    monkeypatch.setattr("verbatim.engine.inproc.InprocEngine.start", reached)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime: what 'nothing written' compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def refused(args: list[str], needle: str) -> str:
    """``verbatim train ARGS`` exits 2 within seconds with one line of output that holds ``needle``."""
    began = time.monotonic()
    result = runner.invoke(app, ["train", *args])
    elapsed = time.monotonic() - began
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert needle in lines[0], lines[0]
    assert elapsed < 10, f"took {elapsed:.1f}s to refuse"
    return lines[0]


@pytest.mark.parametrize("flags,needle", [
    (["--lr", "0"], "--lr 0 must be above 0"),
    (["--lr", "-1"], "--lr -1 must be above 0"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--group-size", "1"], "--group-size 1 must be at least 2"),
    (["--groups", "0"], "--groups 0 must be at least 1"),
    (["--lr-schedule", "step"], "--lr-schedule step must be 'constant', 'linear' or 'cosine'"),
    (["--lr-final", "2"], "--lr-final 2 must be"),
    (["--advantage", "ppo"], "--advantage ppo must be 'grpo', 'rloo' or 'mean'"),
    (["--cache-policy", "sometimes"], "--cache-policy sometimes must be 'flush', 'keep', 'salt' or 'keep+salt'"),
    (["--sequence-tis", "product"], "--sequence-tis product replaces token-level TIS, which --token-tis-cap 2 "
                                    "keeps on: add --token-tis-cap 0"),
    (["--sequence-tis", "mean", "--token-tis-cap", "0"], "--sequence-tis mean must be 'product' or 'geo_mean'"),
    (["--token-mask-band", "5"], "--token-mask-band 5 must look like LOW,HIGH"),
    (["--sequence-mask-band", "3,1"], "--sequence-mask-band 3,1 must satisfy 0 <= LOW < HIGH"),
    (["--env-arg", "nokey"], "--env-arg 'nokey' must look like KEY=VALUE"),
    (["--env", "gues"], "unknown env 'gues' (did you mean 'guess'?"),
    (["--updates-per-step", "0"], "--updates-per-step 0 must be at least 1"),
    (["--updates-per-step", "9", "--groups", "2", "--group-size", "4"],
     "--updates-per-step 9 is more than the 8 rollouts a step trains (--groups 2 × --group-size 4)"),
    (["--trainer-procs", "3", "--groups", "2"], "3 trainer ranks for the 2 groups of a step: a group trains on one "
                                                "rank whole, so 1 ranks would never train"),
    (["--microbatch-tokens", "1024", "--max-model-len", "2048"], "--microbatch-tokens 1024 is below the context "
                                                                 "length 2048 (--max-model-len)"),
    (["--microbatch-tokens", "0"], "--microbatch-tokens 0 must be at least 1"),
    (["--top-p", "0.9"], "top-p 0.9: a mask of the sampling distribution the trainer does not reproduce"),
    (["--top-k", "20", "--top-p", "0.5"], "top-p 0.5, top-k 20: a mask"),
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k -1 must be at least 0"),
    (["--clip-eps", "1.5"], "--clip-eps 1.5 must be in (0, 1)"),
    (["--clip-eps", "0"], "--clip-eps 0 must be in (0, 1)"),
    (["--normaliser", "words"], "--normaliser words must be 'token' or 'sequence'"),
    (["--kl-coef", "-0.1"], "--kl-coef -0.1 must be at least 0"),
    (["--kl-estimator", "k1"], "--kl-estimator k1 must be 'k3' or 'k2'"),
    (["--temperature", "0"], "--temperature 0 must be above 0"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0 must be above 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0 must be at least 1"),
    (["--engine", "http"], "--engine http needs --url"),
    (["--engine", "vllm"], "--engine vllm must be 'inproc' or 'http'"),
    (["--task-file", "missing.jsonl"], "missing.jsonl does not exist"),
    (["--trainer-device", "gpu"], "--trainer-device 'gpu' is not a device"),
    (["--trainer-device", "meta"], "--trainer-device 'meta': the trainer runs on cpu or cuda"),
    (["--trainer-device", "cuda:99"], "--trainer-device cuda:99: torch sees"),  # none here, or fewer than 100
])
def test_a_bad_option_is_one_line_naming_it_and_writes_nothing(tmp_path, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    env = [] if "--env" in flags else ["--env", "guess"]
    refused([*env, *flags, "--out", str(tmp_path / "out")], needle)
    assert tree(tmp_path) == {}


def passes_the_check(args: list[str], monkeypatch) -> None:
    """``verbatim ARGS`` gets past every check of its inputs to the start of its engine (stopped there)."""

    def passed(*given, **keywords):
        raise AssertionError("passed")

    monkeypatch.setattr("verbatim.jobs.compose.make_engine", passed)
    result = runner.invoke(app, args)
    assert isinstance(result.exception, AssertionError) and str(result.exception) == "passed", result.output


def _manifest(out: Path, config: dict) -> None:
    TraceWriter(out, RunManifest(run_id="earlier", model="m", renderer="r", engine={"block_size": 16},
                                 config=config))


def test_a_used_out_without_resume_is_refused_untouched(tmp_path):
    out = tmp_path / "run"
    _manifest(out, {"train": {"env": "guess"}})
    before = tree(tmp_path)
    refused(["--env", "guess", "--out", str(out)], f"{out} already holds a run (pass --resume")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("made", [False, True])
def test_resume_where_there_is_no_run_is_refused(tmp_path, made):
    out = tmp_path / "typo"
    if made:
        out.mkdir()
    refused(["--env", "guess", "--out", str(out), "--resume"], f"--resume: {out} holds no run to resume")
    assert out.exists() == made and (not made or not any(out.iterdir()))


def test_resuming_a_verbatim_run_directory_is_refused_untouched(tmp_path):
    out = tmp_path / "run"
    _manifest(out, {"groups": 2, "group_size": 4, "env": "guess"})
    before = tree(tmp_path)
    refused(["--env", "guess", "--out", str(out), "--resume"], "holds a 'verbatim run' run, not a training run")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("changed,needle", [
    (["--lr", "2e-5"], "--resume with a changed config: learner.lr: 1e-05 -> 2e-05"),
    (["--group-size", "8"], "--resume with a changed config: plan.group_size: 4 -> 8"),
    (["--env-arg", "high=5"], "--resume with a changed config: play.env_args.high: (missing) -> 5"),
    (["--fixed-lag"], "--resume with a changed config: plan.fixed_lag: False -> True"),
    (["--kl-coef", "0.05"], "--resume with a changed config: learner.loss.kl_coef: 0.0 -> 0.05"),
])
def test_resuming_with_a_changed_setting_names_it(tmp_path, monkeypatch, changed, needle):
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out)]
    options = config_of("train", args, monkeypatch)
    _manifest(out, options.config())
    before = tree(tmp_path)
    line = refused([*args, "--resume", *changed], needle)
    assert line.count("->") == 1, line  # only the changed setting
    assert tree(tmp_path) == before


def test_the_first_runs_settings_pass_the_resume_check(tmp_path, monkeypatch):
    """The control of the test above: same settings, so the check lets the resume through to the model."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--lr", "3e-5"]
    _manifest(out, config_of("train", args, monkeypatch).config())

    passes_the_check(["train", *args, "--resume"], monkeypatch)


def test_a_run_recorded_before_fixed_lag_existed_resumes_as_it_trained(tmp_path, monkeypatch):
    """Its config lacks ``plan.fixed_lag``: it trained with eager pushes, which is what a resume without the flag
    asks for (rl/train_resume.py's ADDED), so the check lets it through; with the flag it is a change."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--max-lag", "1"]
    config = config_of("train", args, monkeypatch).config()
    assert config["train"]["plan"]["fixed_lag"] is False
    assert config_of("train", [*args, "--fixed-lag"], monkeypatch).plan.fixed_lag
    del config["train"]["plan"]["fixed_lag"]
    _manifest(out, config)

    passes_the_check(["train", *args, "--resume"], monkeypatch)
    refused([*args, "--resume", "--fixed-lag"], "plan.fixed_lag: False -> True")


def test_a_run_recorded_before_the_kl_penalty_existed_resumes_without_one(tmp_path, monkeypatch):
    """Its config lacks ``learner.loss.kl_coef`` and ``kl_estimator``: it trained without a penalty, whatever the
    estimator, so a resume without --kl-coef goes through and one with it is a change."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out)]
    config = config_of("train", args, monkeypatch).config()
    penalised = config_of("train", [*args, "--kl-coef", "0.1", "--kl-estimator", "k2"], monkeypatch)
    assert penalised.learner.loss.kl_coef == 0.1
    for key in ("kl_coef", "kl_estimator"):
        del config["train"]["learner"]["loss"][key]
    _manifest(out, config)

    for extra in ([], ["--kl-estimator", "k2"]):
        passes_the_check(["train", *args, "--resume", *extra], monkeypatch)
    refused([*args, "--resume", "--kl-coef", "0.1"], "learner.loss.kl_coef: 0.0 -> 0.1")


def test_a_run_recorded_before_routing_replay_existed_resumes_without_it_and_not_with_it(tmp_path, monkeypatch):
    """Its config lacks ``learner.routing_replay``, ``engine.record_routing`` and ``learner.lora`` (a run older than
    LoRA, which a resume could not go on with until 2026-12-06): its rollouts were recorded without
    routed experts, so a resume without the flags goes through, and one that asks to replay routing its recorded
    rollouts lack is refused in one line before anything starts (issue #48's "a trace recorded without
    routing")."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out)]
    config = config_of("train", args, monkeypatch).config()
    del config["train"]["learner"]["routing_replay"]
    del config["train"]["engine"]["record_routing"]
    del config["train"]["learner"]["lora"]  # before LoRA existed too: it trained the whole model
    _manifest(out, config)

    passes_the_check(["train", *args, "--resume"], monkeypatch)
    refused([*args, "--resume", "--routing-replay"], "learner.routing_replay: False -> True")
    refused([*args, "--resume", "--lora-rank", "8"], "learner.lora.rank: None -> 8")


def test_the_trainer_device_may_change_on_resume(monkeypatch):
    """Where the trainer runs does not change what it computes: not part of the config a resume matches."""
    args = ["--env", "guess", "--out", "run"]
    on_cpu = config_of("train", args, monkeypatch)
    on_gpu = config_of("train", [*args, "--trainer-device", "cuda:1"], monkeypatch)
    assert (on_cpu.placement.trainer_device, on_gpu.placement.trainer_device) == ("cpu", "cuda:1")
    assert on_cpu.config() == on_gpu.config()


def test_help_names_keep_salt_as_the_default_cache_policy():
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert re.search(r"--cache-policy \S+ flush \| keep \| salt \| keep\+salt\. keep\+salt \(docs/engine",
                     text), text
    assert "[default: keep+salt]" in text


# -- what a resume may go on from ---------------------------------------------------------------------


def _trained_run(out: Path, config: dict, steps: int, checkpointed: int, rollout_steps: tuple[int, ...] = ()) -> None:
    """A training run's files as the loop leaves them: metrics lines of ``steps`` steps, checkpoints of the first
    ``checkpointed``, and one rollout of each step in ``rollout_steps``."""
    import json

    import numpy as np

    from verbatim.datamodel import Rollout, TokenColumns
    from verbatim.harness.metrics_log import append_metrics
    from verbatim.trainer.checkpoint import FILES, step_dir_name

    _manifest(out, config)
    for n in range(1, steps + 1):
        append_metrics(out, {"step": n, "version": n})
    for n in range(1, checkpointed + 1):
        folder = out / "checkpoints" / step_dir_name(n)
        folder.mkdir(parents=True)
        for name in FILES:
            (folder / name).write_text(json.dumps({"schema": 1, "step": n}) if name == "state.json" else "")
    tokens = TokenColumns(token_id=np.arange(2), source=np.zeros(2), logprob=np.full(2, np.nan),
                          policy_version=np.full(2, -1), turn=np.zeros(2))
    rollouts = [Rollout(run_id="earlier", group_id=f"s{n:04d}-g0000", rollout_id=f"s{n:04d}-g0000-r00", tokens=tokens,
                        status="error", error="x", info={"step": n}) for n in rollout_steps]
    TraceWriter(out, RunManifest(run_id="earlier", engine={"block_size": 16}, config=config)).write_batch(rollouts)


@pytest.mark.parametrize("checkpointed,rollout_steps,needle", [
    (0, (1, 2), "records step 2 (metrics.jsonl) but there is no checkpoint"),  # rm -rf RUN/checkpoints
    (1, (1, 2), "records step 2 (metrics.jsonl) but the newest checkpoint is step 1"),  # the newest one removed
])
def test_a_resume_whose_recorded_steps_have_no_checkpoint_is_refused_untouched(tmp_path, monkeypatch, checkpointed,
                                                                              rollout_steps, needle):
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--steps", "3", "--checkpoint-every", "1"]
    _trained_run(out, config_of("train", args, monkeypatch).config(), 2, checkpointed, rollout_steps)
    before = tree(tmp_path)
    refused([*args, "--resume"], needle)
    assert tree(tmp_path) == before


def test_rollouts_of_a_step_the_loop_could_not_have_begun_refuse_the_resume(tmp_path, monkeypatch):
    """No metrics line says so, but step 3's rollouts are written while only step 1 is checkpointed (max lag 0):
    step 2 would be played into the trace beside them, and step 3 again."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--steps", "3", "--checkpoint-every", "1"]
    _trained_run(out, config_of("train", args, monkeypatch).config(), 1, 1, (1, 2, 3))
    refused([*args, "--resume"], "records step 3 (the trace's rollouts) but the newest checkpoint is step 1")


def test_a_killed_steps_rollouts_let_the_resume_through(tmp_path, monkeypatch):
    """The control: step 2's rollouts on disk with step 1 checkpointed is what a kill during step 2 leaves."""
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--steps", "3", "--checkpoint-every", "1"]
    _trained_run(out, config_of("train", args, monkeypatch).config(), 1, 1, (1, 2))

    passes_the_check(["train", *args, "--resume"], monkeypatch)


def test_resuming_a_finished_run_says_it_is_complete_and_starts_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--steps", "2"]
    _trained_run(out, config_of("train", args, monkeypatch).config(), 2, 2)
    before = tree(tmp_path)
    result = runner.invoke(app, ["train", *args, "--resume"])
    assert result.exit_code == 0, result.output
    assert f"{out} is complete: all 2 steps are trained" in " ".join(result.output.split())
    assert tree(tmp_path) == before
    summary = tmp_path / "summary.json"  # a script that always asks for the summary still gets it
    assert runner.invoke(app, ["train", *args, "--resume", "--summary-json", str(summary)]).exit_code == 0
    assert json.loads(summary.read_text())["steps"] == 2


@pytest.mark.parametrize("schedule,steps,needle", [
    ("constant", "4", None),  # passes the check
    ("linear", "4", "--resume --steps 4: the linear learning-rate schedule is spread over the 3 planned steps"),
    ("constant", "2", "--resume with a changed config: plan.steps: 3 -> 2"),
])
def test_a_resume_may_raise_steps_under_a_constant_learning_rate(tmp_path, monkeypatch, schedule, steps, needle):
    out = tmp_path / "run"
    args = ["--env", "guess", "--out", str(out), "--lr-schedule", schedule]
    _trained_run(out, config_of("train", [*args, "--steps", "3"], monkeypatch).config(), 3, 3)
    if needle is not None:
        refused([*args, "--steps", steps, "--resume"], needle)
        return

    passes_the_check(["train", *args, "--steps", steps, "--resume"], monkeypatch)


def test_a_prompt_that_cannot_fit_the_context_with_max_tokens_is_refused_before_the_engine(tmp_path):
    out = tmp_path / "run"
    refused(["--env", "guess", "--out", str(out), "--max-tokens", "5000", "--max-model-len", "4096"],
            "with --max-tokens 5000 it does not fit --max-model-len 4096 (raise --max-model-len or lower --max-tokens)")
    assert not out.exists()


def test_a_step_whose_rollouts_failed_or_were_cut_prints_one_line_under_its_own(tmp_path, monkeypatch):
    """``train`` says under a step's line what went wrong with its rollouts (the step record's counts), as ``run``
    does under its summary."""
    import io

    from rich.console import Console

    from verbatim.cli.train import train_command

    record = {"step": 1, "version": 1, "statuses": {"ok": 4, "error": 2, "truncated": 2}, "cut_at_max_turns": 2,
              "history_breaks": 0, "first_error": "the agent raised KeyError: 'x'"}

    def one_step(options, console, *, on_step, on_end, engine):
        on_step(record)
        return []

    monkeypatch.setattr("verbatim.cli.train.run_training", one_step)
    printed = io.StringIO()
    options = config_of("train", ["--env", "guess", "--out", str(tmp_path / "run"), "--steps", "1"], monkeypatch)
    train_command(options, Console(file=printed, width=400))
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("step 1/1 · v1")
    assert lines[1] == (f"  step 1: 2 of 8 rollouts failed (2 error: no reward), first: the agent raised KeyError: "
                        f"'x'; 2 of 8 were cut at --max-turns ('verbatim show {tmp_path / 'run'}' shows each rollout)")
