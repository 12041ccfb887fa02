"""What ``verbatim train --resume`` may go on from, decided before the engine starts.

A training run's steps are counted from 1 everywhere: step ``n`` plays rollouts ``sNNNN-…``
(``info["step"] == n``) with version ``n − 1``, writes ``trainer_logprobs/step-{n:06d}.parquet``,
commits ``checkpoints/step-{n:06d}`` (version ``n``), then its line ``"step": n`` in
``metrics.jsonl``. The newest complete checkpoint is what a resume trusts:

* a run with steps recorded past it (metrics lines, or rollouts of a step the loop could not have
  begun) is refused: resuming would train those steps again from older weights and write their
  rollouts into the trace a second time;
* a finished run (its checkpoint is the last planned step) is reported complete, not replayed;
* the settings must be the first run's, except ``--checkpoint-every`` (free to change: it changes no
  step's result) and ``--steps``, which may be raised (the one change that keeps every recorded step
  valid) while the learning rate is constant: a linear or cosine schedule is spread over the planned
  steps, so more steps would change it under the steps trained;
* a run checkpointing every K steps may have trained up to K − 1 steps past its newest checkpoint:
  the resume sets their records aside (:func:`set_aside`) and trains them again; more than that is
  refused, as a lost checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verbatim.datamodel import Rollout, Source
from verbatim.engine.reaper import check_no_leftover_engine
from verbatim.errors import InputError
from verbatim.harness.config_changes import config_differences
from verbatim.harness.metrics_log import METRICS_FILE, metrics_path, read_metrics, rewrite_metrics
from verbatim.harness.store import (
    DISCARDED,
    RunLock,
    batch_files,
    new_folder,
    read_batch,
    read_manifest,
    read_run,
)

CHECKPOINTS = "checkpoints"
EVAL_DIR = "eval"
"""Where a run's evaluations are written, a folder per evaluated step (rl/evaluate.py)."""
_STEPS_KEY = "plan.steps"
_EVERY_KEY = "plan.checkpoint_every"
"""How often a run checkpoints may change on a resume: it changes no step's result."""


def check_resumable(out: Path, resume: bool, config: dict[str, Any], recorded: dict[str, Any] | None = None,
                    upgrade: Callable[[dict[str, Any]], dict[str, Any]] = dict) -> int:
    """Refuse a used --out without --resume, and a resume that could not go on safely; returns the steps
    already trained (0 for a new run). ``config`` is the run's ``train`` config now, compared against
    ``recorded`` (the run folder's ``config.toml``, read back) or else the manifest's, put in today's shape by
    ``upgrade`` (a run recorded before the config had sections)."""
    RunLock.check_free(out)
    check_no_leftover_engine(out)
    if not (out / "manifest.json").exists():
        if resume:
            raise InputError(f"--resume: {out} holds no run to resume",
                             hint="check --out, or drop --resume to start a new run")
        return 0
    if not resume:
        raise InputError(f"{out} already holds a run", hint="pass --resume to go on with it, or another --out")
    previous = read_manifest(out).config
    if "train" not in previous:
        raise InputError(f"{out} holds a 'verbatim run' run, not a training run", hint="pass another --out")
    saved = recorded if recorded is not None else upgrade(previous.get("train", {}))
    check_changes(saved, config.get("train", {}))
    trained = trained_steps(out)
    plan = saved.get("plan", {})
    check_recorded(out, trained, int(plan.get("max_lag", 0)), int(plan.get("checkpoint_every", 1)))
    return trained


def check_changes(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """The settings of the first run, or more --steps under a constant learning rate."""
    changed = [line for line in config_differences(with_added(saved, now), now)
               if not line.startswith(f"{_EVERY_KEY}:")]
    before = saved.get("plan", {}).get("steps")
    after = now.get("plan", {}).get("steps")
    if isinstance(before, int) and isinstance(after, int) and after > before:
        changed = [line for line in changed if not line.startswith(f"{_STEPS_KEY}:")]
        schedule = now.get("learner", {}).get("lr_schedule", "constant")
        if schedule != "constant" and not changed:
            raise InputError(f"--resume --steps {after}: the {schedule} learning-rate schedule is spread over the "
                             f"{before} planned steps, so more steps would change it under the steps trained",
                             hint=f"extend a run trained with --lr-schedule constant, or keep --steps {before}")
    if changed:
        raise InputError(f"--resume with a changed config: {'; '.join(changed)}",
                         hint="resume with the settings of the first run (only --steps may be raised), "
                              "or pass another --out")


ADDED = {"learner.dtype": "fp32", "learner.checkpoint_layers": False, "learner.logprob_chunk": None,
         "learner.prefix_activations": None, "plan.fixed_lag": False, "learner.loss.kl_coef": 0.0,
         "learner.loss.kl_estimator": None, "evaluation.eval_every": None, "evaluation.eval_groups": None,
         "evaluation.eval_samples": None, "evaluation.eval_tasks": None, "evaluation.eval_temperature": None,
         "evaluation.eval_pass_k": None, "evaluation.allow_overlap": None, "plan.hold_out": False,
         "learner.routing_replay": False, "engine.record_routing": False, "learner.lora.dropout": 0.0}
"""Settings added after runs were recorded, and how a run recorded without one trained: its value, or None where
every value trains the same steps (log π in chunks, and the prefix's activations wherever they wait, are exact)."""


ADDED_AS_NONE = ("learner.lora.rank", "learner.lora.alpha", "learner.lora.targets")
"""Settings added after runs were recorded whose value in such a run was None: it trained the whole model, no
LoRA adapter."""


def with_added(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with each :data:`ADDED` (and :data:`ADDED_AS_NONE`) setting it lacks and ``now`` holds filled in
    as that run trained."""
    filled = json.loads(json.dumps(saved))
    for key, value in [*ADDED.items(), *((key, _NONE) for key in ADDED_AS_NONE)]:
        *path, last = key.split(".")
        there: Any = now
        for part in path:
            there = there.get(part) if isinstance(there, dict) else None
        if not isinstance(there, dict) or last not in there:
            continue  # a setting ``now`` does not hold either
        here = filled
        for part in path:
            here = here.setdefault(part, {}) if isinstance(here, dict) else None
        if isinstance(here, dict) and last not in here:
            here[last] = there[last] if value is None else None if value is _NONE else value
    return filled


_NONE = object()  # an ADDED_AS_NONE setting: None as it trained, not "whatever now says"


def trained_steps(out: Path) -> int:
    """The step of the newest complete checkpoint (0 when there is none)."""
    from verbatim.trainer.checkpoint import checkpoint_steps

    return max(checkpoint_steps(out / CHECKPOINTS), default=0)


def check_recorded(out: Path, trained: int, max_lag: int, every: int = 1) -> None:
    """Refuse a run that records steps its newest checkpoint could not have left behind (checkpoints
    every ``every`` steps: up to ``every − 1`` trained steps past it, which a resume sets aside), so that a
    lost checkpoint is named, not silently trained again."""
    lines = read_metrics(out) if metrics_path(out).is_file() else []
    beyond = sorted({r["step"] for r in lines if isinstance(r.get("step"), int) and r["step"] > trained + every - 1})
    where = METRICS_FILE
    if not beyond:  # rollouts of steps up to trained + every + max_lag may be on disk
        steps = {r.info.get("step") for r in read_run(out).rollouts}
        beyond = sorted(s for s in steps if isinstance(s, int) and s > trained + every + max_lag)
        where = "the trace's rollouts"
    if beyond:
        held = f"the newest checkpoint is step {trained}" if trained else "there is no checkpoint"
        raise InputError(f"--resume: {out} records step {beyond[-1]} ({where}) but {held} "
                         f"(under {out / CHECKPOINTS}): resuming would train recorded steps again and write "
                         "their rollouts twice",
                         hint="put the missing checkpoints back, or start a new run with another --out")


def set_aside(out: Path, trained: int, max_lag: int) -> Path | None:
    """Move what steps past the newest checkpoint (``trained``) recorded into ``out/discarded/after-step-N/``
    (nothing is deleted); returns that folder, or None when there was nothing.

    A resume trains those steps again from the checkpoint's weights, so their records describe weights
    that no longer exist: their ``metrics.jsonl`` lines, their trainer logprob files, their evaluations'
    folders (``eval/step-N``), and every batch file
    holding a rollout that the resumed run could not have played (a step past ``trained + 1 + max_lag``,
    or a token sampled by a version past ``trained``). The rollouts it could have played (sampled by the
    checkpoint's version or earlier) stay in the trace, and the loop plays only the missing ones."""
    from verbatim.trainer.logprob_files import STEP_DIR

    moved = []
    for _, path in batch_files(out):
        rollouts, _ = read_batch(path)
        if any(_stale(r, trained, max_lag) for r in rollouts):
            moved.append(path)
    lines = read_metrics(out) if metrics_path(out).is_file() else []
    later = [r for r in lines if isinstance(r.get("step"), int) and r["step"] > trained]
    files = sorted(p for p in (out / STEP_DIR).glob("step-*.parquet") if _step_of(p) > trained)
    evaluations = sorted(p for p in (out / EVAL_DIR).glob("step-*") if _step_of(p) > trained)
    if not (moved or later or files or evaluations):
        return None
    folder = new_folder(out / DISCARDED / f"after-step-{trained:06d}")
    (folder / STEP_DIR).mkdir(parents=True)
    if evaluations:
        (folder / EVAL_DIR).mkdir()
    for path in evaluations:  # of weights trained again
        os.replace(path, folder / EVAL_DIR / path.name)
    if later:
        (folder / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in later))
        rewrite_metrics(out, [r for r in lines if r not in later])
    for path in files:
        os.replace(path, folder / STEP_DIR / path.name)
    for path in moved:
        os.replace(path, folder / path.name)
    return folder


def _stale(rollout: Rollout, trained: int, max_lag: int) -> bool:
    """A rollout the resumed run could not have played: a step too far ahead, or a token of a lost version."""
    step = rollout.info.get("step")
    if isinstance(step, int) and step > trained + 1 + max_lag:
        return True
    sampled = rollout.tokens.policy_version[rollout.tokens.source == Source.MODEL]
    return bool(sampled.size) and int(sampled.max()) > trained


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.removeprefix("step-"))
    except ValueError:
        return -1
