"""`verbatim train --trainer-procs 2` on the real engine: a model of the default's family sharded over two gloo ranks.

The engine is the session's `vllm serve` of the tiny SmolLM2 (tests/conftest.py: ``tiny_server``, the default
model's architecture, tied output layer and tokenizer at 13 MB; the team, not the engine's start nor the model's
size, is the subject here), which every run begins with its own weights.

Three steps of the graded env (rewards differ within a group, so every step moves the weights), two
groups (one a rank), with rank 1 SIGKILLed during step 2: one line names it, and ``--resume`` restores
the team from step 1's checkpoint and finishes the run: versions go 0 → 3, `lint trace` is clean, each
synchronous step's π_old equals the μ its rollouts were sampled with, and the tokens of step 3 have the
logprobs of the checkpoint of step 2 (trained by the resumed team, written by rank 0 from the gathered
shards, loaded here in one process), not the base weights'. The same command under ``torchrun
--nproc-per-node 2`` trains a step with rank 0 alone running the loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from killable_train import served
from subprocess_cli import cli, communicate_or_stacks
from trained_run import assert_sampled_with_previous_checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_torchrun_launches_the_same_train_command_as_a_team_of_two(tmp_path, tiny_server):
    """The documented launch: plain torchrun on `verbatim train`; rank 0 runs the loop, rank 1 follows."""
    out = tmp_path / "run"
    done = cli("train", "--env", "graded_env:GradedFactory", "--steps", "1", "--groups", "2", "--group-size", "2",
               "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4", *served(tiny_server),
               "--out", str(out), launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("┃ step ┃") == 1  # rank 0 alone prints the run's table (its title may wrap)
    assert not (out / "trainer-rank1.log").exists()  # torchrun started rank 1, not verbatim
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["version"], x["rows"]) for x in lines] == [(1, 1, 4)]
    assert lines[0]["grad_norm"] > 0 and lines[0]["mismatch_mean_abs"] < 1e-4
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_trainer_rank_killed_mid_run_stops_the_run_naming_it_and_resume_finishes_it(tmp_path, tiny_server):
    """SIGKILL of rank 1 during step 2: one line names the rank, nothing past step 1 is committed, and
    ``--resume`` (restoring the team from the checkpoint of step 1) trains steps 2 and 3 once each."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    args = ["train", "--env", "graded_env:GradedFactory", "--steps", "3", "--groups", "2", "--group-size", "2",
            "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4", *served(tiny_server),
            "--checkpoint-every", "1", "--trainer-procs", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")) if p))
    run = subprocess.Popen([sys.executable, "-m", "verbatim.cli", *args], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while len(list(out.glob("rollouts-*"))) < 2 and time.monotonic() < deadline:  # step 1 trained, step 2 played…
        assert run.poll() is None, run.communicate()
        time.sleep(0.01)
    time.sleep(0.1)  # …and its rollouts written: its training is under way (0.6 s on one core, then a checkpoint)
    follower = subprocess.run(["pgrep", "-f", "verbatim.jobs.trainer_team"], capture_output=True, text=True)
    os.kill(int(follower.stdout.split()[0]), signal.SIGKILL)
    stdout, stderr = communicate_or_stacks(run, timeout=300)
    assert run.returncode == 1, stdout + stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer rank 1 ended (killed by SIGKILL)" in errors[0], stderr
    assert "Traceback" not in stderr
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]

    done = cli(*args, "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(x["step"], x["version"], x["rows"]) for x in lines] == [(1, 1, 4), (2, 2, 4), (3, 3, 4)]
    assert all(x["mismatch_mean_abs"] < 1e-4 and x["grad_norm"] > 0 for x in lines), lines
    assert (out / "trainer-rank1.log").exists()  # verbatim started rank 1 (torchrun's test: it did not)
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert_sampled_with_previous_checkpoint(out, Path(tiny_server.config.model), step=3)  # the resumed team's push
