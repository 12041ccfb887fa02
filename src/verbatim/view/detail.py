"""What the page shows of one rollout and of one group, as JSON-ready dicts (pure: no I/O).

A rollout's tokens go out as columns (text, id, source, logprob, version, turn, and the
flags the colourings need); its turns carry each request's cached and prefilled tokens;
``lint trace``'s problems are pinned to a token position. A group is aligned on the
prefix all its members share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout, Source
from verbatim.lint.findings import Problem

DEFAULT_HYBRID_WINDOW = 32
CACHE_MISS = "cache_shortfall"
HISTORY_BREAK = "history_break"


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def rollout_row(rollout: Rollout, problems: Sequence[Problem]) -> dict[str, Any]:
    """One line of the rollout list."""
    return {
        "id": rollout.rollout_id, "group": rollout.group_id, "status": rollout.status,
        "reward": rollout.reward, "turns": len(rollout.turns), "tokens": len(rollout.tokens),
        "misses": sum(p.kind == CACHE_MISS for p in problems), "problems": len(problems),
        "error": rollout.error,
    }


def hybrid_mask(versions: np.ndarray, model: np.ndarray, window: int) -> np.ndarray:
    """Model tokens sampled within ``window`` model tokens after the version changed inside the sequence."""
    hybrid = np.zeros(len(versions), dtype=bool)
    positions = np.flatnonzero(model)
    last_change = None
    for ordinal, position in enumerate(positions):
        if ordinal and versions[position] != versions[positions[ordinal - 1]]:
            last_change = ordinal
        if last_change is not None and ordinal - last_change < window:
            hybrid[position] = True
    return hybrid


def trainer_columns(rollout: Rollout, trainer: dict[str, Any] | None) -> dict[str, Any] | None:
    """log π − log μ, the correction's keep mask per model token and where counted each token's routing flips (MoE
    layers whose router chose otherwise than the engine), from the trainer's logprob file
    (:meth:`verbatim.view.sidecar.TrainerLogprobs.find`); None without one."""
    if trainer is None:
        return None
    model = rollout.tokens.source == Source.MODEL
    mu = rollout.tokens.logprob.astype(np.float64)
    pi = np.asarray(trainer["logprob"], dtype=np.float64)
    known = model & np.isfinite(pi) & np.isfinite(mu)
    ratio = np.where(known, pi - mu, np.nan)
    keep = np.asarray(trainer["keep"], dtype=bool)
    meta = trainer.get("meta") or {}
    return {"log_ratio": [_finite(v) if k else None for v, k in zip(ratio.tolist(), known.tolist())],
            "keep": [bool(v) if k else None for v, k in zip(keep.tolist(), known.tolist())],
            "flips": None if trainer.get("flips") is None else [int(v) for v in trainer["flips"]],
            "source": trainer.get("source"), "writer": meta.get("writer"), "model": meta.get("model"),
            "trainer_version": meta.get("trainer_version"), "step": meta.get("step")}


def pin(problem: Problem, rollout: Rollout) -> int | None:
    """The token a problem concerns: where a missed turn's prefill began, or where its completion starts."""
    if problem.turn is None:
        return None
    turn = next((t for t in rollout.turns if t.index == problem.turn), None)
    if turn is None:
        return None
    position = (turn.prompt_start + turn.cached_tokens if problem.kind == CACHE_MISS
                else turn.prompt_start if problem.kind == HISTORY_BREAK else turn.prompt_end)
    return min(position, max(len(rollout.tokens) - 1, 0))


def rollout_detail(rollout: Rollout, problems: Sequence[Problem], texts: list[str], specials: list[bool], *,
                   block_size: int | None, hybrid_window: int = DEFAULT_HYBRID_WINDOW,
                   trainer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the token view of one rollout needs."""
    tokens = rollout.tokens
    model = tokens.source == Source.MODEL
    missed = {p.turn for p in problems if p.kind == CACHE_MISS}
    return {
        "row": rollout_row(rollout, problems),
        "task": rollout.task, "block_size": block_size,
        "columns": {
            "text": texts, "special": specials, "id": tokens.token_id.tolist(),
            "source": tokens.source.tolist(), "turn": tokens.turn.tolist(),
            "logprob": [_finite(v) for v in tokens.logprob.tolist()],
            "version": tokens.policy_version.tolist(),
            "hybrid": hybrid_mask(tokens.policy_version, model, hybrid_window).tolist(),
            "prefills": prefill_counts(rollout).tolist(),
        },
        "trainer": trainer_columns(rollout, trainer),
        "turns": [{"index": t.index, "prompt_start": t.prompt_start, "prompt_end": t.prompt_end,
                   "completion_end": t.completion_end, "segment": segment_of(rollout, t.index),
                   "opens_segment": t.prompt_start > 0 and rollout.turns[t.index - 1].prompt_start != t.prompt_start,
                   "cached": t.cached_tokens, "prefilled": t.prompt_tokens - t.cached_tokens,
                   "finish_reason": t.finish_reason, "replica": t.replica, "reward": t.reward,
                   "miss": t.index in missed} for t in rollout.turns],
        "problems": [{**p.as_json(), "position": pin(p, rollout)} for p in problems],
    }


def prefill_counts(rollout: Rollout) -> np.ndarray:
    """How many requests computed each token (prefill or sampling): 1 is ideal, more is a cache miss."""
    counts = np.zeros(len(rollout.tokens), dtype=np.int32)
    for turn in rollout.turns:
        counts[turn.prompt_start + turn.cached_tokens:turn.completion_end] += 1
    return counts


def segment_of(rollout: Rollout, index: int) -> int:
    """The segment turn ``index`` belongs to: 0, or k ≥ 1 after the agent's k-th history break."""
    starts = sorted({t.prompt_start for t in rollout.turns} | {0})
    return starts.index(rollout.turns[index].prompt_start)


def shared_prefix(sequences: Sequence[np.ndarray]) -> int:
    """Length of the prefix every sequence shares."""
    if not sequences:
        return 0
    length = min(len(s) for s in sequences)
    first = sequences[0][:length]
    for other in sequences[1:]:
        differ = np.flatnonzero(first != other[:length])
        if differ.size:
            length = int(differ[0])
            first = first[:length]
    return length


def group_detail(group_id: str, members: Sequence[Rollout], texts: list[tuple[list[str], list[bool]]],
                 rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A group's members side by side from their shared prefix on, and how their first requests shared cache."""
    shared = shared_prefix([m.tokens.token_id for m in members])
    out = []
    for member, (text, special), row in zip(members, texts, rows):
        first = member.turns[0] if member.turns else None
        out.append({
            "row": row, "text": text[shared:], "special": special[shared:],
            "source": member.tokens.source[shared:].tolist(),
            "first_prompt": first.prompt_end if first else 0, "first_cached": first.cached_tokens if first else 0,
        })
    prefix_text, prefix_special = (texts[0][0][:shared], texts[0][1][:shared]) if texts else ([], [])
    return {"group": group_id, "shared": shared, "prefix_text": prefix_text, "prefix_special": prefix_special,
            "members": out}
