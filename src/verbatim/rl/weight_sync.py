"""How a training run's weights reach its engine: shared at the start, begun with, pushed after every step.

Three forms, chosen by the run and its engine:

* **weights**, the learner's whole state dict: in memory to the in-process engine (through the buffer
  :meth:`WeightSync.share` sets up before the first step, engine/weight_push.py), or a folder published under
  ``RUN_DIR/weights/`` that servers reload (``served``);
* **lora**, a LoRA learner's adapter alone: a PEFT folder published under ``RUN_DIR/adapters/`` (the newest
  ``keep_adapters``: the versions a lagged step's requests may still name), which the engine loads as a new
  LoRA of its version (engine/lora_serving.py);
* **merged**, a LoRA learner's weights with the adapter folded in, as whole weights: where the engine serves no
  LoRA (it refuses the run's first adapter with :class:`~verbatim.errors.NoLoraError`).

Each push says which form it took, how many bytes, and the cache policy it amounted to (a step's metrics line).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from verbatim.engine.checkpoints import publish, publish_weights, temporary_folder
from verbatim.engine.protocol import Adapter, CachePolicy, served_policy
from verbatim.errors import NoLoraError

WEIGHTS = "weights"
ADAPTERS = "adapters"
"""A LoRA run's folder of the adapters it pushed, one PEFT folder a version (``v000003``), the newest kept."""


class WeightSync:
    """A run's pushes into ``engine``; ``used``: the engine may hold what another run left (begun with the base)."""

    def __init__(self, engine: Any, out: Path, model_dir: Path, *, served: bool, used: bool,
                 keep_adapters: int) -> None:
        self.engine, self.out, self.model_dir = engine, out, model_dir
        self.served, self.used, self.keep_adapters = served, used, keep_adapters
        self.merged = False
        """A LoRA run on an engine that serves no adapter pushes its weights with the adapter folded in."""
        self.pushed_bytes = 0
        """Bytes of the last push's tensors as the learner holds them (a LoRA adapter's file)."""

    async def share(self, learner: Any) -> float:
        """Where the engine offers it (in-process, engine/weight_push.py), the learner's weights move into the
        buffer the engine loads pushes from, before the first step: a push then copies nothing, and its set-up
        (the buffer, the worker's mapping, the reload's plan) is timed here, not in a step. Returns its seconds."""
        share = getattr(self.engine, "share_weights", None)
        if self.served or share is None or learner.trains_adapter:  # an adapter is pushed as a folder
            return 0.0
        began = time.perf_counter()
        views = await share(learner.engine_weights())
        if views is not None:
            await asyncio.to_thread(learner.keep_weights_in, views)
        return time.perf_counter() - began

    async def begin(self, learner: Any) -> None:
        """The learner's weights into the engine as those the run begins from (:meth:`Engine.begin`: the cache
        emptied, whatever the engine held); a LoRA run's adapter over the base weights, which an engine another
        run used gets back first, or the merged weights where the engine serves no adapter."""
        if learner.trains_adapter and self.used:
            await self.engine.begin(str(self.model_dir), learner.version)
        try:
            await self.engine.begin(await self._source(learner), learner.version)
        except NoLoraError:
            self.merged = True
            await self.engine.begin(await self._source(learner), learner.version)

    async def push(self, learner: Any, policy: CachePolicy) -> dict[str, Any]:
        """The learner's weights into the engine as its version, under the cache policy ``policy``; returns what
        was pushed: ``weight_sync_form`` (``weights``, ``lora`` or ``merged``), ``weight_sync_bytes``, and the
        cache policy it amounts to (``cache_policy_served``: an adapter's keep acts as salt, engine/protocol.py)."""
        source = await self._source(learner)
        await self.engine.update_weights(source, learner.version, policy)
        adapter = isinstance(source, Adapter)
        form = "lora" if adapter else "merged" if self.merged else "weights"
        return {"weight_sync_form": form, "weight_sync_bytes": self.pushed_bytes,
                "cache_policy_served": served_policy(policy, adapter).value}

    async def _source(self, learner: Any) -> Any:
        """The learner's weights as the engine takes them (the module docstring's three forms)."""
        if learner.trains_adapter and not self.merged:
            folder = await asyncio.to_thread(publish, lambda parent: learner.write_adapter(temporary_folder(parent)),
                                             self.out / ADAPTERS, learner.version, self.keep_adapters, "adapter")
            self.pushed_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            return Adapter(folder=str(folder.resolve()), rank=int(learner.config.lora.rank or 0))
        weights = learner.merged_weights() if self.merged else learner.engine_weights()
        self.pushed_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        if not self.served:
            return weights
        folder = await asyncio.to_thread(publish_weights, weights, self.model_dir, self.out / WEIGHTS, learner.version)
        return str(folder.resolve())
