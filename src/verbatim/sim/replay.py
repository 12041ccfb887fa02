"""Replay a real ``verbatim run`` through the router simulator and compare prefix-cache hits.

The rollouts are replayed exactly (token ids, turn lengths, cache salts, plan order,
the run's concurrency and its leader-first group start) on as many simulated replicas
as the run used, with the run's routing policy and block size. What may differ is
timing (the cost model is fitted to the run), hence the order of requests inside a
group and what gets evicted when the cache is small.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from verbatim.datamodel import Frozen
from verbatim.engine.routing import RouteConfig
from verbatim.errors import InputError
from verbatim.harness.store import read_run
from verbatim.sim.simulator import CostModel, SimConfig, simulate
from verbatim.sim.workload import fit_costs, workload_from_rollouts


class ReplayCheck(Frozen):
    route: str
    replicas: int
    turns: int
    real_hit_rate: float
    sim_hit_rate: float
    same_cached_turns: int
    """Turns whose simulated cached tokens equal the engine-reported ones."""
    real_turns_per_replica: tuple[int, ...]
    sim_turns_per_replica: tuple[int, ...]
    """Turns served per replica, most first (replica names differ between the two)."""


def replay_check(run_dir: Path, *, kv_blocks: int | None = None, route: str | None = None,
                 replicas: int | None = None) -> ReplayCheck:
    """Simulate the run's own workload under its own policy; ``kv_blocks`` per replica (default: unbounded)."""
    trace = read_run(run_dir)
    rollouts = [r for r in trace.rollouts if r.turns]
    if not rollouts:
        raise InputError(f"{run_dir} holds no rollout with a turn", hint="replay a finished verbatim run")
    engine, options = trace.manifest.engine, trace.manifest.config.get("options", {})
    served = Counter(t.replica or "?" for r in rollouts for t in r.turns)
    replicas = replicas or max(len(engine.get("urls") or ()), len(served), 1)
    spec = route or engine.get("route") or "round_robin"
    routing = options.get("routing", options)  # a run recorded before its config had sections: flat
    config = RouteConfig.parse(spec, high_water=routing.get("high_water", 0.9),
                               admission=routing.get("admission", True))
    workload = workload_from_rollouts(rollouts)
    block = trace.manifest.block_size(run_dir)
    blocks = kv_blocks or (workload.longest // block + 2) * len(rollouts)
    result = simulate(workload, SimConfig(route=config, replicas=replicas, kv_blocks=blocks, block_size=block,
                                          costs=CostModel(**fit_costs(rollouts)),
                                          concurrency=options.get("concurrency")), record_turns=True)
    real = {(r.rollout_id, t.index): t.cached_tokens for r in rollouts for t in r.turns}
    prompt = sum(t.prompt_tokens for r in rollouts for t in r.turns)
    sim_served = Counter(replica for _, _, replica, _, _ in result.turn_cached)
    return ReplayCheck(route=config.label, replicas=replicas, turns=len(real),
                       real_hit_rate=sum(real.values()) / prompt if prompt else 0.0, sim_hit_rate=result.hit_rate,
                       same_cached_turns=sum(real[(s, k)] == c for s, k, _, _, c in result.turn_cached),
                       real_turns_per_replica=tuple(sorted(served.values(), reverse=True)),
                       sim_turns_per_replica=tuple(sorted(sim_served.values(), reverse=True)))
