"""The router simulator: block cache, hit accounting, policies, replay, and the bench around it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from verbatim.bench import router as bench_router
from verbatim.datamodel import Completion, Rollout
from verbatim.engine.routing import RouteConfig
from verbatim.errors import InputError
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.prefix_cache import chain_hashes, token_block_hashes
from verbatim.sim.block_cache import BlockCache
from verbatim.sim.replay import replay_check
from verbatim.sim.simulator import CostModel, SimConfig, simulate
from verbatim.sim.workload import (
    GroupShape,
    RolloutShape,
    SimGroup,
    SimSession,
    Workload,
    sample_workload,
    shapes_from_rollouts,
    workload_from_rollouts,
)

COSTS = CostModel(prefill_base_s=0.01, prefill_token_s=0.001, decode_token_s=0.02)
SHAPES = [GroupShape(shared=96, rollouts=(RolloutShape(prompt=110, completions=(40, 30, 20), observations=(20, 25)),
                                          RolloutShape(prompt=110, completions=(50, 20), observations=(30,))))]


def config(policy: str, **changes) -> SimConfig:
    base = dict(route=RouteConfig.parse(policy), replicas=4, kv_blocks=60, block_size=16, costs=COSTS, think_s=0.5)
    return SimConfig(**{**base, **changes})


# ---------------------------------------------------------------------------
# Block cache
# ---------------------------------------------------------------------------


def test_freed_blocks_are_evicted_tail_first_then_least_recently_freed():
    cache = BlockCache(capacity=6, block_size=4)
    a, b = chain_hashes([1, 2, 3]), chain_hashes([7, 8, 9])
    held = cache.allocate(a, 0, 3, 3)
    cache.release(held, a, 3)
    assert cache.free_order() == [a[2], a[1], a[0]]
    cache.release(cache.allocate(b, 0, 3, 3), b, 3)
    assert cache.in_use == 0 and cache.cached_blocks == 6
    cache.allocate(chain_hashes([5]), 0, 1, 2)  # two new blocks: a's tail blocks go first
    assert cache.evictions == 2
    assert cache.hit_blocks(a, prompt_tokens=13) == 1 and cache.hit_blocks(b, prompt_tokens=13) == 3


def test_a_hit_refreshes_a_block_in_the_lru_order():
    cache = BlockCache(capacity=4, block_size=4)
    a, b = chain_hashes([1, 2]), chain_hashes([3, 4])
    cache.release(cache.allocate(a, 0, 2, 2), a, 2)
    cache.release(cache.allocate(b, 0, 2, 2), b, 2)
    reuse = cache.allocate(a, cache.hit_blocks(a, 9), 2, 2)  # a is used again: now the most recent
    cache.release(reuse, a, 2)
    assert cache.free_order() == [b[1], b[0], a[1], a[0]]


def test_blocks_of_running_requests_are_never_evicted():
    cache = BlockCache(capacity=4, block_size=4)
    running = cache.allocate(chain_hashes([1, 2, 3]), 0, 3, 3)
    assert cache.allocate(chain_hashes([9, 9]), 0, 2, 2) is None
    assert cache.in_use == 3 and cache.evictions == 0
    cache.release(running, chain_hashes([1, 2, 3]), 3)
    assert cache.allocate(chain_hashes([9, 9]), 0, 2, 2) is not None


def test_hash_chain_salt_and_parent():
    tokens = np.arange(64, dtype=np.int32)
    cache = BlockCache(capacity=16, block_size=16)
    plain = token_block_hashes(tokens, 16)
    cache.release(cache.allocate(plain, 0, 4, 4), plain, 4)
    assert cache.hit_blocks(token_block_hashes(tokens, 16), 65) == 4
    assert cache.hit_blocks(token_block_hashes(tokens, 16, salt=7), 65) == 0
    other_start = tokens.copy()
    other_start[0] = 999  # same later blocks, different parent: nothing matches
    assert cache.hit_blocks(token_block_hashes(other_start, 16), 65) == 0


def test_a_fully_cached_prompt_still_computes_its_last_block():
    cache = BlockCache(capacity=8, block_size=4)
    h = chain_hashes([1, 2, 3])
    cache.release(cache.allocate(h, 0, 3, 3), h, 3)
    assert cache.hit_blocks(h, prompt_tokens=12) == 2
    assert cache.hit_blocks(h, prompt_tokens=13) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=40))
def test_block_accounting_invariants(ops):
    cache, held = BlockCache(capacity=10, block_size=4), []
    for seq, blocks, finish in ops:
        hashes = chain_hashes([(seq, i) for i in range(6)])
        allocation = cache.allocate(hashes, cache.hit_blocks(hashes, 4 * blocks + 1), blocks, blocks)
        if allocation is not None:
            held.append((allocation, hashes, blocks))
        if finish and held:
            allocation, hashes, blocks = held.pop(0)
            cache.release(allocation, hashes, blocks)
        assert 0 <= cache.in_use <= cache.capacity
        assert cache.in_use + len(cache.free_order()) <= cache.capacity
        physical = {h for a, _, _ in held for h in a.blocks if h is not None}
        assert cache.in_use == len(physical) + sum(h is None for a, _, _ in held for h in a.blocks)
    for allocation, hashes, blocks in held:
        cache.release(allocation, hashes, blocks)
    assert cache.in_use == 0


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


def test_every_request_is_served_and_prompt_is_cached_plus_prefill():
    workload = sample_workload(SHAPES, 40, 4, group_rate_per_s=2.0, seed=3)
    result = simulate(workload, config("sticky_least_loaded+group"), record_turns=True)
    turns = sum(len(s.prompts) for g in workload.groups for s in g.sessions)
    assert result.requests == len(result.turn_cached) == turns
    assert result.prompt_tokens == result.cached_tokens + result.prefill_tokens
    assert result.prompt_tokens == sum(p for _, _, _, p, _ in result.turn_cached)
    for _, _, _, prompt, cached in result.turn_cached:
        assert cached % 16 == 0 and cached <= prompt - 1


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(bench_router.POLICIES), replicas=st.integers(1, 5), kv_blocks=st.integers(17, 80),
       group_size=st.integers(1, 6), seed=st.integers(0, 10))
def test_every_policy_serves_every_turn_within_the_cache(policy, replicas, kv_blocks, group_size, seed):
    workload = sample_workload(SHAPES, 24, group_size, group_rate_per_s=3.0, seed=seed)
    result = simulate(workload, config(policy, replicas=replicas, kv_blocks=kv_blocks, seed=seed))
    assert result.requests == sum(len(s.prompts) for g in workload.groups for s in g.sessions)
    assert 0 <= result.cached_tokens < result.prompt_tokens
    assert result.imbalance >= 1.0 and result.queue_p99_s >= result.queue_p50_s >= 0


def test_same_seed_same_result_and_think_times_follow_the_seed():
    workload = sample_workload(SHAPES, 60, 4, group_rate_per_s=2.0, seed=1)
    first = simulate(workload, config("least_loaded", seed=5))
    assert first == simulate(workload, config("least_loaded", seed=5))
    assert first.makespan_s != simulate(workload, config("least_loaded", seed=6)).makespan_s
    assert sample_workload(SHAPES, 60, 4, 2.0, seed=1).groups[3].arrival_s == workload.groups[3].arrival_s


def test_sticky_and_group_policies_beat_round_robin_on_a_limited_cache():
    workload = sample_workload(SHAPES, 400, 8, group_rate_per_s=0.8, seed=2)
    rates = {p: simulate(workload, config(p, replicas=8, kv_blocks=40)).hit_rate
             for p in ("round_robin", "session_hash", "sticky_least_loaded", "sticky_least_loaded+group")}
    assert rates["sticky_least_loaded"] > rates["round_robin"] + 0.15
    assert rates["session_hash"] > rates["round_robin"] + 0.15
    assert rates["sticky_least_loaded+group"] > rates["sticky_least_loaded"]


def _one_group(size: int = 8, shared: int = 160, prompt: int = 200) -> Workload:
    sessions = tuple(SimSession(session_id=f"s{i}", group_id="g", index=i, group_index=0, shared=shared,
                                prompts=(prompt,), completions=(8,)) for i in range(size))
    return Workload((SimGroup("g", 0.0, sessions),))


@pytest.mark.parametrize("leader_first", [True, False])
def test_group_co_routing_prefills_the_group_prompt_once(leader_first):
    no_spill = RouteConfig.parse("least_loaded+group", overload_slack=8)  # 8 in flight is no overload here
    grouped = simulate(_one_group(), config("least_loaded+group", route=no_spill, leader_first=leader_first))
    assert grouped.prefill_tokens == 200 + 7 * (200 - 160)
    spread = simulate(_one_group(), config("least_loaded", leader_first=False))
    assert spread.prefill_tokens == 4 * 200 + 4 * (200 - 160)  # one full prefill per replica


def test_admission_holds_new_sessions_on_a_full_replica():
    workload = sample_workload(SHAPES, 48, 8, group_rate_per_s=50.0, seed=0)
    tight = config("sticky_least_loaded+group", replicas=1, kv_blocks=40, route=RouteConfig.parse(
        "sticky_least_loaded+group", high_water=0.5))
    result = simulate(workload, tight)
    assert result.held_requests > 0 and result.admission_wait_mean_s > 0
    assert result.requests == sum(len(s.prompts) for g in workload.groups for s in g.sessions)


def test_a_held_session_is_let_in_when_its_admission_times_out():
    sessions = tuple(SimSession(session_id=f"s{i}", group_id=f"g{i}", index=i, group_index=i, shared=0,
                                prompts=(100,), completions=(500,)) for i in range(4))
    workload = Workload(tuple(SimGroup(f"g{i}", 0.0, (s,)) for i, s in enumerate(sessions)))
    strict = RouteConfig.parse("least_loaded", high_water=0.01)
    result = simulate(workload, config("least_loaded", route=strict, replicas=1, admission_timeout_s=1.0))
    assert result.held_requests == 3  # each one's context would put the busy replica over the mark
    assert result.admission_wait_mean_s == pytest.approx(0.75) and result.admission_wait_p99_s == pytest.approx(1.0)


def test_a_session_longer_than_the_cache_is_an_input_error():
    with pytest.raises(InputError, match="does not fit"):
        simulate(_one_group(prompt=2000), config("round_robin", kv_blocks=20))


# ---------------------------------------------------------------------------
# Replay of real rollouts
# ---------------------------------------------------------------------------


def _rollout(rid: str, prompt: np.ndarray, seed: int, turns: int = 3, sampled: int = 21, obs: int = 9,
             first_cached: int = 0) -> Rollout:
    """A rollout as an engine with 16-token blocks serves it: turn 0 from ``first_cached``, later turns from
    the whole previous context (full blocks, never the last token)."""
    rng = np.random.default_rng(seed)
    ledger = Ledger()
    ledger.append_prompt(prompt)
    previous_end = 0
    for k in range(turns):
        n = len(ledger)
        cached = min(previous_end - 1, n - 1) // 16 * 16 if k else first_cached
        ledger.append_completion(Completion(
            token_ids=rng.integers(0, 50_000, sampled + k), logprobs=-rng.exponential(1.0, sampled + k),
            versions=np.zeros(sampled + k), finish_reason="stop", prompt_tokens=n, cached_tokens=cached,
            first_token_s=0.1 + 0.001 * (n - cached), total_s=0.5 + 0.01 * (sampled + k)))
        previous_end = len(ledger)
        if k < turns - 1:
            ledger.append_observation(rng.integers(0, 50_000, obs + k))
    return ledger.to_rollout(run_id="run", group_id="g0", rollout_id=rid)


def test_replay_reproduces_turn_lengths_tokens_and_shared_prefix():
    prompt = np.random.default_rng(0).integers(0, 50_000, 70)
    rollouts = [_rollout("a", prompt, 1), _rollout("b", prompt, 2)]
    workload = workload_from_rollouts(rollouts)
    (group,) = workload.groups
    for session, rollout in zip(group.sessions, rollouts):
        assert session.prompts == tuple(t.prompt_end for t in rollout.turns)
        assert session.completions == tuple(t.completion_tokens for t in rollout.turns)
        assert session.shared == 70
    shape = shapes_from_rollouts(rollouts)[0]
    assert shape.shared == 70 and shape.rollouts[0].prompts() == group.sessions[0].prompts
    result = simulate(workload, config("sticky_least_loaded+group", replicas=2, think_s=0.0), record_turns=True)
    by_turn = {(s, k): (replica, cached) for s, k, replica, _, cached in result.turn_cached}
    assert by_turn[("a", 0)] == (by_turn[("b", 0)][0], 0)
    assert by_turn[("b", 0)][1] == 64  # the shared prompt's full blocks, computed by a
    for sid, rollout in zip("ab", rollouts):
        for k in (1, 2):
            before, now = rollout.turns[k - 1], rollout.turns[k]
            expected = min((before.completion_end - 1) // 16, (now.prompt_end - 1) // 16) * 16
            assert by_turn[(sid, k)][1] == expected


def test_replay_with_a_changed_salt_misses():
    prompt = np.random.default_rng(0).integers(0, 50_000, 70)
    rollout = _rollout("a", prompt, 1, turns=2)
    turns = (rollout.turns[0], rollout.turns[1].model_copy(update={"cache_salt": "v2"}))
    result = simulate(workload_from_rollouts([rollout.model_copy(update={"turns": turns})]),
                      config("round_robin", replicas=1), record_turns=True)
    assert [cached for *_, cached in result.turn_cached] == [0, 0]


def test_replay_check_of_a_run_directory_agrees_turn_by_turn(tmp_path: Path):
    prompt = np.random.default_rng(0).integers(0, 50_000, 70)
    rollouts = [_rollout("g0-r01", prompt, 2, first_cached=64), _rollout("g0-r00", prompt, 1)]  # completion order
    writer = TraceWriter(tmp_path / "run", RunManifest(run_id="run", engine={"block_size": 16},
                                                       config={"options": {"concurrency": 4}}))
    writer.write_batch(rollouts)
    check = replay_check(tmp_path / "run")
    assert check.replicas == 1 and check.turns == 6
    assert check.same_cached_turns == 6 and check.sim_hit_rate == check.real_hit_rate


# ---------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------


def test_committed_workload_plans_a_loaded_fleet():
    workload = bench_router.load_workload([])
    plan = bench_router.plan_fleet(workload, bench_router.FleetSettings(), replicas=8, group_size=8)
    assert plan.group_rate_per_s > 0 and plan.live_sessions_per_replica > 0
    longest = max(r.prompts()[-1] + r.completions[-1] for g in workload.groups for r in g.rollouts)
    assert plan.kv_blocks * 16 > longest


def test_router_command_writes_json_and_only_its_own_doc_section(tmp_path: Path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\n<!-- bench-rollouts:begin -->\nkeep me\n<!-- bench-rollouts:end -->\n")
    args = dict(traces=[], replicas=[4], sessions=[64], group_sizes=[8], seed=0, as_json=True,
                console=Console(file=open(tmp_path / "console.txt", "w")),
                policies=("round_robin", "sticky_least_loaded+group"), machine_line="Machine: M.")
    with pytest.raises(InputError, match="bench-router:begin"):  # checked before simulating
        bench_router.router_command(write=doc, **args)
    assert capsys.readouterr().out == ""
    doc.write_text(doc.read_text() + "\n## Router\n\n<!-- bench-router:begin -->\n<!-- bench-router:end -->\n")
    rows = bench_router.router_command(write=doc, **args)
    assert [r.policy for r in rows] == ["round_robin", "sticky_least_loaded+group"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["policy"] for p in printed] == ["round_robin", "sticky_least_loaded+group"]
    assert printed[1]["hit_rate"] == rows[1].hit_rate
    text = doc.read_text()
    assert "keep me" in text and text.count("<!-- bench-router:begin -->") == 1
    assert (tmp_path / bench_router.PLOT_NAME).stat().st_size > 1000
    assert f"--seed 0 --write {doc}`" in text and "Machine: M.\n<!-- bench-router:end -->" in text
    bench_router.router_command(write=doc, **args)
    again = doc.read_text()
    assert again.count("## Router") == 1 and again.count("<!-- bench-router:end -->") == 1
    assert "keep me" in again


def test_router_table_is_readable_at_80_columns():
    console = Console(width=80, record=True, file=io.StringIO())
    rows = bench_router.router_command([], [4], [1000], [16], 0, None, False, console,
                                       policies=("round_robin", "sticky_least_loaded+group"))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert "sticky+g" in text and f"{rows[1].hit_rate:.1%}" in text and "4/1k/16" in text
