"""Which weights hold a run's policy version: what ``verbatim mismatch`` computes π with.

Version 0 is the run's base model (the manifest's ``model``). A training run's version ``n`` is
the policy after step ``n``: ``RUN_DIR/checkpoints/step-{n:06d}``, a Hugging Face model folder
(weights, config, tokenizer), or a LoRA run's PEFT folder (its base model with the adapter), kept for the newest
``--keep-checkpoints`` steps. A version the run
never had, or one whose checkpoint was not kept, is one line naming what is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verbatim.datamodel import Rollout, Source
from verbatim.engine.models import resolve
from verbatim.errors import InputError
from verbatim.harness.store import read_manifest
from verbatim.rl.train_resume import CHECKPOINTS, trained_steps


@dataclass(frozen=True)
class PolicyWeights:
    """The weights of one version, and what to call them in a report."""

    version: int
    folder: Path
    source: str
    """``"checkpoint step-000002"``, ``"the base model"`` or ``"--model NAME"``."""


def sampled_version(rollouts: list[Rollout]) -> int:
    """The newest policy version that sampled a token of these rollouts (0 for none)."""
    found = [int(r.tokens.policy_version[r.tokens.source == Source.MODEL].max()) for r in rollouts
             if (r.tokens.source == Source.MODEL).any()]
    return max(found, default=0)


def policy_weights(run_dir: str | Path, rollouts: list[Rollout], version: int | None,
                   model: str | None) -> PolicyWeights:
    """The weights to compute π with for ``version`` (default: the newest that sampled a token)."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    sampled = sampled_version(rollouts)
    chosen = sampled if version is None else version
    training = "train" in manifest.config
    newest = trained_steps(run_dir) if training else None
    if chosen < 0 or (newest is not None and chosen > max(newest, sampled)):
        known = f"versions 0 to {newest}" if newest is not None else "versions from 0"
        raise InputError(f"--trainer-version {chosen}: {run_dir} has {known}",
                         hint="pass a version the run trained, or leave it out for the newest that sampled")
    if model is not None:
        return PolicyWeights(chosen, resolve(model), f"--model {model}")
    if chosen == 0 or not training:
        recorded = manifest.model
        return PolicyWeights(chosen, resolve(recorded if recorded and Path(recorded).is_dir() else "default"),
                             "the base model")
    return PolicyWeights(chosen, _checkpoint(run_dir, chosen), f"checkpoint step-{chosen:06d}")


def _checkpoint(run_dir: Path, version: int) -> Path:
    from verbatim.trainer.checkpoint import checkpoint_steps, step_dir_name

    steps = checkpoint_steps(run_dir / CHECKPOINTS)
    if version not in steps:
        kept = ", ".join(str(s) for s in steps) or "none"
        raise InputError(f"the weights of version {version} are not kept in {run_dir / CHECKPOINTS} (steps kept: "
                         f"{kept}; --keep-checkpoints decides how many)",
                         hint="pass --trainer-version of a kept step, or --model with the weights to use")
    from verbatim.trainer.lora import is_adapter_folder

    folder = run_dir / CHECKPOINTS / step_dir_name(version)
    if not (folder / "config.json").is_file() and not is_adapter_folder(folder):  # (a LoRA run's: its adapter)
        raise InputError(f"{folder} holds no config.json (written by an older verbatim): it is not a model folder",
                         hint="pass --model with the run's base model folder and --trainer-version 0")
    return folder
