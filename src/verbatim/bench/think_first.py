"""A benchmark-only engine wrapper: a regex-constrained think block, then a freely sampled answer.

It makes a small model behave like a reasoning model (every reply opens with a
``<think>`` block) while keeping the answer's logprobs those of the plain model:
under a regex constraint vLLM reports logprobs of the constrained distribution,
so only the answer tokens may be compared with a trainer's π. Each turn is two
engine requests, returned as one completion; ``constrained`` records how many
leading tokens of each completion were constrained, per session, in order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.protocol import Sampling


class ThinkFirst:
    def __init__(self, engine: Any, think_regex: str, stop_ids: tuple[int, ...]) -> None:
        self.engine, self.think_regex, self.stop_ids = engine, think_regex, stop_ids
        self.constrained: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:  # version, block_size, config, reset_prefix_cache, stats…
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: Any, sampling: Sampling | None = None, *, session_id: str | None = None,
                       group_id: str | None = None, cache_salt: str | None = None) -> Completion:
        sampling = sampling or Sampling()
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        think_sampling = sampling.model_copy(update={"regex": self.think_regex, "stop_token_ids": ()})
        think = await self.engine.generate(prompt, think_sampling, session_id=session_id, group_id=group_id,
                                           cache_salt=cache_salt)
        n = len(think.token_ids)
        while n and int(think.token_ids[n - 1]) in self.stop_ids:  # the grammar ends the block with EOS
            n -= 1
        answer = await self.engine.generate(
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
