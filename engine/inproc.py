"""The bundled engine: vLLM's async V1 engine in this process, token IDs in and out.

No text crosses this boundary: a request is a token-ID prompt, a response is
the sampled token IDs with the sampler's logprob and the policy version of each.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
from pydantic import Field

from ..datamodel import Completion, Frozen
from ..errors import EngineError, InputError
from .models import resolve
from .runtime import EngineConfig, configure_environment, import_vllm


class Sampling(Frozen):
    """Sampling settings of one request."""

    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


class InprocEngine:
    """vLLM ``AsyncLLM`` with prefix caching, started in this process (engine core in a child)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = resolve(self.config.model)
        self.version = 0
        self._ids = itertools.count()
        self._llm: Any = None
        self.vocab_size = 0

    async def start(self) -> InprocEngine:
        configure_environment(self.config)
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            block_size=self.config.block_size,
            enforce_eager=self.config.enforce_eager,
            enable_prefix_caching=self.config.enable_prefix_caching,
            max_num_seqs=self.config.max_num_seqs,
            seed=self.config.seed,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM raises plain RuntimeErrors on start-up failure
            raise EngineError(f"vLLM failed to start on {self.model_dir}: {exc}") from exc
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        return self

    async def __aenter__(self) -> InprocEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _check_prompt(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        if prompt_ids.size == 0:
            raise InputError("the prompt is empty")
        low, high = int(prompt_ids.min()), int(prompt_ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if prompt_ids.size + sampling.max_tokens > limit:
            raise InputError(
                f"prompt of {prompt_ids.size} tokens + max_tokens {sampling.max_tokens} exceeds the "
                f"model context of {limit} tokens", hint="shorten the prompt or lower max_tokens")

    async def generate(self, prompt_ids: Any, sampling: Sampling | None = None, *,
                       session_id: str | None = None, group_id: str | None = None,
                       cache_salt: str | None = None) -> Completion:
        """Sample one completion for a token-ID prompt."""
        if self._llm is None:
            raise EngineError("the engine is not started (use 'async with InprocEngine(...)')")
        sampling = sampling or Sampling()
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._check_prompt(prompt, sampling)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids), logprobs=0,
            detokenize=False,
        )
        request: dict[str, Any] = {"prompt_token_ids": prompt.tolist()}
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        request_id = f"{session_id or 'req'}-{next(self._ids)}"
        version = self.version
        started = time.perf_counter()
        first_token_s = 0.0
        final = None
        try:
            async for output in self._llm.generate(TokensPrompt(**request), params, request_id=request_id):
                if not first_token_s and output.outputs and output.outputs[0].token_ids:
                    first_token_s = time.perf_counter() - started
                final = output
        except Exception as exc:
            raise EngineError(f"vLLM request {request_id} failed: {exc}") from exc
        return _completion(final, prompt.size, version, cache_salt, first_token_s,
                           time.perf_counter() - started)


def _completion(output: Any, prompt_len: int, version: int, cache_salt: str | None,
                first_token_s: float, total_s: float) -> Completion:
    if output is None or not output.outputs:
        raise EngineError("vLLM returned no output")
    sample = output.outputs[0]
    ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    logprobs = [entry[token].logprob for token, entry in zip(ids, sample.logprobs)]
    return Completion(
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        versions=np.full(len(ids), version, dtype=np.int32),
        finish_reason=str(sample.finish_reason or "length"),
        prompt_tokens=prompt_len,
        cached_tokens=int(output.num_cached_tokens or 0),
        cache_salt=cache_salt,
        first_token_s=first_token_s,
        total_s=total_s,
    )
