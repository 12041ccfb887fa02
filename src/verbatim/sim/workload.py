"""Workloads for the router simulator: groups of sessions with per-turn prompt and completion lengths.

Two sources. *Shapes* are the per-rollout length tables of a real ``verbatim run``
trace (first prompt, completions, observations; the group's shared prompt), and
:func:`sample_workload` draws sessions from them with replacement, groups arriving
as a Poisson process. :func:`workload_from_rollouts` replays real rollouts exactly:
their turn lengths, their token ids (so shared prefixes are exact) and cache salts.

A session's tokens are never materialised in the synthetic case: block ``i`` of a
session is keyed by (its group, ``i``) while it lies inside the group's shared
prompt and by (the session, ``i``) after it, which is what an append-only history
with a common opening produces.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field

from verbatim.datamodel import Frozen, Rollout
from verbatim.errors import InputError
from verbatim.prefix_cache import chain_hashes, common_prefix, full_blocks, token_block_hashes


class RolloutShape(Frozen):
    """The lengths of one real rollout: first prompt, each completion, each observation between turns."""

    prompt: int = Field(ge=1)
    completions: tuple[int, ...] = Field(min_length=1)
    observations: tuple[int, ...] = ()
    """Tokens appended between turn k and turn k+1 (one fewer than completions)."""

    def prompts(self) -> tuple[int, ...]:
        lengths, end = [self.prompt], self.prompt + self.completions[0]
        for obs, done in zip(self.observations, self.completions[1:]):
            lengths.append(end + obs)
            end += obs + done
        return tuple(lengths)


class GroupShape(Frozen):
    shared: int = Field(ge=0)
    """Leading tokens every member's first prompt has in common."""
    rollouts: tuple[RolloutShape, ...] = Field(min_length=1)


@dataclass(frozen=True, eq=False)
class SimSession:
    session_id: str
    group_id: str
    index: int
    group_index: int
    shared: int
    prompts: tuple[int, ...]
    completions: tuple[int, ...]
    tokens: np.ndarray | None = None
    """Exact token ids (replay); ``None`` for a synthetic session."""
    salts: tuple[int, ...] = ()
    """Cache salt per turn as an integer (0: none)."""

    @property
    def length(self) -> int:
        return self.prompts[-1] + self.completions[-1]

    def salt(self, turn: int) -> int:
        return self.salts[turn] if self.salts else 0

    def block_hashes(self, block_size: int, salt: int = 0) -> list[int]:
        """Hashes of every full block of the session's final sequence."""
        if self.tokens is not None:
            return token_block_hashes(self.tokens[:self.length], block_size, salt)
        shared_blocks = full_blocks(self.shared, block_size)
        keys = [(0, self.group_index, i) if i < shared_blocks else (1, self.index, i)
                for i in range(full_blocks(self.length, block_size))]
        return chain_hashes(keys, salt)


@dataclass(frozen=True, eq=False)
class SimGroup:
    group_id: str
    arrival_s: float
    sessions: tuple[SimSession, ...]


@dataclass(frozen=True, eq=False)
class Workload:
    groups: tuple[SimGroup, ...]
    info: dict[str, object] = field(default_factory=dict)

    @property
    def sessions(self) -> int:
        return sum(len(g.sessions) for g in self.groups)

    @property
    def longest(self) -> int:
        return max((s.length for g in self.groups for s in g.sessions), default=0)


def shape_of(rollout: Rollout) -> RolloutShape | None:
    """The lengths of a rollout's turns (``None`` for a rollout with no turns)."""
    turns = rollout.turns
    if not turns:
        return None
    observations = tuple(b.prompt_end - a.completion_end for a, b in zip(turns, turns[1:]))
    return RolloutShape(prompt=max(turns[0].prompt_end, 1),
                        completions=tuple(max(t.completion_end - t.prompt_end, 1) for t in turns),
                        observations=observations)


def shapes_from_rollouts(rollouts: Sequence[Rollout]) -> list[GroupShape]:
    """Per group: the members' shapes and the length of their common first-prompt prefix."""
    by_group: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        if rollout.turns:
            by_group.setdefault(rollout.group_id, []).append(rollout)
    groups = []
    for members in by_group.values():
        shapes = tuple(s for s in map(shape_of, members) if s is not None)
        groups.append(GroupShape(shared=common_prefix(first_prompts(members)), rollouts=shapes))
    return groups


def first_prompts(members: Sequence[Rollout]) -> list[np.ndarray]:
    return [m.tokens.token_id[:m.turns[0].prompt_end] for m in members]


def sample_workload(shapes: Sequence[GroupShape], sessions: int, group_size: int, group_rate_per_s: float,
                    seed: int = 0) -> Workload:
    """Groups of ``group_size`` sessions drawn from ``shapes`` (with replacement), Poisson arrivals."""
    if not shapes:
        raise InputError("the workload has no rollouts to sample", hint="use a trace with at least one turn")
    if sessions < 1 or group_size < 1 or group_rate_per_s <= 0:
        raise InputError("sessions, group size and arrival rate must be positive")
    rng = np.random.default_rng(seed)
    count = math.ceil(sessions / group_size)
    arrivals = np.cumsum(rng.exponential(1.0 / group_rate_per_s, count))
    groups, index = [], 0
    for g in range(count):
        shape = shapes[int(rng.integers(len(shapes)))]
        members = []
        for _ in range(min(group_size, sessions - g * group_size)):
            rollout = shape.rollouts[int(rng.integers(len(shape.rollouts)))]
            members.append(SimSession(session_id=f"s{index}", group_id=f"g{g}", index=index, group_index=g,
                                      shared=min(shape.shared, rollout.prompt), prompts=rollout.prompts(),
                                      completions=rollout.completions))
            index += 1
        groups.append(SimGroup(group_id=f"g{g}", arrival_s=float(arrivals[g]), sessions=tuple(members)))
    return Workload(tuple(groups), info={"source": "sampled", "seed": seed, "group_size": group_size})


def workload_from_rollouts(rollouts: Sequence[Rollout]) -> Workload:
    """Real rollouts as sessions: their turn lengths, token ids and salts; every group arrives at time 0.

    Groups and their members are taken in id order, which is ``verbatim run``'s plan order
    (a trace file holds them in completion order), so a replay with ``leader_first`` and
    ``concurrency`` set as in the run starts the sessions in the run's order.
    """
    by_group: dict[str, list[Rollout]] = {}
    for rollout in sorted(rollouts, key=lambda r: (r.group_id, r.rollout_id)):
        if rollout.turns:
            by_group.setdefault(rollout.group_id, []).append(rollout)
    groups, index = [], 0
    for g, (group_id, members) in enumerate(by_group.items()):
        shared = common_prefix(first_prompts(members))
        sessions = []
        for rollout in members:
            turns = rollout.turns
            sessions.append(SimSession(
                session_id=rollout.rollout_id, group_id=group_id, index=index, group_index=g, shared=shared,
                prompts=tuple(t.prompt_end for t in turns),
                completions=tuple(max(t.completion_end - t.prompt_end, 1) for t in turns),
                tokens=np.asarray(rollout.tokens.token_id), salts=tuple(salt_number(t.cache_salt) for t in turns)))
            index += 1
        groups.append(SimGroup(group_id=group_id, arrival_s=0.0, sessions=tuple(sessions)))
    return Workload(tuple(groups), info={"source": "replay", "rollouts": index})


def salt_number(salt: str | None) -> int:
    """A cache salt as a stable integer for block hashing (0: no salt)."""
    return 0 if not salt else zlib.crc32(salt.encode()) + 1


class TraceWorkload(Frozen):
    """What the simulator takes from real runs: group shapes and the replica timings fitted to them."""

    runs: tuple[str, ...] = ()
    """Where the shapes come from (run id, env, model, engine), one line per run."""
    block_size: int = Field(ge=1)
    """The runs' engine block size (the simulator may use another)."""
    costs: dict[str, float]
    """``prefill_base_s``, ``prefill_token_s``, ``decode_token_s`` fitted by :func:`fit_costs`."""
    groups: tuple[GroupShape, ...] = Field(min_length=1)


def fit_costs(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Replica timings from a trace's per-turn engine timings.

    Prefill: least squares of time to first token (less queueing) on prefilled tokens
    (prompt − cached), clamped at zero. Decode: the median over turns of
    (total − first token time) / (completion tokens − 1). Both are measured under the
    run's own concurrency, so they include the interference of batched requests.
    """
    turns = [t for r in rollouts for t in r.turns if t.total_s > 0 and t.first_token_s > 0]
    if len(turns) < 3:
        return _fit_totals(rollouts)
    prefill = np.array([t.prompt_end - t.cached_tokens for t in turns], dtype=float)
    first = np.array([max(t.first_token_s - t.queue_s, 0.0) for t in turns])
    slope, base = np.polyfit(prefill, first, 1) if np.ptp(prefill) > 0 else (0.0, float(np.median(first)))
    if slope <= 0:
        slope, base = 0.0, float(np.median(first))
    elif base < 0:
        slope, base = float(np.sum(first * prefill) / np.sum(prefill * prefill)), 0.0
    decodes = [(t.total_s - t.first_token_s) / (t.completion_tokens - 1) for t in turns if t.completion_tokens > 1]
    decode = float(np.median(decodes)) if decodes else float(np.median(first))
    return {"prefill_base_s": float(base), "prefill_token_s": float(slope), "decode_token_s": max(decode, 1e-6)}


def _fit_totals(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Timings from request totals alone (an HTTP engine reports no first-token time).

    Least squares of ``total_s`` on (1, prefilled tokens, generated tokens), each
    coefficient clamped at zero.
    """
    turns = [t for r in rollouts for t in r.turns if t.total_s > 0]
    if len(turns) < 3:
        raise InputError("too few timed turns to fit a cost model", hint="use a trace of a real verbatim run")
    design = np.array([[1.0, t.prompt_end - t.cached_tokens, t.completion_tokens] for t in turns])
    total = np.array([t.total_s for t in turns])
    base, prefill, decode = np.clip(np.linalg.lstsq(design, total, rcond=None)[0], 0.0, None)
    if decode <= 0:
        decode = float(np.median(total / np.maximum(design[:, 2], 1)))
    return {"prefill_base_s": float(base), "prefill_token_s": float(prefill),
            "decode_token_s": max(float(decode), 1e-6)}
