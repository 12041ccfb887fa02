"""`verbatim train --trainer-procs 2` on the real engine: the default model sharded over two gloo ranks.

Two steps of the graded env (rewards differ within a group, so every step moves the weights), two
groups (one a rank): versions go 0 → 2, `lint trace` is clean, each synchronous step's π_old equals the
μ its rollouts were sampled with, and the tokens of step 2 have the logprobs of the checkpoint of step
1 (written by rank 0 from the gathered shards, loaded here in one process), not the base weights'.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from subprocess_cli import cli

from verbatim.datamodel import Source
from verbatim.harness.store import read_run
from verbatim.trainer.checkpoint import load_checkpoint
from verbatim.trainer.reference import load_model, reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

AGREEMENT = 1e-3  # fp32 engine vs transformers, max |Δ logprob| (docs/engine.md)


def test_two_trainer_processes_train_the_default_model_on_the_real_engine(tmp_path, default_model_dir):
    out = tmp_path / "run"
    done = cli("train", "--env", "graded_env:GradedFactory", "--steps", "2", "--groups", "2", "--group-size", "2",
               "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4", "--kv-cache-gib", "1",
               "--checkpoint-every", "1", "--trainer-procs", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "trainer-rank1.log").exists()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2]
    for record in lines:
        assert record["rows"] == 4 and record["grad_norm"] > 0
        assert record["mismatch_mean_abs"] < 1e-4, record  # the engine held the trainer's weights of that version
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr

    base = load_model(default_model_dir).eval()
    trained = load_model(default_model_dir)
    assert load_checkpoint(out / "checkpoints" / "step-000001", trained, None)["version"] == 1
    trained.eval()
    moved = 0.0
    for rollout in (r for r in read_run(out).rollouts if r.info["step"] == 2):
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        assert set(tokens.policy_version[at].tolist()) == {1}
        with torch.no_grad():
            want = reference_logprobs(trained, tokens.token_id, at).numpy()
            before = reference_logprobs(base, tokens.token_id, at).numpy()
        assert np.abs(want - tokens.logprob[at]).max() < AGREEMENT, rollout.rollout_id
        moved = max(moved, float(np.abs(before - tokens.logprob[at]).max()))
    assert moved > 10 * AGREEMENT, "step 1 did not move the weights: the push proves nothing"


def test_a_trainer_rank_killed_mid_run_stops_the_run_naming_it_and_resume_finishes_it(tmp_path):
    """SIGKILL of rank 1 during step 2: one line names the rank, nothing past step 1 is committed, and
    ``--resume`` (restoring the team from the checkpoint of step 1) trains steps 2 and 3 once each."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    args = ["train", "--env", "graded_env:GradedFactory", "--steps", "3", "--groups", "2", "--group-size", "2",
            "--max-turns", "1", "--max-tokens", "8", "--lr", "3e-4", "--seed", "4", "--kv-cache-gib", "1",
            "--checkpoint-every", "1", "--trainer-procs", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")) if p))
    run = subprocess.Popen([sys.executable, "-m", "verbatim.cli", *args], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()
        time.sleep(0.5)
    time.sleep(2.0)  # step 2's short rollouts played: its training is under way
    follower = subprocess.run(["pgrep", "-f", "verbatim.jobs.trainer_team"], capture_output=True, text=True)
    os.kill(int(follower.stdout.split()[0]), signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 1, stdout + stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer rank 1 ended (killed by SIGKILL)" in errors[0], stderr
    assert "Traceback" not in stderr
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]

    done = cli(*args, "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(x["step"], x["version"]) for x in lines] == [(1, 1), (2, 2), (3, 3)]
    assert all(x["mismatch_mean_abs"] < 1e-4 for x in lines), lines
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr
