"""Checks of a finished two-step ``verbatim train`` run, shared by the engine tests that train end to end.

After two synchronous steps with ``--checkpoint-every 1``: versions 1 and 2 in ``metrics.jsonl``, each step's
π_old equal to the μ its rollouts were sampled with (the engine held the trainer's weights of that version),
``lint trace`` clean, and the tokens of step 2 carrying the logprobs of step 1's checkpoint (loaded here in
one process), not the base model's: the push moved the engine (any step against the one before it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from subprocess_cli import cli

from verbatim.datamodel import Source
from verbatim.harness.store import read_run
from verbatim.trainer.checkpoint import load_checkpoint
from verbatim.trainer.reference import load_model, reference_logprobs

AGREEMENT = 1e-3  # fp32 engine vs transformers, max |Δ logprob| (docs/engine.md)


def assert_two_steps(out: Path, **expected: Any) -> list[dict[str, Any]]:
    """Versions 1 and 2, every record with ``expected``'s values and the engine's μ equal to π_old; lint clean."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2]
    for record in lines:
        assert {key: record[key] for key in expected} == expected, record
        assert record["grad_norm"] > 0 and record["mismatch_mean_abs"] < 1e-4, record
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    return lines


def assert_sampled_with_previous_checkpoint(out: Path, model_dir: Path, step: int = 2) -> None:
    """Step ``step``'s model tokens: version ``step - 1``, the logprobs of that step's checkpoint, far from the
    base model's."""
    base = load_model(model_dir).eval()
    trained = checkpoint_model(out / "checkpoints" / f"step-{step - 1:06d}", model_dir, step - 1)
    moved = 0.0
    for rollout in (r for r in read_run(out).rollouts if r.info["step"] == step):
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        assert set(tokens.policy_version[at].tolist()) == {step - 1}
        with torch.no_grad():
            want = reference_logprobs(trained, tokens.token_id, at).numpy()
            before = reference_logprobs(base, tokens.token_id, at).numpy()
        assert np.abs(want - tokens.logprob[at]).max() < AGREEMENT, rollout.rollout_id
        moved = max(moved, float(np.abs(before - tokens.logprob[at]).max()))
    assert moved > 10 * AGREEMENT, "training did not move the weights: the push proves nothing"


def checkpoint_model(folder: Path, model_dir: Path, version: int) -> torch.nn.Module:
    """The model a checkpoint holds, in eval mode: its weights, or the base of ``model_dir`` with its LoRA adapter."""
    from verbatim.trainer import lora

    model = load_model(model_dir)
    if lora.is_adapter_folder(folder):
        lora.attach(model, lora.settings_of(folder))
    assert load_checkpoint(folder, model, None)["version"] == version
    return model.eval()


def assert_sampled_with_base_not(first: Path, runs: list[Path], model_dir: Path) -> None:
    """The model tokens of ``runs`` (rollout runs, or one-step training runs) have the base model's logprobs, far
    from those of ``first``'s step-1 checkpoint: an engine ``first`` trained was begun with the base weights."""
    base = load_model(model_dir).eval()
    trained = load_model(model_dir)
    load_checkpoint(first / "checkpoints" / "step-000001", trained, None)
    trained.eval()
    off_base, off_first = 0.0, 0.0
    for rollout in (r for out in runs for r in read_run(out).rollouts):
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        with torch.no_grad():
            want = reference_logprobs(base, tokens.token_id, at).numpy()
            other = reference_logprobs(trained, tokens.token_id, at).numpy()
        off_base = max(off_base, float(np.abs(want - tokens.logprob[at]).max()))
        off_first = max(off_first, float(np.abs(other - tokens.logprob[at]).max()))
    assert off_base < AGREEMENT, off_base  # fp32 engine vs transformers (docs/engine.md)
    assert off_first > 10 * AGREEMENT, off_first  # the first run's weights would have been told apart
