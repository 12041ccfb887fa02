"""What vLLM hands back, as verbatim's types: a :class:`~verbatim.datamodel.Completion` from the in-process engine's
``RequestOutput`` (sampled ids, their logprobs μ, each token's version) or from a server's JSON answer, and the
structured-outputs settings of a request."""

from __future__ import annotations

from typing import Any

import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.protocol import Sampling
from verbatim.errors import EngineError


def structured_outputs(sampling: Sampling) -> Any:
    if sampling.regex is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=sampling.regex)


def token_versions(sample: Any, n: int, fallback: int) -> np.ndarray:
    """Per-token versions from vLLM's weight-version spans over the output tokens."""
    versions = np.full(n, fallback, dtype=np.int32)
    for span in getattr(sample, "weight_versions", None) or ():
        if not str(span.version).isdigit():
            raise EngineError(f"vLLM labelled tokens with an unknown weights version {span.version!r}")
        versions[span.start:span.end] = int(span.version)
    return versions


def completion_of(output: Any, prompt_len: int, cache_salt: str | None, first_token_s: float,
                total_s: float, version: int, adapter: int | None = None) -> Completion:
    """``adapter``: the version of the LoRA adapter the request was sent with, which sampled all of it."""
    if output is None or not output.outputs:
        raise EngineError("vLLM returned no output")
    sample = output.outputs[0]
    ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    metrics = getattr(output, "metrics", None)
    queue_s = 0.0
    if metrics is not None and metrics.scheduled_ts and metrics.queued_ts:
        queue_s = max(0.0, float(metrics.scheduled_ts - metrics.queued_ts))
    return Completion(
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray([entry[token].logprob for token, entry in zip(ids, sample.logprobs)], dtype=np.float32),
        versions=(token_versions(sample, len(ids), version) if adapter is None
                  else np.full(len(ids), adapter, dtype=np.int32)),
        finish_reason=str(sample.finish_reason or "length"),
        prompt_tokens=prompt_len,
        cached_tokens=int(output.num_cached_tokens or 0),
        cache_salt=cache_salt,
        queue_s=queue_s,
        first_token_s=first_token_s,
        total_s=total_s,
    )


def answer_completion(answer: Any, prompt_len: int, version: int, cache_salt: str | None, total_s: float) -> Completion:
    """A served ``/v1/completions`` answer (``return_token_ids``, ``logprobs=0``) as a completion, every token of
    ``version``."""
    try:
        choice = answer["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"]["token_logprobs"]
        usage = answer.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(f"malformed completion from the server (missing {exc}); is it vLLM with "
                          "--enable-prompt-tokens-details?") from exc
    if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
        raise EngineError("the server returned no logprob for some sampled tokens")
    return Completion(
        token_ids=np.asarray(ids, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
        versions=np.full(len(ids), version, dtype=np.int32), finish_reason=str(choice.get("finish_reason")),
        prompt_tokens=prompt_len, cached_tokens=min(cached, prompt_len), cache_salt=cache_salt, total_s=total_s,
    )

