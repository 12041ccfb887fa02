"""The LoRA adapters an engine serves, one per pushed version, and which requests use which (the in-process engine's
loads through vLLM's ``add_lora``, a server's through its runtime endpoints: a :class:`Loader` each).

A LoRA run pushes its adapter (a PEFT folder, :class:`~verbatim.engine.protocol.Adapter`) at every version;
the engine loads it as a new LoRA named after the version and the load (:func:`~verbatim.engine.protocol.adapter_name`)
and every request sent from then on names it. A request keeps the adapter it was sent with to its last
token, even when a newer one arrives meanwhile: each sampled token's version is the adapter that sampled it.

vLLM keys its prefix-cache blocks by the adapter (``("lora", name, path)`` among a block hash's extra keys,
vLLM 0.32 ``v1/core/kv_cache_utils.py``), so a request never reads KV that another version's adapter
computed, whatever the cache policy (docs/engine.md says what each policy then means). The provenance
records are keyed the same way (:meth:`ServedAdapters.kv_key`).

An adapter no request uses and that is no longer the newest is removed, so the engine's
``max_loras`` slots (:attr:`~verbatim.engine.runtime.EngineConfig.lora_slots`) hold only the versions in use.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from verbatim.engine.protocol import Adapter, adapter_name
from verbatim.engine.runtime import lora_capacity
from verbatim.errors import EngineError, InputError, NoLoraError


@dataclass(frozen=True)
class Held:
    """One load of an adapter: the version it is, the LoRA name and id it is served under, its folder."""

    version: int
    name: str
    lora_id: int
    path: str


class Loader(Protocol):
    """What loads and removes LoRAs: vLLM in this process (``AsyncLLM``'s ``add_lora``/``remove_lora``), or a
    server's runtime endpoints."""

    async def load(self, held: Held) -> None: ...

    async def unload(self, held: Held) -> None: ...


class ServedAdapters:
    """The adapters loaded into one engine started with LoRA up to ``rank``; None: it serves no LoRA."""

    def __init__(self, rank: int | None, server: bool = False) -> None:
        self.rank = rank
        self.server = server
        """A server's adapters: its own start-up settings judge them (its refusal is the one line)."""
        self.newest: Held | None = None
        self.loaded: dict[int, Held] = {}
        """By LoRA id: every load not yet removed."""
        self.in_use: Counter[int] = Counter()
        """By LoRA id: the requests running with it."""
        self._ids = itertools.count(1)
        """The LoRA id of each load, never reused: vLLM keeps an adapter by id, so a version loaded again (a
        resumed run's, perhaps other weights) must not find the old load under its id."""

    def check(self, adapter: Adapter) -> None:
        """Refuse an adapter this engine cannot serve: no LoRA, a rank above its own, or no PEFT folder."""
        if self.rank is None and not self.server:
            raise NoLoraError("the engine was started without LoRA and cannot serve an adapter",
                              hint="start it for the run's --lora-rank")
        if self.rank is not None and adapter.rank > lora_capacity(self.rank):
            raise InputError(f"the adapter's rank {adapter.rank} is above the {lora_capacity(self.rank)} the engine "
                             "was started for", hint=f"start the engine with --lora-rank {adapter.rank}")
        folder = Path(adapter.folder)
        if not (folder / "adapter_config.json").is_file():
            raise InputError(f"{folder} is not a PEFT adapter folder (no adapter_config.json)")

    async def add(self, loader: Loader, adapter: Adapter, version: int) -> None:
        """Load ``adapter`` as version ``version``'s LoRA; requests sent from now on name it."""
        self.check(adapter)
        lora_id = next(self._ids)
        held = Held(version, adapter_name(version, lora_id), lora_id, str(Path(adapter.folder).resolve()))
        await loader.load(held)
        self.newest = self.loaded[held.lora_id] = held
        await self.release(loader)

    async def clear(self, loader: Loader) -> None:
        """Whole weights arrived: requests name no adapter from now on (those running keep theirs)."""
        self.newest = None
        await self.release(loader)

    def take(self) -> Held | None:
        """The adapter a request sent now names (None: the base model), counted as in use until :meth:`give`."""
        held = self.newest
        if held is not None:
            self.in_use[held.lora_id] += 1
        return held

    def give(self, held: Held | None) -> None:
        if held is not None:
            self.in_use -= Counter({held.lora_id: 1})  # (drops the ones that reach zero)

    def unused(self) -> list[int]:
        """The versions of the loads no request uses that are not the newest: what :meth:`release` removes."""
        return sorted(held.version for held in self._unused())

    def _unused(self) -> list[Held]:
        return [held for lora_id, held in self.loaded.items()
                if held is not self.newest and not self.in_use.get(lora_id)]

    async def release(self, loader: Loader) -> None:
        """Remove the loads :meth:`unused` names."""
        for held in self._unused():
            del self.loaded[held.lora_id]
            await loader.unload(held)

    @staticmethod
    def kv_key(salt: str | None, held: Held | None) -> str | None:
        """The key a request's blocks are recorded under: its salt, and its adapter as vLLM keys the blocks."""
        if held is None:
            return salt
        return f"{salt or ''}|{held.name}|{held.path}"


class InprocLoader:
    """:class:`Loader` of vLLM's ``AsyncLLM`` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def load(self, held: Held) -> None:
        if not await self.llm.add_lora(lora_request(held)):
            raise EngineError(f"vLLM did not load the adapter of version {held.version} from {held.path}")

    async def unload(self, held: Held) -> None:
        await self.llm.remove_lora(held.lora_id)


class ServerLoader:
    """:class:`Loader` of a vLLM server started with runtime LoRA updating (``verbatim serve --lora-rank R``), through
    ``call(method, path, json=…)`` (the HTTP engine's retried call): a server without the endpoint answers 404,
    which the call raises as :class:`~verbatim.errors.NoLoraError`."""

    def __init__(self, call: Callable[..., Awaitable[Any]], label: str) -> None:
        self.call = call
        self.label = label

    async def load(self, held: Held) -> None:
        await self.call("POST", "/v1/load_lora_adapter", json={"lora_name": held.name, "lora_path": held.path})
        listed = await self.call("GET", "/v1/models")
        names = {m.get("id") for m in (listed.get("data") or [])} if isinstance(listed, dict) else set()
        if held.name not in names:
            raise EngineError(f"{self.label} loaded the adapter {held.name} but does not list it")

    async def unload(self, held: Held) -> None:
        await self.call("POST", "/v1/unload_lora_adapter", json={"lora_name": held.name})


def lora_request(held: Held | None) -> Any:
    """vLLM's ``LoRARequest`` naming ``held`` (None: the base model)."""
    if held is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=held.name, lora_int_id=held.lora_id, lora_path=held.path)


def check_family(model_dir: Path) -> None:
    """Refuse, in one line, a model whose vLLM class serves no LoRA (vLLM's ``SupportsLoRA``: GPT-2, Mamba and
    Bloom among them in vLLM 0.32), before any engine starts."""
    import json

    from verbatim.engine.runtime import import_vllm

    try:
        architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise InputError(f"{model_dir}/config.json cannot be read: {exc}") from exc
    import_vllm()
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    for architecture in architectures:
        model_cls = ModelRegistry._try_load_model_cls(architecture)
        if model_cls is not None and supports_lora(model_cls):
            return
    raise InputError(f"--lora-rank: vLLM serves no LoRA adapter for {', '.join(architectures) or 'this model'}",
                     hint="train the whole model (drop --lora-rank)")
