"""A benchmark-only engine wrapper: a regex-constrained think block, then a freely sampled answer.

It makes a small model behave like a reasoning model (every reply opens with a
``<think>`` block) while keeping the answer's logprobs those of the plain model:
under a regex constraint vLLM reports logprobs of the constrained distribution,
so only the answer tokens may be compared with a trainer's π. Each turn is two
engine requests, returned as one completion; ``constrained`` records how many
leading tokens of each completion were constrained, per session, in order, and
``calls`` every engine request in the order sent, so a benchmark counts both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.protocol import Sampling
from verbatim.harness.summary import min_prefill


class EngineCall(NamedTuple):
    """One request as the engine saw it."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    cached_tokens: int


def call_counts(calls: Iterable[EngineCall]) -> dict[str, int]:
    """Requests, prompt, cached, prefill (prompt − cached) and min prefill tokens over engine calls, in order."""
    calls = list(calls)
    prompt = sum(len(c.prompt_ids) for c in calls)
    cached = sum(c.cached_tokens for c in calls)
    return {"requests": len(calls), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens": prompt - cached,
            "min_prefill_tokens": min_prefill((c.prompt_ids, c.completion_ids) for c in calls)}


class ThinkFirst:
    def __init__(self, engine: Any, think_regex: str, stop_ids: tuple[int, ...]) -> None:
        self.engine, self.think_regex, self.stop_ids = engine, think_regex, stop_ids
        self.constrained: dict[str, list[int]] = {}
        self.calls: list[EngineCall] = []

    def __getattr__(self, name: str) -> Any:  # version, block_size, config, reset_prefix_cache, stats…
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: Any, sampling: Sampling | None = None, *, session_id: str | None = None,
                       group_id: str | None = None, cache_salt: str | None = None) -> Completion:
        sampling = sampling or Sampling()
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        think_sampling = sampling.model_copy(update={"regex": self.think_regex, "stop_token_ids": ()})
        think = await self._call(prompt, think_sampling, session_id=session_id, group_id=group_id,
                                 cache_salt=cache_salt)
        n = len(think.token_ids)
        while n and int(think.token_ids[n - 1]) in self.stop_ids:  # the grammar ends the block with EOS
            n -= 1
        answer = await self._call(
            np.concatenate([prompt, think.token_ids[:n]]),
            sampling.model_copy(update={"max_tokens": max(1, sampling.max_tokens - n), "regex": None}),
            session_id=session_id, group_id=group_id, cache_salt=cache_salt)
        self.constrained.setdefault(session_id or "", []).append(n)
        return Completion(
            token_ids=np.concatenate([think.token_ids[:n], answer.token_ids]),
            logprobs=np.concatenate([think.logprobs[:n], answer.logprobs]),
            versions=np.concatenate([think.versions[:n], answer.versions]),
            finish_reason=answer.finish_reason, prompt_tokens=len(prompt), cached_tokens=think.cached_tokens,
            cache_salt=cache_salt, kv_versions=think.kv_versions, queue_s=think.queue_s,
            first_token_s=think.first_token_s, total_s=think.total_s + answer.total_s)

    async def _call(self, prompt: np.ndarray, sampling: Sampling, **route: Any) -> Completion:
        """One engine request, recorded in ``calls`` at the position it was sent."""
        slot = len(self.calls)
        self.calls.append(EngineCall(prompt, np.zeros(0, dtype=np.int64), 0))
        done = await self.engine.generate(prompt, sampling, **route)
        self.calls[slot] = EngineCall(prompt, np.asarray(done.token_ids), int(done.cached_tokens))
        return done
