"""An ``Engine`` that talks to a vLLM OpenAI-compatible server over HTTP.

Token-ID prompts go to ``/v1/completions`` with ``return_token_ids``,
``logprobs=0`` (the sampled token's logprob) and ``cache_salt``; cached prompt
tokens come back in ``usage.prompt_tokens_details.cached_tokens``. Connection
errors and 5xx answers are retried with exponential backoff within a budget;
every wait has a timeout. Weight updates drain running requests first (the
client's :class:`~verbatim.engine.drain.Drain`, then the server's ``/pause?mode=wait``)
and hold back new ones until the new version is set, so no HTTP generation ever spans
an update and every token's version is exact.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.chunked_prefill import RESTART, server_chunking
from verbatim.engine.drain import Drain
from verbatim.engine.expert_capture import has_extension, start_served_capture, take_served_experts, with_experts
from verbatim.engine.kv_provenance import KvProvenance
from verbatim.engine.logprobs_mode import logprobs_mode
from verbatim.engine.lora_serving import ServedAdapters, ServerLoader
from verbatim.engine.metrics import capacity_tokens, parse_prometheus, reported_block_size
from verbatim.engine.outputs import answer_completion
from verbatim.engine.protocol import Adapter, CachePolicy, EngineStats, Sampling, WeightSource
from verbatim.engine.runtime import DEFAULT_BLOCK_SIZE
from verbatim.engine.server_url import redact, redact_text, secret_param, split_url
from verbatim.engine.untied import needs_untying, serving_copy, untied_folder
from verbatim.errors import EngineError, InputError, NoLoraError

HEALTH_EVERY_S = 5.0
HEALTH_FAILURES = 3
"""While a generation waits for its answer, ``/health`` is probed every ``HEALTH_EVERY_S`` (each probe
may take as long); this many failures in a row mean the server is dead or hung, and the request fails
at once instead of after its timeout (minutes: a long generation is slow, a hung server is silent)."""

START_TIMEOUT_S = 30.0
"""How long :meth:`HttpEngine.start` waits for ``/v1/models`` (once: a server that is up answers at once)."""

TEXT_ANSWERS = frozenset({"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""The server's answers that are text, not JSON (Prometheus metrics; the LoRA endpoints' "Success: …")."""

IDLE_WAIT_S = 30.0
"""How long :meth:`HttpEngine.begin` waits for a server's running and waiting requests to end (those of a run
killed just before: vLLM finishes or aborts them) before it takes them for another client's."""


class HttpEngine:
    """A vLLM server as an ``Engine`` (retries, timeouts, weight updates through dev endpoints).

    Each call gets ``retries`` more attempts after a connection failure, a timeout, a 5xx answer or a
    body that is not JSON, with exponential backoff, all within ``budget_s`` of wall time: an attempt
    never outlives the budget, even against a server that trickles its answer. Credentials in the URL
    (``user:password@``, ``?api_key=…``) are sent but never printed: errors name :func:`redact`'s URL.

    ``block_size`` is the server's KV block size: :meth:`start` asks the server (the ``block_size``
    label of its ``vllm:cache_config_info`` metric) and keeps the given value, by default the bundled
    engine's, only when the server does not say.
    """

    def __init__(self, url: str, *, model: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 timeout_s: float = 300.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.5, budget_s: float | None = None, api_key: str | None = None,
                 record_experts: bool = False) -> None:
        base, params, auth = split_url(url)
        self.url = base  # no credentials: they live in the client
        self.label = redact(url)
        self._query = urlsplit(url.strip()).query
        self.model = model
        self.block_size = block_size
        self.record_experts = record_experts
        self.extended = False
        """Whether the server's workers have verbatim's extension (engine/worker_extension.py: a server verbatim
        started), whose reload repacks a CPU MoE's experts (engine/moe_repack.py)."""
        self.expert_shape: dict[str, int] | None = None
        """What the server records of each token's routed experts, once :meth:`start` bound its capture
        (engine/expert_capture.py)."""
        self.logprobs_check = "not started"
        """``processed`` once :meth:`start` found the server reporting processed logprobs, else why it could
        not tell."""
        self.version = 0
        self._kv = KvProvenance(block_size)
        self._drain = Drain()
        self._adapters = ServedAdapters(None, server=True)
        """The LoRA adapters loaded into the server (its runtime endpoints)."""
        self._loader = ServerLoader(self._call, self.label)
        self._ids = itertools.count()
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.health_every_s, self.health_failures = HEALTH_EVERY_S, HEALTH_FAILURES
        self.idle_wait_s = IDLE_WAIT_S
        self.budget_s = budget_s if budget_s is not None else 2 * timeout_s
        self._secrets = [v for v in (api_key, *(auth or ()), *(v for k, v in params if secret_param(k))) if v]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                         headers=headers, params=params or None,
                                         auth=httpx.BasicAuth(*auth) if auth and not api_key else None)

    async def start(self) -> HttpEngine:
        """Check the server and learn its model name and block size: ``GET /v1/models`` and
        ``GET /metrics``, once each, no retries.

        Anything but a JSON list of model ids (no connection, a 4xx/5xx, an HTML page) means the URL
        is not a vLLM server, which is bad input (:class:`InputError`, exit code 2).
        """
        try:
            response = await self._request("GET", "/v1/models", None, None, START_TIMEOUT_S)
        except _Retry as failed:
            raise self._not_vllm(failed.reason) from None
        if response.status_code >= 400:
            raise self._not_vllm(f"answered {response.status_code} {response.reason_phrase}: "
                                 f"{self._detail(response)}")
        try:
            models = response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            raise self._not_vllm(f"answered {response.status_code} with a body that is not JSON "
                                 f"({kind}, {len(response.content)} bytes)") from None
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict) and m.get("id")] \
            if isinstance(models, dict) and isinstance(models.get("data"), list) else []
        if not names:
            raise self._not_vllm(f"answered {response.status_code} with JSON that lists no model ids")
        self.model = self.model or names[0]
        self.block_size = await self._served_block_size() or self.block_size
        risk = await server_chunking(self)
        if risk is not None:
            raise InputError(self._scrub(f"{self.label} {risk}"), hint=RESTART)
        self.logprobs_check = await logprobs_mode(self)
        self.extended = await has_extension(self._call)
        if self.record_experts:
            self.expert_shape = await start_served_capture(self._call, self.label)
        return self

    async def _served_block_size(self) -> int | None:
        """The block size the server reports in its metrics; None when it reports none."""
        try:
            response = await self._request("GET", "/metrics", None, None, START_TIMEOUT_S)
        except _Retry:
            return None
        return reported_block_size(response.text) if response.status_code == 200 else None

    def _not_vllm(self, what: str) -> InputError:
        return InputError(self._scrub(f"{redact(self.url)} is not a vLLM server (GET /v1/models {what})"),
                          hint="check --url")

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
            response = await asyncio.wait_for(self._client.get(self.url + "/health", timeout=timeout_s),
                                              timeout_s + 1)
        except (httpx.TransportError, httpx.TimeoutException, asyncio.TimeoutError):
            return False
        return response.status_code == 200

    # -- transport -------------------------------------------------------------

    async def _call(self, method: str, path: str, *, json: Any = None, params: Any = None) -> Any:
        deadline = time.monotonic() + self.budget_s
        last, attempts = "no attempt fitted in the budget", 0
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:
                    break
                await asyncio.sleep(pause)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                response = await self._request(method, path, json, params, left)
            except _Retry as retry:
                last = retry.reason
                continue
            if response.status_code >= 500:
                last = f"{response.status_code} {response.reason_phrase}: {self._detail(response)}"
                continue
            if response.status_code == 404 and path in TEXT_ANSWERS - {"/metrics"}:  # no runtime LoRA endpoint
                raise NoLoraError(self._scrub(f"{self._where(path)} is not there: the server takes no LoRA adapter"),
                                  hint="start it with verbatim serve --lora-rank R (or fleet up --lora-rank R)")
            if response.status_code >= 400:
                raise InputError(self._scrub(f"{self._where(path)} refused the request ({response.status_code}): "
                                             f"{self._detail(response)}"))
            if not response.content:
                return {}
            try:
                return response.json()
            except ValueError:
                if path in TEXT_ANSWERS:
                    return response.text
                last = f"malformed JSON ({len(response.content)} bytes, not JSON)"
        raise EngineError(self._scrub(f"{self._where(path)} failed after {attempts} attempts "
                                      f"(budget {self.budget_s:g}s): {last}"))

    async def _request(self, method: str, path: str, json: Any, params: Any, left: float) -> httpx.Response:
        """One attempt: the whole answer within ``timeout_s`` (and the budget ``left``); httpx's own
        timeouts bound each read, not the answer, which a server can trickle forever."""
        bound = min(self.timeout_s, left)
        timeout = httpx.Timeout(bound, connect=min(self.connect_timeout_s, bound))
        answer = asyncio.wait_for(
            self._client.request(method, self.url + path, json=json, params=params, timeout=timeout), bound)
        try:
            if path == "/v1/completions":
                return await self._while_alive(answer, path)
            return await answer
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "an answer"
            raise _Retry(f"timed out waiting for {what} ({bound:.3g}s)") from exc
        except httpx.RemoteProtocolError as exc:
            raise _Retry(f"the server broke off the answer ({_short(exc)})") from exc
        except httpx.ConnectError as exc:
            raise _Retry(f"cannot connect ({_short(exc)})") from exc
        except httpx.TransportError as exc:
            raise _Retry(f"connection lost ({type(exc).__name__}: {_short(exc)})") from exc

    async def _while_alive(self, answer: Any, path: str) -> httpx.Response:
        """Await ``answer`` while ``/health`` keeps answering; fail at once (no retry) when it stops."""
        request = asyncio.ensure_future(answer)
        probe = asyncio.ensure_future(self._until_dead())
        try:
            await asyncio.wait({request, probe}, return_when=asyncio.FIRST_COMPLETED)
            if request.done():
                return request.result()
            raise EngineError(self._scrub(f"{self._where(path)}: the server stopped answering (/health failed "
                                          f"{self.health_failures} times in a row, "
                                          f"{self.health_every_s:g}s apart)"),
                              hint="is the server alive? check its log, restart it, then --resume")
        finally:
            # cancelled, not awaited: a probe cancelled inside httpx can wait on its connection pool
            # indefinitely (seen: every answer in, the rollout still waiting here); nothing needs it
            for task in (request, probe):
                task.cancel()
                task.add_done_callback(_consume)

    async def _until_dead(self) -> None:
        """Return once ``/health`` has failed ``health_failures`` times in a row."""
        failures = 0
        while failures < self.health_failures:
            await asyncio.sleep(self.health_every_s)
            failures = 0 if await self._probe(self.health_every_s) else failures + 1

    async def _probe(self, timeout_s: float) -> bool:
        """One ``/health`` probe on a client of its own: a probe never shares (or, cancelled, wedges) the
        connection pool the generations use."""
        client = httpx.AsyncClient(timeout=timeout_s, headers=self._client.headers, params=self._client.params,
                                   auth=self._client.auth)
        try:
            response = await asyncio.wait_for(client.get(self.url + "/health"), timeout_s + 1)
            return response.status_code == 200
        except (httpx.TransportError, httpx.TimeoutException, asyncio.TimeoutError):
            return False
        finally:
            await asyncio.shield(client.aclose())

    def _where(self, path: str) -> str:
        """The redacted URL of a request to ``path``."""
        return redact(self.url + path + (f"?{self._query}" if self._query else ""))

    def _scrub(self, text: str) -> str:
        return redact_text(text, self._secrets)

    def _detail(self, response: httpx.Response) -> str:
        """What the server said, scrubbed before it is shortened (a cut secret would not be found)."""
        text = self._scrub(_message(response))
        return text if len(text) <= 300 else text[:297] + "..."

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
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False, "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        request_id = f"verbatim-{uuid.uuid4().hex}"  # the id its routed experts are taken by
        if self.expert_shape is not None:
            body["request_id"] = request_id
        async with self._drain.request():  # no update starts before this answer is in
            version, epoch = self.version, self._kv.epoch
            held = self._adapters.take()  # a LoRA run's adapter, named as the model; it samples all of it
            if held is not None:
                body["model"], version = held.name, held.version
            started = time.perf_counter()
            try:
                answer = await self._call("POST", "/v1/completions", json=body)
            finally:
                self._adapters.give(held)
        done = answer_completion(answer, len(prompt), version, cache_salt, time.perf_counter() - started)
        if self.expert_shape is not None:
            done = with_experts(done, await take_served_experts(self._call, request_id))
        key = ServedAdapters.kv_key(cache_salt, held)
        return replace(done, kv_versions=self._kv.finish(key, prompt, done.token_ids, done.versions,
                                                         done.cached_tokens, f"http-{next(self._ids)}", epoch))

    # -- weights and cache ----------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int,
                             policy: CachePolicy | str = CachePolicy.KEEP) -> None:
        if version <= self.version:
            raise InputError(f"new version {version} must be greater than the current {self.version}")
        await self._load(source, version, CachePolicy.parse(policy))

    async def begin(self, source: WeightSource, version: int) -> None:
        """``source`` served as ``version`` whatever the server held, its prefix cache emptied (the
        :class:`~verbatim.engine.protocol.Engine` protocol). A server that still has requests running or
        waiting after ``idle_wait_s`` (a killed run's last ones end within it) is serving another client, whose
        weights this would change under it: refused."""
        stats = await self.stats()
        deadline = time.monotonic() + self.idle_wait_s
        while (stats.running or stats.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            stats = await self.stats()
        if stats.running or stats.waiting:
            raise InputError(f"{self.label} is serving {stats.running} running and {stats.waiting} waiting requests "
                             f"of another client (still, after {self.idle_wait_s:g} s); a run loads its own weights "
                             "into its server, so it needs the server to itself",
                             hint="wait for the other run to end, or start a server of its own")
        await self._load(source, version, CachePolicy.FLUSH, lasting=True)

    async def _load(self, source: WeightSource, version: int, policy: CachePolicy, lasting: bool = False) -> None:
        """``lasting``: ``source`` is what a run begins from (its base model, or the checkpoint it resumes), served
        again by the next run: a tied model's untied copy is kept (``serving_copy``, made once per weights), not
        written anew and deleted as an update's is."""
        if isinstance(source, Adapter):
            await self._load_adapter(source, version, policy)
            return
        if isinstance(source, dict):
            raise InputError("an HTTP engine reloads weights from a checkpoint folder the server can read",
                             hint="save the state dict to a folder first")
        folder = Path(source)
        if not needs_untying(folder):
            await self._reload(folder, version, policy)
        elif lasting:
            await self._reload(await asyncio.to_thread(serving_copy, folder), version, policy)
        else:
            untied = await asyncio.to_thread(untied_folder, folder)
            try:
                await self._reload(untied, version, policy)
            finally:
                shutil.rmtree(untied, ignore_errors=True)

    async def _reload(self, folder: Path, version: int, policy: CachePolicy) -> None:
        """Pause, reload from ``folder`` (a tied model's output layer spelled out: engine/untied.py), resume."""
        async with self._drain.update():
            await self._call("POST", "/pause", params={"mode": "wait", "clear_cache": "false"})
            try:
                method = "verbatim_reload_folder" if self.extended else "reload_weights"  # (a MoE's repack)
                await self._call("POST", "/collective_rpc", json={"method": method,
                                                                  "kwargs": {"weights_path": str(folder)}})
                await self._adapters.clear(self._loader)
                await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
                if self.expert_shape is not None:  # the experts computed from now on are this version's
                    await self._call("POST", "/collective_rpc", json={"method": "verbatim_weights_version",
                                                                      "kwargs": {"version": version}})
                if policy is CachePolicy.FLUSH:
                    await self._reset_cache(version)
                else:
                    self._kv.serve(version)
                self.version = version
            finally:
                await self._call("POST", "/resume")

    async def _load_adapter(self, adapter: Adapter, version: int, policy: CachePolicy) -> None:
        """A LoRA adapter loaded into the server (``/v1/load_lora_adapter``, checked listed by ``/v1/models``);
        requests sent from now on name it, those running keep theirs: nothing drains."""
        self._adapters.check(adapter)
        await self._adapters.add(self._loader, adapter, version)
        if policy is CachePolicy.FLUSH:
            await self._reset_cache(version)
        else:
            self._kv.serve(version)
        self.version = version

    async def reset_prefix_cache(self) -> None:
        await self._reset_cache(self.version)

    async def _reset_cache(self, version: int) -> None:
        answer = await self._call("POST", "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError("the server could not reset its prefix cache (blocks still in use)")
        self._kv.flush(version)

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


class _Retry(Exception):
    """Internal: an attempt failed in a way worth another attempt; ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _consume(task: asyncio.Task) -> None:
    """Read a finished background task's outcome, so that asyncio never reports it as lost."""
    if not task.cancelled():
        task.exception()


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:160] + "…") if len(text) > 160 else text or type(exc).__name__


def _message(response: httpx.Response) -> str:
    """The error message of an answer's body (vLLM's ``{"error": {"message": …}}``), or its text."""
    try:
        body = response.json()
    except ValueError:
        return " ".join(response.text.split())
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())
