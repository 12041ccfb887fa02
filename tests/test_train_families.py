"""`verbatim train --model DIR` on families other than the default model's, on the real engine.

Tiny random folders (`verbatim models tiny`: the family's config class, its real tokenizer and
official chat template) are trained for 2 steps through the CLI, each in its own process with its own
in-process vLLM engine: the renderer is detected from the folder's template, versions go 0 → 2,
`lint trace` is clean, every step trains through the family's PrefixFlow adapter, and the weights the
engine holds after a push are the trainer's: each synchronous step's π_old equals the μ its rollouts
were sampled with (fp32 agreement), and the tokens of step 1 have the logprobs of the checkpoint of
step 1, not the base weights' (so a push that did not arrive fails). The env's rewards differ within a
group (tests/graded_env.py), so every step moves the weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from subprocess_cli import cli

from verbatim.datamodel import Source
from verbatim.harness.store import read_manifest, read_run
from verbatim.harness.tiny_models import write_tiny_model
from verbatim.trainer.checkpoint import load_checkpoint
from verbatim.trainer.reference import load_model, reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

AGREEMENT = 1e-3  # fp32 engine vs transformers, max |Δ logprob| (docs/engine.md)


@pytest.mark.parametrize("family,renderer", [("qwen3", "qwen3"), ("gemma2", "gemma2")])
def test_a_tiny_model_of_another_family_trains_end_to_end(tmp_path, family, renderer):
    model_dir = write_tiny_model(family, tmp_path / family, seed=0)
    out = tmp_path / "run"
    done = cli("train", "--model", str(model_dir), "--env", "graded_env:GradedFactory", "--steps", "2", "--groups",
               "1", "--group-size", "3", "--max-turns", "1", "--max-tokens", "8", "--lr", "1e-2", "--seed", "4",
               "--max-model-len", "512", "--kv-cache-gib", "1", "--checkpoint-every", "1", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_manifest(out).renderer == renderer  # detected from the folder's chat template
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2]
    for record in lines:
        assert record["trainer_path"] == "prefixflow" and record["rows"] == 3
        assert record["mismatch_mean_abs"] < 1e-4, record  # the engine held the trainer's weights of that version
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr

    base = load_model(model_dir).eval()
    trained = load_model(model_dir)
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
