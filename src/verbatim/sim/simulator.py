"""Discrete-event simulator of a replica fleet behind the router (``verbatim bench router``).

Routing and admission are :mod:`verbatim.engine.routing`'s own ``route`` and ``admit``,
fed with :class:`ReplicaState` built from the simulated replicas: ``load`` = requests
waiting or running there, ``kv_usage`` = blocks held by running requests,
``live_tokens`` = context of the live sessions last served there, a group's shared
prompt counted once (:class:`Residency`, as in the router). Pure Python and
NumPy: no engine, no I/O; the same seed gives the same result.

Each replica (:class:`~verbatim.sim.replica.SimReplica`) has a finite prefix
cache and serves requests with continuous batching, approximated as
:mod:`verbatim.sim.replica` describes (FIFO queue, one prefill step for the
requests scheduled together, one token per decode step, busy time weighted by batch share);
its timing, :class:`CostModel`, is defined there and importable from here too.

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
from collections import deque

import numpy as np
from pydantic import Field

from verbatim.datamodel import Frozen
from verbatim.engine.routing import Pins, ReplicaState, RouteConfig, RouteRequest, admit, route
from verbatim.errors import InputError
from verbatim.prefix_cache import whole_blocks
from verbatim.sim.replica import TIME_EPS, CostModel, LiveSession, SimReplica, SimRequest
from verbatim.sim.workload import SimSession, Workload

_RETRY_BUDGET = 16
"""Refusals in a row that end one retry pass over the held sessions (the next pass starts after them)."""


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


class _Simulation:
    def __init__(self, workload: Workload, config: SimConfig) -> None:
        self.workload, self.config = workload, config
        self.rng = np.random.default_rng(config.seed)
        self.replicas = [SimReplica(i, config.costs, kv_blocks=config.kv_blocks, block_size=config.block_size,
                                    max_batch=config.max_batch) for i in range(config.replicas)]
        self.states = [r.state() for r in self.replicas]
        self.stale: set[int] = set()
        self.by_name = {r.name: r for r in self.replicas}
        self.pins = Pins()
        self.events: list[tuple[float, int, str, object]] = []
        self.serial = 0
        self.now = 0.0
        self.followers: dict[str, list[SimSession]] = {}
        self.queued: deque[SimSession] = deque()
        self.held: dict[int, SimRequest] = {}
        self.cursor = 0
        self.live = 0
        self.done: list[SimRequest] = []
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
        self.issue(LiveSession(spec))

    def issue(self, session: LiveSession) -> None:
        spec, turn = session.spec, session.turn
        salt = spec.salt(turn)
        if session.hashes is None:
            session.hashes = {}
        if salt not in session.hashes:
            session.hashes[salt] = spec.block_hashes(self.config.block_size, salt)
        req = SimRequest(session, turn, spec.prompts[turn], spec.completions[turn], session.hashes[salt], self.now)
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

    def dispatch(self, req: SimRequest, *, force: bool = False) -> bool:
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

    def touch(self, replica: SimReplica) -> None:
        replica.fresh = None
        self.stale.add(replica.index)

    def place(self, session: LiveSession, replica: SimReplica | None, context: int) -> None:
        """Move a session's live-context tally to ``replica`` (``None``: the session ended)."""
        if session.replica is not None and session.replica is not replica:
            session.replica.live.drop(session.spec.session_id)
            self.touch(session.replica)
        session.replica, session.context = replica, context
        if replica is not None:
            replica.live.set(session.spec.session_id, context, session.spec.group_id, self.shared_blocks(session.spec))
            self.touch(replica)

    def shared_blocks(self, spec: SimSession) -> int:
        return whole_blocks(spec.shared, self.config.block_size)

    def settle(self, replica: SimReplica) -> None:
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

    def finish(self, req: SimRequest, replica: SimReplica) -> None:
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
        makespan = max(self.now - min((g.arrival_s for g in self.workload.groups), default=0.0), TIME_EPS)
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
