"""From one step's rollouts to the learner's rows, and the step's metrics record.

Pure functions over what a step played (the rollouts as written) and what the learner
reported; :mod:`verbatim.rl.train` does the I/O.

* Trained rollouts: status ``ok`` or ``truncated`` (a truncated episode keeps the reward it
  earned). ``error`` and ``interrupted`` rollouts are data, recorded in the trace and counted
  in the metrics, never trained.
* A group trains when at least two of its rollouts are trained; its advantages are
  group-relative (:func:`~verbatim.trainer.advantages.group_advantages`). Only model tokens
  (``source == MODEL``) are in the loss: prompt and observation tokens never are.
* A rollout whose agent rewrote its history trains as one row per segment
  (:meth:`~verbatim.datamodel.Rollout.segments`), each with the rollout's advantage: every row is a
  context the sampler really saw.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import TRAINED_STATUSES, Rollout, TurnSampling
from verbatim.errors import InputError
from verbatim.harness.rollout import CONTEXT_BUDGET
from verbatim.harness.summary import RunSummary, cut_by_max_turns, solved_flags
from verbatim.trainer.advantages import Advantage, group_advantages
from verbatim.trainer.logprob_files import RolloutLogprobs
from verbatim.trainer.step_input import StepInput


def step_input(rollouts: Sequence[Rollout], how: Advantage, *,
               allow_truncated: bool = False) -> tuple[StepInput, dict[str, Any]]:
    """The learner's rows (grouped, in group order) and what was left out, for one step's rollouts, with the
    temperature their μ was sampled at (:func:`step_sampling`)."""
    by_group: dict[str, list[Rollout]] = {}
    for rollout in sorted(rollouts, key=lambda r: r.rollout_id):
        by_group.setdefault(rollout.group_id, []).append(rollout)
    columns, ids, advantages, groups, skipped, trained_ids = [], [], [], [], 0, set()
    for members in by_group.values():
        trained = [r for r in members if r.status in TRAINED_STATUSES and r.reward is not None and len(r.turns)]
        if len(trained) < 2:
            skipped += 1
            continue
        start = len(columns)
        trained_ids.update(r.rollout_id for r in trained)
        for rollout, advantage in zip(trained, group_advantages([float(r.reward) for r in trained], how).tolist()):
            for piece in rollout.segments():  # a rewritten history trains as its sequences, each with its own μ
                columns.append(piece.tokens)
                ids.append(piece.row_id)
                advantages.append(advantage)
        groups.append(list(range(start, len(columns))))
    if not groups:
        raise _nothing_to_train(rollouts)
    values = np.asarray(advantages, dtype=np.float64)
    info = {"groups_trained": len(groups), "groups_skipped": skipped, "rows": len(columns),
            "advantage_std": float(values.std()), "advantage_abs_mean": float(np.abs(values).mean()),
            "zero_advantage_groups": sum(1 for g in groups if not np.any(values[g]))}
    sampling = step_sampling([r for r in rollouts if r.rollout_id in trained_ids], allow_truncated)
    if sampling.truncated:
        info["truncated_sampling"] = _mask_text(sampling)
    truncation = (sampling.top_p, sampling.top_k) if sampling.top_p < 1 or sampling.top_k else None
    return StepInput(columns=columns, advantages=values, groups=groups, rollout_ids=ids,
                     temperature=sampling.logprob_temperature, truncation=truncation), info


def step_sampling(rollouts: Sequence[Rollout], allow_truncated: bool = False) -> TurnSampling:
    """The one sampling setting of a step's trained rollouts (recorded per turn): the distribution their μ
    describes. Settings that differ between turns, or a mask the trainer does not reproduce (top-p < 1,
    top-k, a regex) unless ``allow_truncated``, are refused in one line."""
    found = {r.sampling() for r in rollouts}
    if None in found or len(found) > 1:
        shown = "; ".join(sorted(_settings_text(s) for s in found if s is not None))
        raise InputError(f"the step's rollouts were sampled with different settings ({shown or 'per turn'}): "
                         "one temperature must describe a step's μ", hint="train on rollouts of one run")
    sampling = found.pop()
    refuse_truncated(sampling, allow_truncated, "the step's rollouts were sampled with it")
    return sampling


def refuse_truncated(sampling: TurnSampling, allow: bool, where: str) -> None:
    """One line for a mask (top-p < 1, top-k, a regex) the trainer's π does not reproduce, unless allowed."""
    if sampling.truncated and not allow:
        raise InputError(f"{_mask_text(sampling)}: a mask of the sampling distribution the trainer does not "
                         f"reproduce, so π/μ would be off on every token ({where})",
                         hint="sample without it, or pass --allow-truncated-sampling to train anyway (each step's "
                              "metrics then count the sampled tokens outside π's mask)")


def _mask_text(sampling: TurnSampling) -> str:
    parts = [f"top-p {sampling.top_p:g}" if sampling.top_p < 1 else "", f"top-k {sampling.top_k}" if sampling.top_k
             else "", f"regex {sampling.regex!r}" if sampling.regex is not None else ""]
    return ", ".join(p for p in parts if p)


def _settings_text(sampling: TurnSampling) -> str:
    return f"temperature {sampling.temperature:g} ({sampling.logprobs})" + (
        f", {_mask_text(sampling)}" if sampling.truncated else "")


def step_logprobs(step: int, version: int, rows: StepInput, learned: dict[str, Any], model: str,
                  correction: dict[str, Any]) -> tuple[list[RolloutLogprobs], dict[str, Any]]:
    """The step's trainer logprob file: each trained rollout's π_old and keep mask, and the file's metadata.

    ``version`` is the one π_old was computed with (the learner's before its update)."""
    per_row = learned.get("row_logprobs") or []
    found = [RolloutLogprobs(rid, logprob, keep) for rid, (logprob, keep) in zip(rows.rollout_ids, per_row)]
    return found, {"writer": "train", "step": step, "trainer_version": version, "model": model,
                   "correction": correction}


NO_GROUP = "no group of this step has two rollouts that ended with a reward"


def _nothing_to_train(rollouts: Sequence[Rollout]) -> InputError:
    """Why no group of a step can train, by the cause most rollouts without a reward share: the context budget,
    --max-turns (an agent that asked for more turns, then raised on the refusal), failures, or the env's rewards."""
    unrewarded = [r for r in rollouts if r.reward is None or r.status not in TRAINED_STATUSES]
    out_of_context = [r.error for r in unrewarded if (r.error or "").startswith(CONTEXT_BUDGET)]
    cut = [r.error for r in unrewarded if cut_by_max_turns(r)]
    failed = [r.error for r in unrewarded if r.status not in TRAINED_STATUSES]
    of = f"of {len(rollouts)} rollouts"
    causes = [
        (out_of_context, f"{len(out_of_context)} {of} ran out of context", "raise --max-model-len or lower "
                                                                           "--max-tokens"),
        (cut, f"{len(cut)} {of} were cut at --max-turns before they ended with a reward", "raise --max-turns, or "
         "have the agent return a reward when a request is refused ('verbatim show RUN_DIR' shows its turns)"),
        (failed, f"{len(failed)} {of} failed", "see each failure with 'verbatim lint trace RUN_DIR' or "
                                               "'verbatim show RUN_DIR'"),
    ]
    found, what, hint = max(causes, key=lambda cause: len(cause[0]))
    if found:
        return InputError(f"{NO_GROUP}: {what} ({found[0]})", hint=hint)
    if not unrewarded:
        return InputError(f"{NO_GROUP}: all {len(rollouts)} rollouts did, but no group holds two of them",
                          hint="play groups of at least 2 (--group-size)")
    return InputError(f"{NO_GROUP}: {len(unrewarded)} {of} ended without a reward from the env",
                      hint="check the env's rewards: 'verbatim show RUN_DIR' shows each rollout's")


def success_rate(rollouts: Sequence[Rollout]) -> float | None:
    """The fraction of rollouts whose env said ``solved``, when the env says it; else None."""
    flags = solved_flags(rollouts)
    return sum(flags) / len(flags) if flags else None


def step_record(step: int, version: int, rollouts: Sequence[Rollout], summary: RunSummary | None,
                rows: dict[str, Any], learned: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    """One line of ``metrics.jsonl``: the step's rewards, loss, correction, tokens, lag, time and memory."""
    rewards = [float(r.reward) for r in rollouts if r.reward is not None and r.status in TRAINED_STATUSES]
    statuses: dict[str, int] = {}
    for r in rollouts:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    correction = learned.get("correction") or {}
    every = correction.get("all") or {}
    record: dict[str, Any] = {
        "step": step, "version": version,
        "reward_mean": float(np.mean(rewards)) if rewards else None,
        "success_rate": success_rate(rollouts),
        "rollouts": len(rollouts), "statuses": statuses, **rows,
        "lr": learned.get("lr"), "loss": learned.get("loss"), "grad_norm": learned.get("grad_norm"),
        "updates": learned.get("updates"), "trainer_path": learned.get("trainer_path"),
        "temperature": learned.get("temperature"),
        "kept_tokens": learned.get("kept_tokens"), "model_tokens": learned.get("model_tokens"),
        "entropy": learned.get("entropy"), "trainer_ranks": learned.get("ranks"),
        "padding_tokens": learned.get("padding_tokens"),
        "mismatch_mean_abs": every.get("mean_abs_log_ratio"), "k3": every.get("k3"),
        "ratio_quantiles": every.get("ratio_quantiles"), "dropped": every.get("dropped"),
        "hybrid_tokens": (correction.get("hybrid") or {}).get("tokens", 0),
        "policy_lag": {lag: stats["tokens"] for lag, stats in (correction.get("by_lag") or {}).items()},
    }
    for optional in ("outside_support", "kl_ref", "routing_flip_rate", "mismatch_replayed", "mismatch_unreplayed"):
        if optional in learned:
            record[optional] = learned[optional]
    if summary is not None:
        record |= {"prompt_tokens": summary.prompt_tokens, "cached_tokens": summary.cached_tokens,
                   "prefill_tokens": summary.prefill_tokens, "min_prefill_tokens": summary.min_prefill_tokens,
                   "generated_tokens": summary.generated_tokens, "cache_hit_rate": summary.cache_hit_rate,
                   "history_breaks": summary.history_breaks, "cut_at_max_turns": summary.cut_at_max_turns,
                   "rewards_left_out": summary.rewards_left_out, "first_error": summary.first_error}
        if summary.ignored_request_fields:
            record["ignored_request_fields"] = summary.ignored_request_fields
    record |= {f"{name}_s": round(value, 3) for name, value in times.items()}
    record |= peak_rss_mib()
    return record


def peak_rss_mib() -> dict[str, float | None]:
    """Peak resident memory of this process (the trainer) and of its child processes (the engine's)."""
    trainer = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = [_peak_kib(pid) for pid in _descendants(os.getpid())]
    engine = sum(k for k in children if k is not None) / 1024 if children else None
    return {"trainer_peak_rss_mib": round(trainer, 1), "engine_peak_rss_mib": round(engine, 1) if engine else None}


def _descendants(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(x) for x in task.read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            pending.extend(kids)
    return found


def _peak_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
