"""Routing decisions: replica states in, a choice out. Pure functions, no I/O.

A prefix cache lives in one replica, so the next turn of a rollout should land
where its previous context is cached, and the members of a group where their
shared prompt is. Against that stands load balance. The policies:

- ``round_robin``: the next replica in turn (ignores caches; the baseline).
- ``least_loaded``: the replica with the fewest requests in flight.
- ``session_hash``: consistent hashing of the session id on a ring of virtual nodes;
  removing a replica moves only its own sessions.
- ``sticky_least_loaded``: a session is pinned on its first turn to the least-loaded
  replica and stays there unless that replica is overloaded; then it migrates and
  the decision records the cached context it gives up.

``group=True`` adds co-routing: the first turn of every member of a group goes where
the group's first member went, so the shared prompt is prefilled once.

Admission (:func:`admit`) holds *new* rollouts while a replica's KV cache is above a
high-water mark; the next turn of a live rollout is never held. :class:`Residency`
tallies what the live sessions keep cached, a group's shared prompt counted once.

The caller owns a :class:`Pins` table and applies each :class:`Decision` to it; the
discrete-event simulator (``verbatim bench router``) and the real router share
these functions.
"""

from __future__ import annotations

import bisect
import enum
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import Field

from verbatim.datamodel import Frozen
from verbatim.errors import EngineError, InputError


class RoutePolicy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    SESSION_HASH = "session_hash"
    STICKY_LEAST_LOADED = "sticky_least_loaded"


class RouteConfig(Frozen):
    """How requests are spread over replicas, and when new rollouts are held."""

    policy: RoutePolicy = RoutePolicy.STICKY_LEAST_LOADED
    group: bool = True
    """Co-route the first turns of a group's members to one replica."""
    overload_factor: float = Field(default=2.0, ge=1.0)
    """A pinned replica is overloaded when its load exceeds this factor times the least load ..."""
    overload_slack: float = Field(default=16.0, ge=0.0)
    """... plus this many requests. Co-routing puts a group's members in flight together on one replica,
    so the slack must exceed the largest group: with 4, a group of 8 tripped the rule and its members
    migrated (simulated: 85–87% hits instead of 94–96% at 16–64 replicas; docs/benchmarks.md)."""
    high_water: float = Field(default=0.9, gt=0.0, le=1.0)
    """Hold new rollouts on a replica whose KV usage (measured or projected) is at or above this."""
    admission: bool = True
    virtual_nodes: int = Field(default=64, ge=1)

    @classmethod
    def parse(cls, spec: str, **settings: object) -> RouteConfig:
        """``POLICY`` or ``POLICY+group`` (e.g. ``sticky_least_loaded+group``)."""
        parts = [p.strip() for p in spec.split("+") if p.strip()]
        group = "group" in parts
        names = [p for p in parts if p != "group"]
        known = ", ".join(p.value for p in RoutePolicy)
        for name in names:
            if name not in {p.value for p in RoutePolicy}:
                what = "part" if len(parts) > 1 else "policy"
                raise InputError(f"unknown routing {what} {name!r} in --route {spec!r}",
                                 hint=f"use one of: {known}; add +group to co-route groups")
        if len(names) > 1:
            raise InputError(f"--route {spec!r} names more than one policy ({', '.join(names)})",
                             hint="pick one, with +group to co-route groups")
        policy = RoutePolicy(names[0] if names else RoutePolicy.STICKY_LEAST_LOADED.value)
        return cls(policy=policy, group=group, **settings)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        return self.policy.value + ("+group" if self.group else "")


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows about one replica at decision time."""

    name: str
    load: float = 0.0
    """Requests in flight (or queued work in the simulator)."""
    kv_usage: float = 0.0
    """Fraction of the KV cache in use, as the replica reports it."""
    live_tokens: int = 0
    """Context tokens of the live sessions routed here (what they will need again)."""
    capacity_tokens: int = 0
    """KV cache size in tokens (0 when unknown)."""
    healthy: bool = True
    live_groups: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Groups with live sessions here, and the shared-prompt tokens they hold once for all members."""

    @property
    def pressure(self) -> float:
        """The larger of the measured KV usage and the live sessions' projected share of the cache."""
        return self.pressure_with(0)

    def pressure_with(self, new_tokens: int) -> float:
        """Pressure if a new session of ``new_tokens`` context joined the live ones."""
        projected = (self.live_tokens + new_tokens) / self.capacity_tokens if self.capacity_tokens else 0.0
        return max(self.kv_usage, projected)

    def newcomer_tokens(self, request: RouteRequest) -> int:
        """Context a request would add here: its group's shared prompt is already resident if a member is live."""
        resident = self.live_groups.get(request.group_id) if request.group_id is not None else None
        if resident is None:
            return request.context_tokens
        return request.context_tokens - min(request.shared_tokens, resident)


@dataclass(frozen=True)
class RouteRequest:
    session_id: str
    group_id: str | None = None
    new_session: bool = True
    """True on a rollout's first turn."""
    context_tokens: int = 0
    """Prompt tokens of this request (what a migration gives up)."""
    shared_tokens: int = 0
    """Leading tokens of the context shared with the rest of its group (the group prompt), in whole blocks."""


@dataclass
class Residency:
    """The context that one replica's live sessions keep in its KV cache (owned and updated by the caller).

    Members of a group share their prompt's blocks, so a group's shared prefix is counted once:
    ``tokens`` = Σ contexts − Σ over groups (members − 1) × the least prefix its members share.
    Both sums are kept up to date, so reading ``tokens`` costs nothing.
    """

    contexts: dict[str, int] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)
    """Each group's least shared prefix over its live members here (what ``ReplicaState.live_groups`` shows)."""
    _group_of: dict[str, str] = field(default_factory=dict)
    _members: dict[str, dict[str, int]] = field(default_factory=dict)
    _total: int = 0
    _saved: int = 0

    @property
    def tokens(self) -> int:
        return self._total - self._saved

    def __len__(self) -> int:
        return len(self.contexts)

    def set(self, session: str, context: int, group: str | None = None, shared: int = 0) -> None:
        """A session's context here is now ``context`` tokens (it joins if new)."""
        self._total += context - self.contexts.get(session, 0)
        self.contexts[session] = context
        if group is not None and session not in self._group_of:
            self._group_of[session] = group
            self._regroup(group, session, min(shared, context))

    def drop(self, session: str) -> None:
        """The session left this replica (ended or migrated)."""
        self._total -= self.contexts.pop(session, 0)
        group = self._group_of.pop(session, None)
        if group is not None:
            self._regroup(group, session, None)

    def _regroup(self, group: str, session: str, shared: int | None) -> None:
        """Add (``shared`` given) or remove one member, keeping the saved tokens in step."""
        members = self._members.setdefault(group, {})
        if members:
            self._saved -= (len(members) - 1) * self.shared[group]
        if shared is None:
            members.pop(session, None)
        else:
            members[session] = shared
        if not members:
            del self._members[group]
            self.shared.pop(group, None)
            return
        self.shared[group] = min(members.values())
        self._saved += (len(members) - 1) * self.shared[group]


@dataclass
class Pins:
    """Where each live session and each group went (owned and updated by the caller)."""

    sessions: dict[str, str] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)
    turns: int = 0
    """Decisions so far (the round-robin counter)."""

    def apply(self, request: RouteRequest, decision: Decision) -> None:
        self.turns += 1
        self.sessions[request.session_id] = decision.replica
        if request.group_id is not None and decision.pin_group:
            self.groups[request.group_id] = decision.replica

    def end(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def forget(self, replica: str) -> None:
        """A replica is gone: its groups will be placed again (its sessions migrate on their next turn)."""
        self.groups = {g: r for g, r in self.groups.items() if r != replica}


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    """first, sticky, group, hash, round_robin, least_loaded, migrate:<why>."""
    migrated_from: str | None = None
    lost_tokens: int = 0
    """Context tokens cached on the replica the session left (the expected cache loss)."""
    pin_group: bool = False


def route(config: RouteConfig, pins: Pins, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
    """Choose a replica for one request (pure: reads ``pins``, never writes it)."""
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise EngineError("no healthy replica is left to route to")
    by_name = {r.name: r for r in healthy}
    previous = pins.sessions.get(request.session_id)
    if previous is not None and not request.new_session:
        return _next_turn(config, pins, healthy, by_name, request, previous)
    if config.group and request.group_id is not None:
        placed = pins.groups.get(request.group_id)
        if placed in by_name and not _overloaded(config, by_name[placed], healthy):
            return Decision(placed, "group")
        choice = _first_choice(config, pins, healthy, request.group_id)
        return Decision(choice, "first", pin_group=True)
    return Decision(_first_choice(config, pins, healthy, request.session_id), "first")


def _next_turn(config: RouteConfig, pins: Pins, healthy: list[ReplicaState], by_name: dict[str, ReplicaState],
               request: RouteRequest, previous: str) -> Decision:
    policy = config.policy
    if policy is RoutePolicy.ROUND_ROBIN:
        choice = healthy[pins.turns % len(healthy)].name
        return _moved(choice, "round_robin", previous, request)
    if policy is RoutePolicy.LEAST_LOADED:
        return _moved(least_loaded(healthy).name, "least_loaded", previous, request)
    if previous not in by_name:
        choice = _first_choice(config, pins, healthy, request.session_id)
        return _moved(choice, "migrate:replica down", previous, request)
    if policy is RoutePolicy.SESSION_HASH:
        return Decision(previous, "hash")
    if _overloaded(config, by_name[previous], healthy):
        return _moved(least_loaded(healthy).name, "migrate:overload", previous, request)
    return Decision(previous, "sticky")


def _moved(choice: str, reason: str, previous: str, request: RouteRequest) -> Decision:
    if choice == previous:
        return Decision(choice, reason)
    return Decision(choice, reason, migrated_from=previous, lost_tokens=request.context_tokens)


def _first_choice(config: RouteConfig, pins: Pins, healthy: list[ReplicaState], key: str) -> str:
    if config.policy is RoutePolicy.ROUND_ROBIN:
        return healthy[pins.turns % len(healthy)].name
    if config.policy is RoutePolicy.SESSION_HASH:
        return ring_choice([r.name for r in healthy], key, config.virtual_nodes)
    return least_loaded(healthy).name


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """Fewest requests in flight; ties go to the lower KV pressure, then to the earlier replica."""
    return min(replicas, key=lambda r: (r.load, r.pressure))


def _overloaded(config: RouteConfig, replica: ReplicaState, healthy: Sequence[ReplicaState]) -> bool:
    least = min(r.load for r in healthy)
    return replica.load > config.overload_factor * least + config.overload_slack


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=256)
def _ring(names: tuple[str, ...], virtual_nodes: int) -> tuple[list[int], list[str]]:
    ring = sorted((_point(f"{name}#{v}"), name) for name in names for v in range(virtual_nodes))
    return [p for p, _ in ring], [n for _, n in ring]


def ring_choice(names: Sequence[str], key: str, virtual_nodes: int = 64) -> str:
    """Consistent hashing: the first virtual node clockwise of ``key``'s point."""
    points, owners = _ring(tuple(names), virtual_nodes)
    return owners[bisect.bisect(points, _point(key)) % len(points)]


def admit(config: RouteConfig, replica: ReplicaState, request: RouteRequest, *, others_live: bool) -> bool:
    """May this request start now? Only new rollouts are ever held, and only while something else is live.

    A new rollout is held while the replica's pressure, counting the newcomer's own context, would reach
    the high-water mark: live rollouts grow every turn, and their cached history must stay resident. A
    newcomer whose group is live here adds only what it does not share with it.
    """
    if not config.admission or not request.new_session or not others_live:
        return True
    return replica.pressure_with(replica.newcomer_tokens(request)) < config.high_water
