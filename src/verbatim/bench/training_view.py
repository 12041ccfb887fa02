"""What a trainer sees, per harness, and how far its logprobs are from the sampler's.

verbatim trains on the trace itself: the exact tokens that were sampled, in the
exact context they were sampled in. A re-rendering harness trains on the chat
template's render of the final conversation; where the template changed
history (stripped reasoning, re-serialised calls), the sampled tokens sit in a
context the sampler never saw. Both are measured the same way: recompute log π
with transformers (fp32, same weights) on the sequence the trainer would use,
and compare with the sampler's μ on the sampled tokens found in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from verbatim.bench.baseline import BaselineRollout
from verbatim.datamodel import Frozen, Rollout, Source


class ViewMismatch(Frozen):
    trained_tokens: int
    """Sampled tokens found, unchanged, in the sequence the trainer uses."""
    sampled_tokens: int
    mean_abs_log_ratio: float


def _logprobs(model: Any, ids: Sequence[int]) -> np.ndarray:
    import torch

    from verbatim.trainer.reference import reference_logprobs

    with torch.no_grad():
        return reference_logprobs(model, ids).cpu().numpy()


def verbatim_view(rollouts: Sequence[Rollout], model: Any,
                  skip: dict[str, list[int]] | None = None) -> ViewMismatch:
    """``skip``: per rollout, how many leading tokens of each turn's completion to leave out (constrained)."""
    diffs, sampled = [], 0
    for rollout in rollouts:
        model_tokens = rollout.tokens.source == Source.MODEL
        for turn, count in zip(rollout.turns, (skip or {}).get(rollout.rollout_id, [])):
            model_tokens[turn.prompt_end:turn.prompt_end + count] = False
        sampled += int(model_tokens.sum())
        if not model_tokens.any():
            continue
        pi = _logprobs(model, rollout.tokens.token_id)
        diffs.append(np.abs(pi[model_tokens] - rollout.tokens.logprob[model_tokens]))
    return _result(diffs, sampled)


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    n = len(needle)
    for start in range(len(haystack) - n + 1):
        if list(haystack[start:start + n]) == list(needle):
            return start
    return -1


def baseline_view(rollouts: Sequence[BaselineRollout], renderer: Any, model: Any,
                  stop_ids: Sequence[int], skip: dict[str, list[int]] | None = None) -> ViewMismatch:
    """Align each request's sampled tokens with the final re-render, longest surviving tail first."""
    diffs, sampled = [], 0
    for rollout in rollouts:
        final = renderer.render(list(rollout.messages), tools=list(rollout.tools) if rollout.tools else None,
                                add_generation_prompt=False)
        ids, owner = list(final.token_ids), np.asarray(final.message_index)
        pi = _logprobs(model, ids)
        assistant = [i for i, m in enumerate(rollout.messages) if m.role == "assistant"]
        skips = (skip or {}).get(rollout.rollout_id, [])
        for k, (request, message_index) in enumerate(zip(rollout.requests, assistant)):
            cut = skips[k] if k < len(skips) else 0
            completion = list(request.completion_ids)[cut:]
            mu = np.asarray(request.logprobs, dtype=np.float32)[cut:]
            while completion and completion[-1] in stop_ids:
                completion, mu = completion[:-1], mu[:-1]
            sampled += len(completion)
            span = np.flatnonzero(owner == message_index)
            if not len(span) or not completion:
                continue
            lo, hi = int(span[0]), int(span[-1]) + 1
            for start in range(len(completion)):
                at = _find(ids[lo:hi], completion[start:])
                if at >= 0:
                    where = lo + at + np.arange(len(completion) - start)
                    diffs.append(np.abs(pi[where] - mu[start:]))
                    break
    return _result(diffs, sampled)


def _result(diffs: list[np.ndarray], sampled: int) -> ViewMismatch:
    flat = np.concatenate(diffs) if diffs else np.empty(0, np.float32)
    return ViewMismatch(trained_tokens=int(flat.size), sampled_tokens=sampled,
                        mean_abs_log_ratio=float(flat.mean()) if flat.size else 0.0)
