"""``Router``: an ``Engine`` that spreads requests over several replicas.

The decisions are :mod:`.routing`'s pure functions; this module is the thin I/O
around them: it counts requests in flight per replica, remembers each live
session's context size, polls the replicas' KV usage for admission control,
and moves the sessions of a replica that died to the others.

Every completion says which replica served it (``Completion.replica``), how
long admission held it (``admission_wait_s``), and the decision behind it
(``extra["route"]``: reason, the replica a migrated session left and the
cached context it gave up), so a trace shows where the cache was lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verbatim.datamodel import Completion
from verbatim.engine.protocol import CachePolicy, Engine, EngineStats, Sampling, WeightSource
from verbatim.engine.routing import Decision, Pins, ReplicaState, Residency, RouteConfig, RouteRequest, admit, route
from verbatim.errors import EngineError, InputError
from verbatim.prefix_cache import shared_prefix, whole_blocks


@dataclass
class Replica:
    """One engine behind the router and what the router knows of it."""

    name: str
    engine: Any
    in_flight: int = 0
    live: Residency = field(default_factory=Residency)
    """Context tokens of each live session last served here (a group's shared prompt once)."""
    kv_usage: float = 0.0
    capacity_tokens: int = 0
    polled_at: float = 0.0
    healthy: bool = True

    def state(self) -> ReplicaState:
        return ReplicaState(name=self.name, load=float(self.in_flight), kv_usage=self.kv_usage,
                            live_tokens=self.live.tokens, capacity_tokens=self.capacity_tokens,
                            healthy=self.healthy, live_groups=dict(self.live.shared))


class Router:
    """Routes each request to a replica (see :mod:`.routing` for the policies)."""

    def __init__(self, engines: Sequence[Engine], config: RouteConfig | None = None, *,
                 names: Sequence[str] | None = None, poll_s: float = 0.25,
                 admission_timeout_s: float = 600.0) -> None:
        if not engines:
            raise InputError("the router needs at least one replica")
        names = list(names) if names else [f"r{i}" for i in range(len(engines))]
        if len(set(names)) != len(engines):
            raise InputError("replica names must be unique, one per engine")
        self.replicas = [Replica(name, engine) for name, engine in zip(names, engines)]
        self.config = config or RouteConfig()
        self.pins = Pins()
        self.poll_s = poll_s
        self.admission_timeout_s = admission_timeout_s
        self.version = 0
        self.migrations = 0
        self.lost_tokens = 0
        self.admission_wait_s = 0.0
        self._changed = asyncio.Event()
        self._groups: dict[str, tuple[np.ndarray, int]] = {}
        """Each group with live sessions: its first member's prompt and how many members are live."""
        self._shares: dict[str, tuple[str, int]] = {}
        """Each live grouped session: its group and the tokens of its context shared with the group."""

    @property
    def block_size(self) -> int:
        """The smallest of the replicas' block sizes (a replica learns its server's when it starts)."""
        return min(int(r.engine.block_size) for r in self.replicas)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> Router:
        await asyncio.gather(*(self._start(r) for r in self.replicas))
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        return self

    @staticmethod
    async def _start(replica: Replica) -> None:
        start = getattr(replica.engine, "start", None)
        if start is not None:
            await start()

    async def aclose(self) -> None:
        for replica in self.replicas:
            close = getattr(replica.engine, "aclose", None)
            if close is not None:
                await close()
            else:
                replica.engine.close()

    def close(self) -> None:
        for replica in self.replicas:
            replica.engine.close()

    # -- requests ---------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int] | Any, sampling: Sampling | None = None, *,
                       session_id: str | None = None, group_id: str | None = None,
                       cache_salt: str | None = None) -> Completion:
        prompt = np.asarray(prompt_ids).reshape(-1)
        session = session_id or f"anonymous-{id(prompt)}"
        new = session not in self.pins.sessions
        shared = self._join(session, group_id, prompt) if new else self._shares.get(session, (None, 0))[1]
        request = RouteRequest(session_id=session, group_id=group_id, new_session=new,
                               context_tokens=len(prompt), shared_tokens=shared)
        replica, decision, waited = await self._place(request)
        while True:
            try:
                completion = await self._serve(replica, prompt, sampling, session, group_id, cache_salt)
                break
            except EngineError:
                if await self._alive(replica):
                    raise
                self._lost(replica)  # its sessions (this one included) migrate
                decision = route(self.config, self.pins, self._states(), request)
                replica = self._pin(request, decision)
        if session_id is None:
            self.end_session_now(session)
        return self._label(completion, replica, decision, waited)

    async def _place(self, request: RouteRequest) -> tuple[Replica, Decision, float]:
        """Decide, holding a new rollout while admission says its replica is too full."""
        waited = 0.0
        while True:
            decision = route(self.config, self.pins, self._states(), request)
            if request.new_session:
                await self._poll(self._by_name(decision.replica), fresh=True)
                # Decide again on what is known now, with nothing awaited until the pin: a rollout that was
                # placed while this one waited for the poll counts (two first requests at once used to both
                # see every replica idle and land on the same one).
                decision = route(self.config, self.pins, self._states(), request)
            replica = self._by_name(decision.replica)
            others_live = any(s != request.session_id for s in replica.live.contexts)
            admitted = admit(self.config, replica.state(), request, others_live=others_live)
            if admitted or waited >= self.admission_timeout_s:
                break
            held = time.monotonic()
            await self._wait_for_change(self.poll_s)
            waited += time.monotonic() - held
        self.admission_wait_s += waited
        return self._pin(request, decision), decision, waited

    def _pin(self, request: RouteRequest, decision: Decision) -> Replica:
        self.pins.apply(request, decision)
        if decision.migrated_from is not None:
            self.migrations += 1
            self.lost_tokens += decision.lost_tokens
            self._by_name(decision.migrated_from).live.drop(request.session_id)
        replica = self._by_name(decision.replica)
        replica.live.set(request.session_id, request.context_tokens, request.group_id, request.shared_tokens)
        return replica

    def _join(self, session: str, group_id: str | None, prompt: np.ndarray) -> int:
        """A new grouped session: record it, and return the whole blocks it shares with its group's first prompt."""
        if group_id is None:
            return 0
        first, live = self._groups.get(group_id, (prompt, 0))
        if session not in self._shares:
            self._groups[group_id] = (first, live + 1)
        shared = whole_blocks(shared_prefix(first, prompt), self.block_size)
        self._shares[session] = (group_id, shared)
        return shared

    async def _serve(self, replica: Replica, prompt: np.ndarray, sampling: Sampling | None, session: str,
                     group_id: str | None, cache_salt: str | None) -> Completion:
        replica.in_flight += 1
        try:
            completion = await replica.engine.generate(prompt, sampling, session_id=session, group_id=group_id,
                                                       cache_salt=cache_salt)
        finally:
            replica.in_flight -= 1
            self._notify()
        group, shared = self._shares.get(session, (None, 0))
        replica.live.set(session, len(prompt) + len(completion.token_ids), group, shared)
        return completion

    @staticmethod
    def _label(completion: Completion, replica: Replica, decision: Decision, waited: float) -> Completion:
        route_info: dict[str, Any] = {"replica": replica.name, "reason": decision.reason}
        if decision.migrated_from is not None:
            route_info.update(migrated_from=decision.migrated_from, lost_tokens=decision.lost_tokens)
        return dataclasses.replace(completion, replica=replica.name, admission_wait_s=waited,
                                   extra={**completion.extra, "route": route_info})

    async def end_session(self, session_id: str) -> None:
        """A rollout ended: forget its pin and stop counting its context against admission."""
        self.end_session_now(session_id)

    def end_session_now(self, session_id: str) -> None:
        self.pins.end(session_id)
        for replica in self.replicas:
            replica.live.drop(session_id)
        group, _ = self._shares.pop(session_id, (None, 0))
        if group is not None:
            first, live = self._groups[group]
            if live > 1:
                self._groups[group] = (first, live - 1)
            else:
                del self._groups[group]
        self._notify()

    # -- replica health and load ----------------------------------------------------------

    async def _alive(self, replica: Replica) -> bool:
        probe = getattr(replica.engine, "healthy", None)
        if probe is None:
            return True  # no way to tell: the error is the request's, not the replica's
        return bool(await probe())

    def _lost(self, replica: Replica) -> None:
        replica.healthy = False
        self.pins.forget(replica.name)
        if not any(r.healthy for r in self.replicas):
            raise EngineError("every replica has failed", hint="check the servers' logs; restart with --resume")

    async def _poll(self, replica: Replica, *, fresh: bool = False) -> EngineStats | None:
        """Read a replica's KV usage and capacity (``fresh``: skip if read within ``poll_s``)."""
        if not replica.healthy or (fresh and time.monotonic() - replica.polled_at < self.poll_s):
            return None
        try:
            stats = await replica.engine.stats()
        except EngineError:
            return None
        replica.kv_usage, replica.polled_at = stats.kv_cache_usage, time.monotonic()
        replica.capacity_tokens = stats.capacity_tokens or replica.capacity_tokens
        return stats

    async def _wait_for_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._changed.clear()

    def _notify(self) -> None:
        self._changed.set()

    def _states(self) -> list[ReplicaState]:
        return [r.state() for r in self.replicas]

    def _by_name(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise EngineError(f"unknown replica {name!r}")

    # -- weights and stats --------------------------------------------------------------

    async def update_weights(self, source: WeightSource, version: int,
                             policy: CachePolicy | str = CachePolicy.KEEP) -> None:
        """Update every healthy replica (in parallel); the router's version moves when all have."""
        live = [r for r in self.replicas if r.healthy]
        await asyncio.gather(*(r.engine.update_weights(source, version, policy) for r in live))
        self.version = version

    async def begin(self, source: WeightSource, version: int) -> None:
        """Every replica serves ``source`` as ``version`` with an empty prefix cache (the
        :class:`~verbatim.engine.protocol.Engine` protocol); one that cannot fails the call."""
        await asyncio.gather(*(r.engine.begin(source, version) for r in self.replicas))
        self.version = version

    async def stats(self) -> EngineStats:
        per = [await self._poll(r) or EngineStats() for r in self.replicas]
        return EngineStats(
            kv_cache_usage=max((s.kv_cache_usage for s in per), default=0.0),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in per),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in per),
            running=sum(s.running for s in per), waiting=sum(s.waiting for s in per), version=self.version,
            capacity_tokens=sum(s.capacity_tokens for s in per),
            extra={"replicas": {r.name: s.model_dump(exclude={"extra"}) for r, s in zip(self.replicas, per)},
                   "migrations": self.migrations, "lost_tokens": self.lost_tokens,
                   "admission_wait_s": self.admission_wait_s, "route": self.config.label},
        )
