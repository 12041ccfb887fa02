"""`verbatim train` as a real process, killed with SIGKILL in each phase of a step, then resumed.

The session's real `vllm serve` of the tiny SmolLM2 (tests/conftest.py: ``tiny_server``, the default model's
architecture and tokenizer at 13 MB, since the processes, not the model, are the subject); the trainer process
talks to it with ``--engine http`` (weights reach it through a folder published under RUN_DIR/weights and
/collective_rpc), so each process starts in seconds and can be killed:

1. during step 2's rollouts (right after step 1's checkpoint, step-000001, appears), then during the
   evaluation of step 2's weights (``--eval-every 2``; it began after step-000002 was written);
2. during step 3's optimizer step (its rollouts all written, no step-000003 yet);
3. during step 3's checkpoint write, after the resumed trainer trained it again (a `.tmp-*` folder exists);
4. during the evaluation after the last step (every step trained and checkpointed: a resume owes only it);
5. then ``--resume`` to the end: step count, versions, metrics and trace continue exactly
   (every step once, every rollout once, steps counted from 1 in every file), and the run lints clean;
   the evaluation that finished was not played again, the one the kill cut short was finished once, each
   with the weights it began with.

Also here, with the same server: a resume with a changed setting, an env without rewards (a failed
run), and SIGINT (an interrupted run) resumed, finished, extended and read back from its checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from killable_train import Trainer, served, step_rollouts
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.harness.store import read_run

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS, GROUPS, SIZE = 4, 2, 2
ARGS = ["--env", "graded_env:GradedFactory", "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size",
        str(SIZE), "--max-tokens", "6", "--lr", "1e-5", "--max-model-len", "1024", "--seed", "4"]
"""Graded rewards (tests/graded_env.py): every step updates the weights and the optimizer's moments, so a
checkpoint holds both and takes long enough (a few tenths of a second for the tiny model) for a kill to land
while it is written."""
EVALUATE = ["--eval-every", "2", "--eval-groups", "2", "--eval-samples", str(SIZE)]
"""Evaluations before step 1 and after steps 2 and 4 (the env never says solved: avg@K only)."""


def checkpoints(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def evaluation(out: Path, step: int) -> dict[str, bytes]:
    """The files of the evaluation after ``step``, by name."""
    return {p.name: p.read_bytes() for p in (out / "eval" / f"step-{step:06d}").glob("rollouts-*")}


def eval_rollouts(out: Path, step: int) -> int:
    folder = out / "eval" / f"step-{step:06d}"
    return len(read_run(folder).rollouts) if (folder / "manifest.json").exists() else 0


def test_sigkill_in_every_phase_then_resume_continues_exactly(tiny_server, tmp_path):
    out = tmp_path / "run"
    args = [*ARGS, *served(tiny_server), "--out", str(out), "--keep-checkpoints", "3",
            "--checkpoint-every", "1", *EVALUATE]

    first = Trainer(tmp_path, "1", args)  # killed during step 2's rollouts
    first.kill_when(lambda: "step-000001" in checkpoints(out))
    assert step_rollouts(out, 2) < GROUPS * SIZE
    before = evaluation(out, 0)  # finished before step 1's weights were pushed
    assert len(before) == 1

    evaluating = Trainer(tmp_path, "1b", [*args, "--resume"])  # killed during the evaluation after step 2
    evaluating.kill_when(lambda: (out / "eval" / "step-000002").is_dir())
    assert "step-000002" in checkpoints(out) and eval_rollouts(out, 2) < GROUPS * SIZE

    second = Trainer(tmp_path, "2", [*args, "--resume"])  # killed during step 3's optimizer step
    second.kill_when(lambda: step_rollouts(out, 3) == GROUPS * SIZE)
    assert "step-000003" not in checkpoints(out)

    third = Trainer(tmp_path, "3", [*args, "--resume"])  # killed while step 3's checkpoint is written
    third.kill_when(lambda: any(name.startswith(".tmp-") for name in checkpoints(out)))
    assert "step-000003" not in checkpoints(out)

    fourth = Trainer(tmp_path, "4", [*args, "--resume"])  # killed during the evaluation after the last step
    fourth.kill_when(lambda: (out / "eval" / f"step-{STEPS:06d}").is_dir())
    assert f"step-{STEPS:06d}" in checkpoints(out) and eval_rollouts(out, STEPS) < GROUPS * SIZE

    last = Trainer(tmp_path, "5", [*args, "--resume", "--summary-json", str(tmp_path / "summary.json")])
    assert last.wait(600) == 0, last.err()  # every step trained, the last evaluation owed: it plays that

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(0, STEPS + 1))  # step 0: the evaluation before step 1
    assert [m["version"] for m in metrics] == list(range(0, STEPS + 1))
    assert {m["step"]: m["eval"]["version"] for m in metrics if "eval" in m} == {0: 0, 2: 2, 4: 4}
    assert all("never said whether a rollout solved" in m["eval"]["why_no_pass_at_k"] for m in metrics if "eval" in m)
    assert evaluation(out, 0) == before  # finished: read back, never played again
    for step in (0, 2, 4):  # the one the kill cut short was played to the end once, by the weights it began with
        rollouts = read_run(out / "eval" / f"step-{step:06d}").rollouts
        assert sorted(Counter(r.rollout_id for r in rollouts).values()) == [1] * GROUPS * SIZE
        assert {int(v) for r in rollouts for v in r.tokens.policy_version if v >= 0} == {step}
        lint = CliRunner().invoke(app, ["lint", "trace", str(out / "eval" / f"step-{step:06d}")])
        assert lint.exit_code == 0, lint.output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert summary["weight_share_s"] == 0  # served: weights go through a published folder, nothing is shared
    assert checkpoints(out)[-1] == f"step-{STEPS:06d}" and not any(n.startswith(".") for n in checkpoints(out))
    trace = read_run(out)
    counts = Counter(r.rollout_id for r in trace.rollouts)
    assert set(counts.values()) == {1} and len(counts) == STEPS * GROUPS * SIZE
    assert Counter(r.info["step"] for r in trace.rollouts) == {n: GROUPS * SIZE for n in range(1, STEPS + 1)}
    for rollout in trace.rollouts:  # step n plays version n - 1: a token is never newer than its step's weights
        assert rollout.tokens.policy_version.max() <= rollout.info["step"] - 1
        assert rollout.rollout_id.startswith(f"s{rollout.info['step']:04d}-")
    logprob_files = sorted(p.name for p in (out / "trainer_logprobs").iterdir())
    assert logprob_files == [f"step-{n:06d}.parquet" for n in range(1, STEPS + 1)]
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"
    lint = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert lint.exit_code == 0, lint.output[-3000:]

    changed = CliRunner().invoke(app, ["train", *args, "--resume", "--lr", "2e-5"])
    assert changed.exit_code == 2 and "lr: 1e-05 -> 2e-05" in changed.output, changed.output


def metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_checkpoints_every_k_steps_a_kill_loses_the_steps_since_and_a_stop_checkpoints_where_it_ends(
        tiny_server, tmp_path):
    out = tmp_path / "run"
    args = [*ARGS, *served(tiny_server), "--out", str(out), "--keep-checkpoints", "3",
            "--checkpoint-every", "3"]

    first = Trainer(tmp_path, "1", args)  # killed after two trained steps, neither checkpointed
    first.kill_when(lambda: len(metric_steps(out)) == 2)
    assert checkpoints(out) == []

    second = Trainer(tmp_path, "2", [*args, "--resume"])  # SIGINT once step 1 is trained again
    deadline = time.monotonic() + 300
    while metric_steps(out) != [1] and time.monotonic() < deadline and second.alive():
        time.sleep(0.01)
    os.kill(second.proc.pid, signal.SIGINT)
    assert second.wait(300) == 130, second.err()
    stopped_at = metric_steps(out)[-1]
    assert checkpoints(out) == [f"step-{stopped_at:06d}"]  # not a multiple of 3: the stop checkpointed it
    discarded = out / "discarded" / "after-step-000000"
    assert [json.loads(line)["step"] for line in (discarded / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (discarded / "trainer_logprobs").iterdir()) == ["step-000001.parquet",
                                                                                  "step-000002.parquet"]
    assert list(discarded.glob("rollouts-*"))  # step 2's rollouts (sampled by version 1) moved

    last = Trainer(tmp_path, "3", [*args, "--resume"])
    assert last.wait(600) == 0, last.err()
    assert metric_steps(out) == list(range(1, STEPS + 1))
    assert checkpoints(out)[-2:] == ["step-000003", f"step-{STEPS:06d}"]
    trace = read_run(out)
    counts = Counter(r.rollout_id for r in trace.rollouts)
    assert set(counts.values()) == {1} and len(counts) == STEPS * GROUPS * SIZE
    for rollout in trace.rollouts:  # nothing sampled by the weights the kill lost
        assert rollout.tokens.policy_version.max() <= rollout.info["step"] - 1
    lint = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert lint.exit_code == 0, lint.output[-3000:]


class Rewardless:
    """An env whose steps give no reward (None): every rollout fails, so nothing can be trained."""

    name = "rewardless"

    def reset(self, task, seed):
        from verbatim.datamodel import Message
        from verbatim.envs.base import Reset

        return Reset(messages=(Message(role="user", content="Say hi."),))

    def step(self, message):
        from verbatim.envs.base import StepResult

        return StepResult(messages=(), reward=None, done=True)


def test_an_env_without_rewards_is_one_line_and_writes_no_checkpoint(tiny_server, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n{"id": "b"}\n')
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--env", "test_train_resume:Rewardless", "--task-file", str(tasks),
                                      "--steps", "2", "--group-size", "2", "--max-tokens", "4", *served(tiny_server),
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "no group of this step has two rollouts that ended with a reward" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert checkpoints(out) == [] and len(read_run(out).rollouts) == 4  # the failed rollouts are data
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"  # not "completed"


def test_sigint_records_interrupted_then_resume_finishes_extends_and_reads_the_checkpoints(tiny_server, tmp_path):
    out = tmp_path / "run"
    common = ["--env", "guess", "--groups", "2", "--group-size", "2", "--max-turns", "2", "--max-tokens", "8",
              "--max-model-len", "1024", *served(tiny_server), "--out", str(out), "--eval-every", "1",
              "--eval-groups", "1", "--eval-samples", "2"]
    args = [*common, "--steps", "2"]
    first = Trainer(tmp_path, "1", args)
    deadline = time.monotonic() + 300
    while not (out / "eval" / "step-000001").is_dir() and time.monotonic() < deadline and first.alive():
        time.sleep(0.01)
    os.kill(first.proc.pid, signal.SIGINT)  # during the evaluation of step 1's weights
    assert first.wait(300) == 130, first.err()
    assert "interrupted by SIGINT" in first.err()
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"  # was "completed"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and "eval" not in lines[1]  # the step's line, its evaluation cut
    assert "step-000001" in checkpoints(out)  # a stop checkpoints where it ends: the resume evaluates from there

    finished = Trainer(tmp_path, "2", [*args, "--resume"])
    assert finished.wait(300) == 0, finished.err()
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"
    again = CliRunner().invoke(app, ["train", *args, "--resume"])
    assert again.exit_code == 0 and "is complete: all 2 steps are trained" in " ".join(again.output.split())

    extended = Trainer(tmp_path, "3", [*common, "--steps", "3", "--resume"])  # the one setting a resume may raise
    assert extended.wait(300) == 0, extended.err()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["version"]) for m in metrics] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [m["eval"]["version"] for m in metrics] == [0, 1, 2, 3]
    assert len(read_run(out / "eval" / "step-000001").rollouts) == 2  # the cut one finished once
    counts = Counter(r.rollout_id for r in read_run(out).rollouts)
    assert set(counts.values()) == {1} and len(counts) == 3 * 4

    from transformers import AutoModelForCausalLM  # a checkpoint is a model folder

    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-000003")
    report = CliRunner().invoke(app, ["mismatch", str(out), "--json"])
    assert report.exit_code == 0, report.output
    shown = json.loads(report.output)
    assert shown["trainer_version"] == 2 and shown["weights_source"] == "checkpoint step-000002"
    assert shown["metrics"]["by_lag"]["0"]["mean_abs_log_ratio"] < 1e-3  # π of the weights that sampled them
    beyond = CliRunner().invoke(app, ["mismatch", str(out), "--trainer-version", "99"])
    assert beyond.exit_code == 2 and "--trainer-version 99" in beyond.output and "versions 0 to 3" in beyond.output


def test_a_run_on_a_server_another_run_trained_samples_its_first_step_with_its_own_weights(
        tiny_server, tmp_path):
    """The first run leaves its trained weights (its version 1) in the server; a ``verbatim run`` and then a second
    training run begin on the same server, and their tokens must be sampled by the base model they record: μ equal
    to the base model's log-probabilities recomputed with transformers, far from the first run's weights."""
    from trained_run import assert_sampled_with_base_not

    common = ["train", "--env", "graded_env:GradedFactory", "--steps", "1", "--groups", "2", "--group-size", "4",
              "--max-tokens", "8", "--max-model-len", "1024", *served(tiny_server)]
    first, played, second = tmp_path / "first", tmp_path / "played", tmp_path / "second"
    done = CliRunner().invoke(app, [*common, "--lr", "1e-3", "--out", str(first)])
    assert done.exit_code == 0, done.output
    done = CliRunner().invoke(app, ["run", "--env", "graded_env:GradedFactory", "--groups", "1", "--group-size", "2",
                                    "--max-tokens", "8", *served(tiny_server),
                                    "--out", str(played)])
    assert done.exit_code == 0, done.output
    done = CliRunner().invoke(app, [*common, "--lr", "1e-5", "--out", str(second)])
    assert done.exit_code == 0, done.output
    assert_sampled_with_base_not(first, [played, second], Path(tiny_server.config.model))
