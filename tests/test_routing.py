"""The routing decision core: every policy, stickiness, migration, group co-routing and admission."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.engine.routing import (
    Decision,
    Pins,
    ReplicaState,
    Residency,
    RouteConfig,
    RoutePolicy,
    RouteRequest,
    admit,
    least_loaded,
    ring_choice,
    route,
)
from verbatim.errors import EngineError, InputError


def fleet(*loads: float, down: tuple[int, ...] = ()) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", load=load, healthy=i not in down) for i, load in enumerate(loads)]


def config(policy: str, **kw) -> RouteConfig:
    return RouteConfig.parse(policy, **kw)


def play(cfg: RouteConfig, pins: Pins, replicas: list[ReplicaState], request: RouteRequest) -> Decision:
    decision = route(cfg, pins, replicas, request)
    pins.apply(request, decision)
    return decision


def first(session: str, group: str | None = None, context: int = 100) -> RouteRequest:
    return RouteRequest(session, group, new_session=True, context_tokens=context)


def later(session: str, group: str | None = None, context: int = 300) -> RouteRequest:
    return RouteRequest(session, group, new_session=False, context_tokens=context)


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "policy", "group"), [
    ("round_robin", RoutePolicy.ROUND_ROBIN, False),
    ("least_loaded", RoutePolicy.LEAST_LOADED, False),
    ("session_hash+group", RoutePolicy.SESSION_HASH, True),
    ("sticky_least_loaded+group", RoutePolicy.STICKY_LEAST_LOADED, True),
    ("group", RoutePolicy.STICKY_LEAST_LOADED, True),
])
def test_parse(spec, policy, group):
    cfg = RouteConfig.parse(spec)
    assert (cfg.policy, cfg.group) == (policy, group)
    assert RouteConfig.parse(cfg.label) == cfg


@pytest.mark.parametrize("spec,message", [
    ("sticky", "unknown routing policy 'sticky'"),
    ("hash", "unknown routing policy 'hash'"),
    ("round_robin+nope", "unknown routing part 'nope' in --route 'round_robin+nope'"),
    ("nope+group", "unknown routing part 'nope'"),
    ("round_robin+least_loaded", "names more than one policy (round_robin, least_loaded)"),
])
def test_parse_refuses_unknown_or_double_policies(spec, message):
    with pytest.raises(InputError) as caught:
        RouteConfig.parse(spec)
    assert message in caught.value.one_line()


# -- the four policies --------------------------------------------------------------------------


def test_round_robin_cycles_over_healthy_replicas_every_turn():
    cfg, pins = config("round_robin"), Pins()
    replicas = fleet(0, 0, 0, down=(1,))
    chosen = [play(cfg, pins, replicas, first(f"s{i}")).replica for i in range(4)]
    assert chosen == ["r0", "r2", "r0", "r2"]
    moved = play(cfg, pins, replicas, later("s0"))  # turn counter 4 → r0, s0 was on r0: no move
    assert moved.replica == "r0" and moved.migrated_from is None
    moved = play(cfg, pins, replicas, later("s0"))
    assert moved.replica == "r2" and moved.migrated_from == "r0" and moved.lost_tokens == 300


def test_least_loaded_follows_load_each_turn_and_breaks_ties_by_pressure_then_order():
    cfg, pins = config("least_loaded"), Pins()
    assert play(cfg, pins, fleet(3, 1, 2), first("s")).replica == "r1"
    assert play(cfg, pins, fleet(0, 5, 2), later("s")).migrated_from == "r1"
    tied = [ReplicaState("a", load=1, kv_usage=0.5), ReplicaState("b", load=1, kv_usage=0.2),
            ReplicaState("c", load=1, kv_usage=0.2)]
    assert least_loaded(tied).name == "b"


def test_session_hash_is_stable_and_ignores_load():
    cfg, pins = config("session_hash"), Pins()
    a = play(cfg, pins, fleet(0, 0, 0, 0), first("session-42")).replica
    assert play(cfg, pins, fleet(*[100 if f"r{i}" == a else 0 for i in range(4)]), later("session-42")).replica == a
    assert route(cfg, Pins(), fleet(9, 9, 9, 9), first("session-42")).replica == a


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=60, unique=True),
       st.integers(min_value=2, max_value=8), st.data())
def test_consistent_hashing_moves_only_the_removed_replicas_sessions(sessions, n, data):
    names = [f"r{i}" for i in range(n)]
    gone = data.draw(st.sampled_from(names))
    before = {s: ring_choice(names, s) for s in sessions}
    after = {s: ring_choice([x for x in names if x != gone], s) for s in sessions}
    for s in sessions:
        assert after[s] != gone
        if before[s] != gone:
            assert after[s] == before[s]


def test_sticky_pins_to_least_loaded_and_stays_under_moderate_imbalance():
    cfg, pins = config("sticky_least_loaded", overload_factor=2.0, overload_slack=4), Pins()
    assert play(cfg, pins, fleet(2, 0, 1), first("s")).replica == "r1"
    stay = play(cfg, pins, fleet(0, 4, 0), later("s"))  # 4 ≤ 2·0 + 4
    assert (stay.replica, stay.reason, stay.migrated_from) == ("r1", "sticky", None)


def test_sticky_migrates_when_overloaded_and_records_the_cache_it_gives_up():
    cfg, pins = config("sticky_least_loaded", overload_factor=2.0, overload_slack=4), Pins()
    play(cfg, pins, fleet(2, 0, 1), first("s"))
    moved = play(cfg, pins, fleet(1, 7, 0), later("s", context=640))  # 7 > 2·0 + 4
    assert (moved.replica, moved.reason, moved.migrated_from, moved.lost_tokens) == (
        "r2", "migrate:overload", "r1", 640)
    assert pins.sessions["s"] == "r2"
    assert play(cfg, pins, fleet(1, 0, 3), later("s")).replica == "r2"  # sticky again at its new home


@pytest.mark.parametrize("policy", ["sticky_least_loaded", "session_hash"])
def test_a_dead_replicas_sessions_migrate_with_their_loss(policy):
    cfg, pins = config(policy), Pins()
    home = play(cfg, pins, fleet(0, 0, 0), first("s")).replica
    dead = int(home[1:])
    moved = play(cfg, pins, fleet(0, 0, 0, down=(dead,)), later("s", context=512))
    assert moved.replica != home and moved.migrated_from == home and moved.lost_tokens == 512
    assert moved.reason == "migrate:replica down"


def test_no_healthy_replica_is_an_engine_error():
    with pytest.raises(EngineError):
        route(config("least_loaded"), Pins(), fleet(0, 0, down=(0, 1)), first("s"))


# -- group co-routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "session_hash", "sticky_least_loaded"])
def test_group_members_start_where_their_group_started(policy):
    cfg, pins = config(policy + "+group"), Pins()
    home = play(cfg, pins, fleet(0, 0, 0), first("g-r0", "g")).replica
    assert pins.groups["g"] == home
    for i in range(1, 8):  # load elsewhere is lower, but the shared prompt is cached at home
        loads = [2 if f"r{j}" == home else 0 for j in range(3)]
        decision = play(cfg, pins, fleet(*loads), first(f"g-r{i}", "g"))
        assert (decision.replica, decision.reason) == (home, "group")


def test_without_group_flag_members_spread_by_load():
    cfg, pins = config("sticky_least_loaded"), Pins()
    homes = {play(cfg, pins, fleet(*[1 if j == i else 0 for j in range(3)]), first(f"g-r{i}", "g")).replica
             for i in range(3)}
    assert len(homes) > 1 and not pins.groups


def test_an_overloaded_group_home_places_the_next_member_afresh():
    cfg, pins = config("sticky_least_loaded+group", overload_factor=2.0, overload_slack=4), Pins()
    play(cfg, pins, fleet(0, 0), first("a", "g"))
    decision = play(cfg, pins, fleet(9, 0), first("b", "g"))
    assert decision.replica == "r1" and decision.pin_group and pins.groups["g"] == "r1"


def test_groups_of_a_dead_replica_are_forgotten():
    cfg, pins = config("sticky_least_loaded+group"), Pins()
    play(cfg, pins, fleet(0, 0), first("a", "g"))
    pins.forget("r0")
    assert "g" not in pins.groups
    assert play(cfg, pins, fleet(0, 0, down=(0,)), first("b", "g")).replica == "r1"


# -- admission ------------------------------------------------------------------------------------


FULL = ReplicaState("r0", kv_usage=0.95, capacity_tokens=1000)
PROJECTED_FULL = ReplicaState("r0", kv_usage=0.1, live_tokens=950, capacity_tokens=1000)
ROOMY = ReplicaState("r0", kv_usage=0.5, live_tokens=200, capacity_tokens=1000)
NEWCOMER_TOO_BIG = ReplicaState("r0", kv_usage=0.2, live_tokens=600, capacity_tokens=1000)


@pytest.mark.parametrize(("replica", "new", "others_live", "enabled", "admitted"), [
    (NEWCOMER_TOO_BIG, True, True, True, False),  # 600 live + 300 new reaches 0.9
    (FULL, True, True, True, False),             # a new rollout waits for room
    (PROJECTED_FULL, True, True, True, False),   # live sessions' contexts count even between their turns
    (FULL, False, True, True, True),             # the next turn of a live rollout is never held
    (FULL, True, False, True, True),             # nothing else is live: waiting would never end
    (FULL, True, True, False, True),             # admission off
    (ROOMY, True, True, True, True),
])
def test_admission_holds_only_new_rollouts_above_high_water(replica, new, others_live, enabled, admitted):
    cfg = RouteConfig(high_water=0.9, admission=enabled)
    request = RouteRequest("s", new_session=new, context_tokens=300)
    assert admit(cfg, replica, request, others_live=others_live) is admitted


def test_pressure_is_the_larger_of_measured_and_projected_usage():
    assert FULL.pressure == 0.95 and PROJECTED_FULL.pressure == 0.95 and ROOMY.pressure == 0.5
    assert ReplicaState("x", kv_usage=0.3, live_tokens=10_000).pressure == 0.3  # unknown capacity
    assert ROOMY.pressure_with(400) == 0.6 and ROOMY.pressure_with(0) == 0.5


def test_a_newcomer_whose_group_is_live_adds_only_what_it_does_not_share():
    cfg = RouteConfig(high_water=0.9)
    # 600 live tokens, 500 of them the prompt of group g: a member of g with 300 tokens (256 shared) adds 44
    replica = ReplicaState("r0", kv_usage=0.2, live_tokens=600, capacity_tokens=1000, live_groups={"g": 500})
    member = RouteRequest("s", "g", context_tokens=300, shared_tokens=256)
    stranger = RouteRequest("t", "h", context_tokens=300, shared_tokens=256)
    assert replica.newcomer_tokens(member) == 44 and replica.newcomer_tokens(stranger) == 300
    assert admit(cfg, replica, member, others_live=True) and not admit(cfg, replica, stranger, others_live=True)
    # only what the group holds here counts: a resident share shorter than the newcomer's limits the saving
    short = ReplicaState("r0", live_tokens=600, capacity_tokens=1000, live_groups={"g": 64})
    assert short.newcomer_tokens(member) == 236


def test_residency_counts_a_group_prompt_once_and_forgets_what_leaves():
    live = Residency()
    live.set("a", 300, "g", 256)
    live.set("b", 280, "g", 256)
    live.set("c", 100)
    assert live.tokens == 300 + 280 - 256 + 100 and live.shared == {"g": 256} and len(live) == 3
    live.set("a", 500)  # a later turn: the context grows, the group share stays
    assert live.tokens == 500 + 280 - 256 + 100
    live.set("d", 300, "g", 128)  # shares less with the group: the group's resident share is the least
    assert live.shared == {"g": 128} and live.tokens == 500 + 280 + 300 + 100 - 2 * 128
    live.drop("d")
    live.drop("a")
    assert live.tokens == 280 + 100 and live.shared == {"g": 256}
    live.drop("b")
    live.drop("c")
    live.drop("never-here")
    assert live.tokens == 0 and live.shared == {} and len(live) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 2), st.integers(0, 400),
                          st.integers(0, 400)), max_size=60))
def test_residency_matches_a_count_from_scratch(ops):
    """After any sequence of joins, growths and departures the tally equals a recount of the live sessions."""
    live, members = Residency(), {}
    for leave, session, group, context, shared in ops:
        sid = f"s{session}"
        if leave:
            live.drop(sid)
            members.pop(sid, None)
            continue
        gid = f"g{group}" if group else None
        if sid in members:  # a later turn: same group and share, a context that only grows
            gid, share, before = members[sid]
            context = before + context
        else:
            share = min(shared, context)
        members[sid] = (gid, share, context)
        live.set(sid, context, gid, shared)
    total = sum(context for _, _, context in members.values())
    groups: dict[str, list[int]] = {}
    for gid, share, _ in members.values():
        if gid is not None:
            groups.setdefault(gid, []).append(share)
    saved = sum((len(shares) - 1) * min(shares) for shares in groups.values())
    assert live.tokens == total - saved and live.shared == {g: min(v) for g, v in groups.items()}
    assert 0 <= live.tokens <= total


# -- invariants over random traffic ------------------------------------------------------------------------

POLICIES = [a + b for a, b in itertools.product(
    ["round_robin", "least_loaded", "session_hash", "sticky_least_loaded"], ["", "+group"])]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(POLICIES),
       st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 12), min_size=4, max_size=4),
                          st.sets(st.integers(0, 3), max_size=3)), min_size=1, max_size=40))
def test_decisions_are_healthy_and_moves_are_always_recorded(policy, steps):
    cfg, pins = config(policy), Pins()
    for session, loads, down in steps:
        replicas = fleet(*loads, down=tuple(down))
        sid = f"s{session}"
        previous = pins.sessions.get(sid)
        request = RouteRequest(sid, f"g{session % 3}", new_session=previous is None, context_tokens=50)
        decision = play(cfg, pins, replicas, request)
        assert decision.replica in {r.name for r in replicas if r.healthy}
        if previous is not None:
            moved = decision.replica != previous
            assert moved == (decision.migrated_from == previous)
            assert decision.lost_tokens == (50 if moved else 0)
            if cfg.policy is RoutePolicy.STICKY_LEAST_LOADED and moved:
                assert decision.reason.startswith("migrate:")


class _Replica:
    """A replica stand-in for the router's own bookkeeping (its stats take a moment, like a real poll)."""

    block_size = 16
    version = 0

    async def stats(self):
        from verbatim.engine.protocol import EngineStats

        await asyncio.sleep(0.02)
        return EngineStats(capacity_tokens=100_000)

    async def generate(self, prompt_ids, sampling=None, **route):
        from verbatim.datamodel import Completion

        await asyncio.sleep(0.05)
        return Completion(token_ids=np.array([1]), logprobs=np.array([-0.1]), versions=np.array([0]),
                          finish_reason="stop", prompt_tokens=len(prompt_ids), cached_tokens=0)


@pytest.mark.parametrize("route", ["sticky_least_loaded+group", "sticky_least_loaded", "least_loaded"])
def test_two_first_requests_at_once_go_to_different_idle_replicas(route):
    """Each new rollout polls its replica before it is placed; the decision is made again after the poll, so
    the second of two simultaneous first requests sees the first one placed (both used to land on r0)."""
    from verbatim.engine.router import Router

    async def go():
        router = Router([_Replica(), _Replica()], RouteConfig.parse(route))
        first = [router.generate(np.arange(40) + k, session_id=f"s{k}", group_id=f"g{k}") for k in range(2)]
        return [c.replica for c in await asyncio.gather(*first)]

    assert sorted(asyncio.run(go())) == ["r0", "r1"]
