"""One simulated replica of the router simulator (:mod:`verbatim.sim.simulator`).

A :class:`SimReplica` has a finite :class:`BlockCache` and serves requests with
continuous batching, approximated as follows:

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

The replica keeps no clock of its own: the simulation calls :meth:`SimReplica.advance`
and :meth:`SimReplica.step` at each event and wakes it again at
:meth:`SimReplica.next_wake`. It also keeps the :class:`ReplicaState` the router sees.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from pydantic import Field

from verbatim.datamodel import Frozen
from verbatim.engine.routing import ReplicaState, Residency
from verbatim.prefix_cache import computed_tokens, full_blocks
from verbatim.sim.block_cache import Allocation, BlockCache
from verbatim.sim.workload import SimSession

TIME_EPS = 1e-6
"""Slack when comparing simulated times and decoded-token counts."""


class CostModel(Frozen):
    """Replica timing: prefill step = base + per-token × prefilled tokens; decode step = one token per request."""

    prefill_base_s: float = Field(ge=0.0)
    prefill_token_s: float = Field(ge=0.0)
    decode_token_s: float = Field(gt=0.0)
    source: str = ""


@dataclass(eq=False)
class LiveSession:
    """A session being played: its next turn, where it was last served and its context there."""

    spec: SimSession
    turn: int = 0
    replica: SimReplica | None = None
    context: int = 0
    hashes: dict[int, list[int]] | None = None
    """Block hashes of its prompts, by cache salt (computed on first use)."""


@dataclass(eq=False)
class SimRequest:
    """One turn's request: its lengths and block hashes, then where and when it was served."""

    session: LiveSession
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


class SimReplica:
    """A replica: its cache, waiting queue, prefill step in progress and running batch."""

    def __init__(self, index: int, costs: CostModel, *, kv_blocks: int, block_size: int, max_batch: int) -> None:
        self.index, self.name = index, f"r{index}"
        self.costs, self.max_batch = costs, max_batch
        self.cache = BlockCache(kv_blocks, block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[float, int, SimRequest]] = []
        """(decoded count at which it finishes, serial, request): a heap."""
        self.prefill: list[SimRequest] = []
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
        """Decode (and count busy time) from the last moment seen up to ``now``, unless a prefill step runs."""
        dt = now - self.last
        if dt > 0 and not self.prefill and self.running:
            self.decoded += dt / self.costs.decode_token_s
            self.busy += dt * len(self.running) / self.max_batch
        self.last = now

    def step(self, now: float) -> list[SimRequest]:
        """Settle what is due at ``now``; return the requests that finished (their blocks released)."""
        if self.prefill and now >= self.prefill_end - TIME_EPS:
            for req in self.prefill:
                self.serial += 1
                heapq.heappush(self.running, (self.decoded + max(req.completion - 1, 0), self.serial, req))
            self.prefill = []
        finished = []
        while self.running and self.running[0][0] <= self.decoded + TIME_EPS:
            req = heapq.heappop(self.running)[2]
            computed = full_blocks(computed_tokens(req.prompt, req.completion), self.cache.block_size)
            self.cache.release(req.allocation, req.hashes, computed)
            finished.append(req)
        if not self.prefill:
            self._schedule(now)
        return finished

    def next_wake(self, now: float) -> float | None:
        """When something is next due here (a prefill step ends, a request finishes); ``None``: idle."""
        if self.prefill:
            return self.prefill_end
        if self.running:
            return now + (self.running[0][0] - self.decoded) * self.costs.decode_token_s
        return None

    def _schedule(self, now: float) -> None:
        costs, block = self.costs, self.cache.block_size
        tokens = 0
        while self.waiting and len(self.running) + len(self.prefill) < self.max_batch:
            req = self.waiting[0]
            total = math.ceil((req.prompt + req.completion) / block)
            if not self.cache.fits(total, req.prompt):
                break
            hit = self.cache.hit_blocks(req.hashes, req.prompt)
            allocation = self.cache.allocate(req.hashes, hit, full_blocks(req.prompt, block), total)
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
