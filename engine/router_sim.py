"""Discrete-event simulator of a replica fleet behind the router (``verbatim bench router``).

Routing and admission are :mod:`verbatim.engine.routing`'s own ``route`` and ``admit``,
fed with :class:`ReplicaState` built from the simulated replicas: ``load`` = requests
waiting or running there, ``kv_usage`` = blocks held by running requests,
``live_tokens`` = context of the live sessions last served there, a group's shared
prompt counted once (:class:`Residency`, as in the router). Pure Python and
NumPy: no engine, no I/O; the same seed gives the same result.

Each replica (:class:`_Replica`) has a finite :class:`BlockCache` and serves requests
with continuous batching, approximated as follows:

- requests wait FIFO; the head is scheduled when fewer than ``max_batch`` requests are
  running and the cache can hold its prompt and completion (else it waits: no preemption);
- every request scheduled at one moment is prefilled in one step of
  ``prefill_base_s + prefill_token_s · (prompt − cached tokens)`` summed over the step,
  during which the replica decodes nothing (vLLM mixes chunks with decodes);
- the prefill step yields each request's first token; then every running request gets
  one more token per ``decode_token_s`` (a decode step whose cost does not grow with the batch);
- when a request finishes, the full blocks of its completion are registered and all its
  blocks become evictable.

*Busy time* counts a prefill step in full and a decode interval by the share of the
batch it fills (running / ``max_batch``): the time the replica would need at full
batch for the same work, so that a replica given more work shows more busy time.

A session plays its turns in order: request → completion → ``think_s`` (exponential,
the env's time) → next request, whose prompt is the whole history. With
``leader_first`` (what ``verbatim run`` does) a group's other members start when the
first member's first turn is answered. A first turn that ``admit`` refuses is held and,
as in the real router, routed and tried again whenever a request finishes, and let in
after ``admission_timeout_s``; later turns are never held. A retry pass goes through the
held sessions in arrival order from where the last pass stopped and ends after 16 refusals
in a row, or at once while every replica is at its high-water mark (the bound that keeps
it fast; the router itself retries every waiter).

Metrics: hit rate = cached / prompt tokens; queueing = time from reaching a replica to
being scheduled; admission wait = time held; migrations and tokens lost are the
decisions' own ``migrated_from`` and ``lost_tokens``; throughput = generated tokens (and
requests) over the time from the first arrival to the last completion.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from ..datamodel import Frozen
from ..errors import InputError
from .block_cache import Allocation, BlockCache
from .routing import Pins, ReplicaState, Residency, RouteConfig, RouteRequest, admit, route
from .sim_workload import SimSession, Workload

_EPS = 1e-6
_RETRY_BUDGET = 16
"""Refusals in a row that end one retry pass over the held sessions (the next pass starts after them)."""


class CostModel(Frozen):
    """Replica timing: prefill step = base + per-token × prefilled tokens; decode step = one token per request."""

    prefill_base_s: float = Field(ge=0.0)
    prefill_token_s: float = Field(ge=0.0)
    decode_token_s: float = Field(gt=0.0)
    source: str = ""


class SimConfig(Frozen):
    route: RouteConfig = RouteConfig()
    replicas: int = Field(ge=1)
    kv_blocks: int = Field(ge=1)
    """Cache blocks per replica."""
    block_size: int = Field(default=16, ge=1)
    max_batch: int = Field(default=64, ge=1)
    costs: CostModel
    think_s: float = Field(default=0.0, ge=0.0)
    """Mean env time between a completion and the next request (exponential; 0: none)."""
    leader_first: bool = True
    admission_timeout_s: float = Field(default=600.0, gt=0.0)
    """A held new session is let in after this long anyway (as the real router does)."""
    concurrency: int | None = Field(default=None, ge=1)
    """Live sessions at most (``verbatim run --concurrency``); ``None``: unbounded."""
    seed: int = 0


class SimResult(Frozen):
    policy: str
    replicas: int
    sessions: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    generated_tokens: int
    hit_rate: float
    busy_max_s: float
    busy_mean_s: float
    imbalance: float
    """Max over mean busy time of the replicas."""
    queue_p50_s: float
    queue_p99_s: float
    admission_wait_mean_s: float
    admission_wait_p99_s: float
    held_requests: int
    makespan_s: float
    tokens_per_s: float
    """Generated tokens per simulated second."""
    requests_per_s: float
    migrations: int
    migrated_tokens: int
    evictions: int
    turn_cached: tuple[tuple[str, int, str, int, int], ...] = ()
    """(session, turn, replica, prompt tokens, cached tokens) per request, when asked for."""


@dataclass(eq=False)
class _Session:
    spec: SimSession
    turn: int = 0
    replica: _Replica | None = None
    context: int = 0
    hashes: dict[int, list[int]] | None = None


@dataclass(eq=False)
class _Request:
    session: _Session
    turn: int
    prompt: int
    completion: int
    hashes: list[int]
    issued: float
    replica: str = ""
    arrived: float = 0.0
    started: float = 0.0
    cached: int = 0
    allocation: Allocation | None = None


class _Replica:
    def __init__(self, index: int, config: SimConfig) -> None:
        self.index, self.name, self.config = index, f"r{index}", config
        self.cache = BlockCache(config.kv_blocks, config.block_size)
        self.waiting: deque[_Request] = deque()
        self.running: list[tuple[float, int, _Request]] = []
        self.prefill: list[_Request] = []
        self.prefill_end = 0.0
        self.decoded = self.last = self.busy = 0.0
        self.version = self.serial = 0
        self.live = Residency()
        self.fresh: ReplicaState | None = None
        """The state as last built; ``None`` once anything the router sees has changed."""

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefill)

    def state(self) -> ReplicaState:
        if self.fresh is None:
            capacity = self.cache.capacity
            self.fresh = ReplicaState(self.name, load=float(self.load), kv_usage=self.cache.in_use / capacity,
                                      live_tokens=self.live.tokens, capacity_tokens=capacity * self.cache.block_size,
                                      live_groups=self.live.shared)
        return self.fresh

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0 and not self.prefill and self.running:
            self.decoded += dt / self.config.costs.decode_token_s
            self.busy += dt * len(self.running) / self.config.max_batch
        self.last = now

    def step(self, now: float) -> list[_Request]:
        """Settle what is due at ``now``; return the requests that finished (their blocks released)."""
        if self.prefill and now >= self.prefill_end - _EPS:
            for req in self.prefill:
                self.serial += 1
                heapq.heappush(self.running, (self.decoded + max(req.completion - 1, 0), self.serial, req))
            self.prefill = []
        finished = []
        while self.running and self.running[0][0] <= self.decoded + _EPS:
            req = heapq.heappop(self.running)[2]
            computed = (req.prompt + req.completion - 1) // self.cache.block_size
            self.cache.release(req.allocation, req.hashes, computed)
            finished.append(req)
        if not self.prefill:
            self._schedule(now)
        return finished

    def next_wake(self, now: float) -> float | None:
        if self.prefill:
            return self.prefill_end
        if self.running:
            return now + (self.running[0][0] - self.decoded) * self.config.costs.decode_token_s
        return None

    def _schedule(self, now: float) -> None:
        costs, block = self.config.costs, self.cache.block_size
        tokens = 0
        while self.waiting and len(self.running) + len(self.prefill) < self.config.max_batch:
            req = self.waiting[0]
            total = math.ceil((req.prompt + req.completion) / block)
            if not self.cache.fits(total, req.prompt):
                break
            hit = self.cache.hit_blocks(req.hashes, req.prompt)
            allocation = self.cache.allocate(req.hashes, hit, req.prompt // block, total)
            if allocation is None:
                break
            self.waiting.popleft()
            req.allocation, req.cached, req.started = allocation, hit * block, now
            tokens += req.prompt - req.cached
            self.prefill.append(req)
        if self.prefill:
            duration = costs.prefill_base_s + costs.prefill_token_s * tokens
            self.prefill_end = now + duration
            self.busy += duration


class _Simulation:
    def __init__(self, workload: Workload, config: SimConfig) -> None:
        self.workload, self.config = workload, config
        self.rng = np.random.default_rng(config.seed)
        self.replicas = [_Replica(i, config) for i in range(config.replicas)]
        self.states = [r.state() for r in self.replicas]
        self.stale: set[int] = set()
        self.by_name = {r.name: r for r in self.replicas}
        self.pins = Pins()
        self.events: list[tuple[float, int, str, object]] = []
        self.serial = 0
        self.now = 0.0
        self.followers: dict[str, list[SimSession]] = {}
        self.queued: deque[SimSession] = deque()
        self.held: dict[int, _Request] = {}
        self.cursor = 0
        self.live = 0
        self.done: list[_Request] = []
        self.waits: list[float] = []
        self.migrations = self.migrated_tokens = self.held_requests = 0

    def push(self, when: float, kind: str, payload: object) -> None:
        self.serial += 1
        heapq.heappush(self.events, (when, self.serial, kind, payload))

    def run(self) -> None:
        for group in self.workload.groups:
            self.push(group.arrival_s, "group", group)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "group":
                self.arrive(payload)
            elif kind == "turn":
                self.issue(payload)
            elif kind == "timeout":
                self.let_in(payload)
            else:
                replica, version = payload
                if version == replica.version:
                    self.settle(replica)

    def arrive(self, group) -> None:
        first, *rest = group.sessions
        if self.config.leader_first and rest:
            self.followers[first.session_id] = rest
            rest = []
        for spec in (first, *rest):
            self.ready(spec)

    def ready(self, spec: SimSession) -> None:
        if self.config.concurrency is not None and self.live >= self.config.concurrency:
            self.queued.append(spec)
            return
        self.live += 1
        self.issue(_Session(spec))

    def issue(self, session: _Session) -> None:
        spec, turn = session.spec, session.turn
        salt = spec.salt(turn)
        if session.hashes is None:
            session.hashes = {}
        if salt not in session.hashes:
            session.hashes[salt] = spec.block_hashes(self.config.block_size, salt)
        req = _Request(session, turn, spec.prompts[turn], spec.completions[turn], session.hashes[salt], self.now)
        if not self.dispatch(req):
            self.serial += 1
            self.held[self.serial] = req
            self.held_requests += 1
            self.push(self.now + self.config.admission_timeout_s, "timeout", self.serial)

    def let_in(self, key: int) -> None:
        """A held session's admission timed out: it goes where it is routed, full or not."""
        req = self.held.pop(key, None)
        if req is not None:
            self.dispatch(req, force=True)

    def dispatch(self, req: _Request, *, force: bool = False) -> bool:
        spec = req.session.spec
        request = RouteRequest(spec.session_id, spec.group_id, new_session=req.turn == 0, context_tokens=req.prompt,
                               shared_tokens=self.shared_blocks(spec))
        decision = route(self.config.route, self.pins, self.current_states(), request)
        replica = self.by_name[decision.replica]
        if not force and not admit(self.config.route, replica.state(), request,
                                       others_live=len(replica.live) > 0):
            return False
        self.pins.apply(request, decision)
        if decision.migrated_from is not None:
            self.migrations += 1
            self.migrated_tokens += decision.lost_tokens
        self.place(req.session, replica, req.prompt)
        self.waits.append(self.now - req.issued)
        req.arrived, req.replica = self.now, replica.name
        replica.advance(self.now)
        replica.waiting.append(req)
        self.settle(replica)
        return True

    def current_states(self) -> list[ReplicaState]:
        for i in self.stale:
            self.states[i] = self.replicas[i].state()
        self.stale.clear()
        return self.states

    def touch(self, replica: _Replica) -> None:
        replica.fresh = None
        self.stale.add(replica.index)

    def place(self, session: _Session, replica: _Replica | None, context: int) -> None:
        """Move a session's live-context tally to ``replica`` (``None``: the session ended)."""
        if session.replica is not None and session.replica is not replica:
            session.replica.live.drop(session.spec.session_id)
            self.touch(session.replica)
        session.replica, session.context = replica, context
        if replica is not None:
            replica.live.set(session.spec.session_id, context, session.spec.group_id, self.shared_blocks(session.spec))
            self.touch(replica)

    def shared_blocks(self, spec: SimSession) -> int:
        return spec.shared // self.config.block_size * self.config.block_size

    def settle(self, replica: _Replica) -> None:
        replica.advance(self.now)
        finished = replica.step(self.now)
        self.touch(replica)
        replica.version += 1
        wake = replica.next_wake(self.now)
        if wake is not None:
            self.push(wake, "wake", (replica, replica.version))
        for req in finished:
            self.finish(req, replica)
        if finished:
            self.retry_held()

    def finish(self, req: _Request, replica: _Replica) -> None:
        self.done.append(req)
        session = req.session
        spec = session.spec
        if req.turn == 0:
            for follower in self.followers.pop(spec.session_id, ()):
                self.ready(follower)
        if req.turn + 1 < len(spec.prompts):
            self.place(session, replica, req.prompt + req.completion)
            session.turn += 1
            think = self.rng.exponential(self.config.think_s) if self.config.think_s > 0 else 0.0
            self.push(self.now + think, "turn", session)
            return
        self.place(session, None, 0)
        self.pins.end(spec.session_id)
        self.live -= 1
        if self.queued:
            self.ready(self.queued.popleft())

    def retry_held(self) -> None:
        if not self.held or not self._room_somewhere():
            return
        keys = list(self.held)
        start = self.cursor % len(keys)
        refusals = 0
        for n, key in enumerate(keys[start:] + keys[:start]):
            req = self.held.pop(key, None)  # out before dispatching: a nested pass must not see it
            if req is None:
                continue  # let in by a nested pass
            if self.dispatch(req):
                refusals = 0
            else:
                self.held[key] = req
                refusals += 1
                if refusals >= _RETRY_BUDGET or not self._room_somewhere():
                    self.cursor = start + n + 1
                    return

    def _room_somewhere(self) -> bool:
        """Could admission let anything in? (No replica with live sessions below the high-water mark: no.)"""
        high = self.config.route.high_water
        return not self.config.route.admission or any(
            len(r.live) == 0 or r.state().pressure < high for r in self.replicas)

    def result(self, label: str, record_turns: bool) -> SimResult:
        done = self.done
        prompt = sum(r.prompt for r in done)
        cached = sum(r.cached for r in done)
        generated = sum(r.completion for r in done)
        busy = np.array([r.busy for r in self.replicas])
        queue = np.array([r.started - r.arrived for r in done] or [0.0])
        waits = np.array(self.waits or [0.0])
        makespan = max(self.now - min((g.arrival_s for g in self.workload.groups), default=0.0), _EPS)
        turns = tuple((r.session.spec.session_id, r.turn, r.replica, r.prompt, r.cached)
                      for r in done) if record_turns else ()
        return SimResult(
            policy=label, replicas=len(self.replicas), sessions=self.workload.sessions, requests=len(done),
            prompt_tokens=prompt, cached_tokens=cached, prefill_tokens=prompt - cached, generated_tokens=generated,
            hit_rate=cached / prompt if prompt else 0.0, busy_max_s=float(busy.max()), busy_mean_s=float(busy.mean()),
            imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            queue_p50_s=float(np.quantile(queue, 0.5)), queue_p99_s=float(np.quantile(queue, 0.99)),
            admission_wait_mean_s=float(waits.mean()), admission_wait_p99_s=float(np.quantile(waits, 0.99)),
            held_requests=self.held_requests, makespan_s=makespan, tokens_per_s=generated / makespan,
            requests_per_s=len(done) / makespan, migrations=self.migrations, migrated_tokens=self.migrated_tokens,
            evictions=sum(r.cache.evictions for r in self.replicas), turn_cached=turns)


def simulate(workload: Workload, config: SimConfig, *, record_turns: bool = False) -> SimResult:
    """Play ``workload`` on ``config.replicas`` simulated replicas under ``config.route``."""
    capacity = config.kv_blocks * config.block_size
    if workload.longest + config.block_size > capacity:
        raise InputError(f"a session of {workload.longest} tokens does not fit a replica's cache of {capacity} tokens",
                         hint="raise kv_blocks or use shorter sessions")
    sim = _Simulation(workload, config)
    sim.run()
    if sim.held or sim.queued or sim.followers:
        raise InputError("the simulation ended with requests still held",
                         hint="admission can never let them in: raise high_water or kv_blocks")
    return sim.result(config.route.label, record_turns)
