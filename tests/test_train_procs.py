"""`verbatim train --trainer-procs 2` on the real engine: the default model sharded over two gloo ranks.

Two steps of the graded env (rewards differ within a group, so every step moves the weights), two
groups (one a rank): versions go 0 → 2, `lint trace` is clean, each synchronous step's π_old equals the
μ its rollouts were sampled with, and the tokens of step 2 have the logprobs of the checkpoint of step
1 (written by rank 0 from the gathered shards, loaded here in one process), not the base weights'.
"""

from __future__ import annotations

import json

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
