"""An ``Engine`` that talks to a vLLM OpenAI-compatible server over HTTP.

Token-ID prompts go to ``/v1/completions`` with ``return_token_ids``,
``logprobs=0`` (the sampled token's logprob) and ``cache_salt``; cached prompt
tokens come back in ``usage.prompt_tokens_details.cached_tokens``. Connection
errors and 5xx answers are retried with exponential backoff within a budget;
every wait has a timeout. Weight updates drain running requests first (the
server's ``/pause?mode=wait``), so no HTTP generation ever spans an update and
every token's version is exact.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from ..datamodel import Completion
from ..errors import EngineError, InputError
from .protocol import CachePolicy, EngineStats, Sampling, WeightSource


def redact(url: str) -> str:
    """A URL without user:password."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        parts = parts._replace(netloc=f"***@{parts.hostname}{':' + str(parts.port) if parts.port else ''}")
    return urlunsplit(parts)


class HttpEngine:
    """A vLLM server as an ``Engine`` (retries, timeouts, weight updates through dev endpoints)."""

    def __init__(self, url: str, *, model: str | None = None, block_size: int = 32,
                 timeout_s: float = 300.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.5, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.block_size = block_size
        self.version = 0
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), headers=headers)

    async def start(self) -> HttpEngine:
        """Check the server and learn its model name."""
        models = await self._call("GET", "/v1/models")
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
        if not names:
            raise EngineError(f"{redact(self.url)} does not look like a vLLM server (no models listed)")
        self.model = self.model or names[0]
        return self

    async def __aenter__(self) -> HttpEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    def close(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.aclose())
        else:
            loop.create_task(self.aclose())

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """One quick ``/health`` probe, no retries (the router asks this after a failure)."""
        try:
            response = await self._client.get(self.url + "/health", timeout=timeout_s)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return response.status_code == 200

    # -- transport -------------------------------------------------------------

    async def _call(self, method: str, path: str, *, json: Any = None, params: Any = None) -> Any:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = await self._client.request(method, self.url + path, json=json, params=params)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = exc
                continue
            if response.status_code >= 500:
                last = EngineError(f"{response.status_code} from {path}: {_detail(response)}")
                continue
            if response.status_code >= 400:
                raise InputError(f"{redact(self.url)}{path} refused the request ({response.status_code}): "
                                 f"{_detail(response)}")
            if not response.content:
                return {}
            try:
                return response.json()
            except ValueError:
                if path == "/metrics":
                    return response.text
                last = EngineError(f"malformed JSON from {path}")
                continue
        raise EngineError(f"{redact(self.url)}{path} failed after {self.retries + 1} attempts: {last}")

    # -- requests -----------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int] | Any, sampling: Sampling | None = None, *,
                       session_id: str | None = None, group_id: str | None = None,
                       cache_salt: str | None = None) -> Completion:
        sampling = sampling or Sampling()
        if sampling.regex is not None:
            raise InputError("regex-constrained sampling is supported by the in-process engine only")
        prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
        if not prompt:
            raise InputError("the prompt is empty")
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False, "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        version = self.version
        started = time.perf_counter()
        answer = await self._call("POST", "/v1/completions", json=body)
        return _completion(answer, len(prompt), version, cache_salt, time.perf_counter() - started)

    # -- weights and cache ----------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int,
                             policy: CachePolicy | str = CachePolicy.KEEP) -> None:
        policy = CachePolicy.parse(policy)
        if isinstance(source, dict):
            raise InputError("an HTTP engine reloads weights from a checkpoint folder the server can read",
                             hint="save the state dict to a folder first")
        if version <= self.version:
            raise InputError(f"new version {version} must be greater than the current {self.version}")
        await self._call("POST", "/pause", params={"mode": "wait", "clear_cache": "false"})
        try:
            await self._call("POST", "/collective_rpc",
                             json={"method": "reload_weights", "kwargs": {"weights_path": str(source)}})
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
            if policy is CachePolicy.FLUSH:
                await self.reset_prefix_cache()
            self.version = version
        finally:
            await self._call("POST", "/resume")

    async def reset_prefix_cache(self) -> None:
        answer = await self._call("POST", "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError("the server could not reset its prefix cache (blocks still in use)")

    async def stats(self) -> EngineStats:
        text = await self._call("GET", "/metrics")
        metrics = parse_prometheus(text if isinstance(text, str) else "")
        return EngineStats(
            kv_cache_usage=metrics.get("vllm:kv_cache_usage_perc", 0.0),
            prefix_cache_queries=int(metrics.get("vllm:prefix_cache_queries_total", 0)),
            prefix_cache_hits=int(metrics.get("vllm:prefix_cache_hits_total", 0)),
            running=int(metrics.get("vllm:num_requests_running", 0)),
            waiting=int(metrics.get("vllm:num_requests_waiting", 0)),
            version=self.version,
            capacity_tokens=capacity_tokens(text if isinstance(text, str) else ""),
        )


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric's samples over their labels (one replica's totals)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def capacity_tokens(text: str) -> int:
    """KV cache size in tokens from ``vllm:cache_config_info`` (its num_gpu_blocks and block_size labels)."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            blocks, block = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            if blocks.isdigit() and block.isdigit():
                return int(blocks) * int(block)
    return 0


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return " ".join(response.text.split())[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:300]


def _completion(answer: Any, prompt_len: int, version: int, cache_salt: str | None, total_s: float) -> Completion:
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
