"""The ``Engine`` plug point, its request/response types, and the cache policies.

Token IDs in, token IDs out: no text crosses this boundary. The cache salt of
a request is a pure function of (policy, current version, rollout start
version), so a trace can always say which cache namespace a turn read.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from verbatim.datamodel import Completion, Frozen, TurnSampling
from verbatim.errors import InputError


class Sampling(Frozen):
    """Sampling settings of one request."""

    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    """Sample among the k most likely tokens only; 0 turns it off."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    regex: str | None = None
    """Constrain the completion's text to this regular expression (structured outputs; in-process engine)."""

    def record(self, logprobs: str = "processed") -> TurnSampling:
        """What a turn's trace records of these settings: what its logprobs μ describe."""
        return TurnSampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, regex=self.regex,
                            logprobs=logprobs)


LOGPROBS_MODE = "processed_logprobs"
"""The vLLM ``logprobs_mode`` every engine verbatim starts runs with: a sampled token's logprob is that of
the distribution it was drawn from (temperature, top-p and top-k applied), not the raw log-softmax."""


class CachePolicy(str, enum.Enum):
    """What happens to the prefix cache when weights change (see docs/engine.md)."""

    FLUSH = "flush"
    """Reset the prefix cache; running requests recompute their whole context with the new weights."""
    KEEP = "keep"
    """Keep the cache: later tokens attend to KV computed by older weights (recorded in kv_versions)."""
    SALT = "salt"
    """Every request is salted with the current version: versions never share cache entries."""
    KEEP_SALT = "keep+salt"
    """Rollouts keep the salt of the version they started under; new rollouts use the new one."""

    @classmethod
    def parse(cls, value: str | CachePolicy) -> CachePolicy:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise InputError(f"unknown cache policy {value!r}", hint=f"use one of: {names}") from None


def served_policy(policy: CachePolicy, adapter: bool) -> CachePolicy:
    """What ``policy`` amounts to when a push is ``adapter`` (a LoRA adapter, served under a name of its version) or
    whole weights. vLLM keys prefix-cache blocks by adapter, so no request ever reads KV another version's adapter
    computed: keep and keep+salt then act as salt (each version its own blocks); flush still empties the cache."""
    if adapter and policy is not CachePolicy.FLUSH:
        return CachePolicy.SALT
    return policy


def cache_salt(policy: CachePolicy, version: int, rollout_start_version: int) -> str | None:
    """The cache salt of a request: a pure function of policy and versions."""
    if policy is CachePolicy.SALT:
        return f"verbatim-v{version}"
    if policy is CachePolicy.KEEP_SALT:
        return f"verbatim-v{rollout_start_version}"
    return None


class EngineStats(Frozen):
    """A snapshot of the engine's load and cache counters."""

    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    running: int = 0
    waiting: int = 0
    version: int = 0
    capacity_tokens: int = 0
    """KV cache size in tokens (blocks × block size); 0 when the engine does not say."""
    extra: dict[str, Any] = Field(default_factory=dict)


class Adapter(Frozen):
    """A LoRA adapter, a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``): what a LoRA run
    pushes instead of whole weights. The engine serves it as a new LoRA named after its version, and every
    request sent while it is the newest names it."""

    folder: str
    rank: int = Field(ge=1)


WeightSource = str | os.PathLike[str] | dict[str, Any] | Adapter
"""A checkpoint folder, a state dict (name → tensor), or a LoRA adapter over the served base model."""


def adapter_name(version: int, load: int) -> str:
    """The LoRA name an engine serves version ``version``'s adapter under, its ``load``-th load (a version pushed
    again, a resumed run's, is another load: a server refuses a name it has, and vLLM keys cache blocks by it)."""
    return f"verbatim-v{version}.{load}"


@runtime_checkable
class Engine(Protocol):
    """What the harness needs from an inference engine."""

    version: int
    """The policy version of the weights now loaded."""
    block_size: int
    """The KV cache's block size in tokens: prefix-cache hits come in whole blocks of it. A run records it
    in its manifest (``engine.block_size``), and everything that judges cache hits reads it from there."""

    async def generate(self, prompt_ids: Sequence[int] | Any, sampling: Sampling | None = None, *,
                       session_id: str | None = None, group_id: str | None = None,
                       cache_salt: str | None = None) -> Completion: ...

    async def update_weights(self, source: WeightSource, version: int,
                             policy: CachePolicy | str = CachePolicy.KEEP) -> None: ...

    async def begin(self, source: WeightSource, version: int) -> None:
        """A run begins on this engine, which it did not start (a server another run used before, a shared
        engine): ``source`` is served as ``version`` from now on, whatever weights and versions it held, and
        the prefix cache is emptied, so no block computed by other weights is read."""
        ...

    async def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


# -- the first token of a request ---------------------------------------------------------------------

_PREFILLED: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("verbatim_prefilled",
                                                                                      default=None)


@contextlib.contextmanager
def when_prefilled(callback: Callable[[], None]) -> Iterator[None]:
    """Requests sent inside the block call ``callback`` once their prompt is prefilled (their first token),
    where the engine streams; an engine that does not leaves the caller to act on the completion.

    A context variable, not a ``generate`` argument: it passes through every wrapper (gate, router,
    benchmark wrappers) unchanged, and tasks those create inherit it. A group leader's first request
    uses it so that the followers start as soon as the shared prompt is in the prefix cache."""
    token = _PREFILLED.set(callback)
    try:
        yield
    finally:
        _PREFILLED.reset(token)


def prefilled() -> None:
    """Called by an engine at a request's first token: runs the caller's :func:`when_prefilled` callback."""
    callback = _PREFILLED.get()
    if callback is not None:
        callback()
