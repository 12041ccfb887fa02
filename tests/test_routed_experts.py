"""Routed experts, the pure parts: the engine-side store (computed tokens, cached prefixes, preemption), the
ledger's per-rollout column, and the trace formats carrying it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.datamodel import NO_EXPERT, Completion, Rollout, TokenColumns
from verbatim.engine.expert_capture import ExpertStore, adapter_version, pack, rows_by_request, unpack
from verbatim.errors import LedgerError
from verbatim.harness.ledger import Ledger
from verbatim.harness.tracefile import from_json_line, from_table, to_json_line, to_table

LAYERS, K, BLOCK = 3, 2, 4


def experts_of(positions: np.ndarray, seed: int = 0) -> np.ndarray:
    """A deterministic stand-in for what a router picks at each position of one sequence."""
    base = (positions[:, None, None] * 7 + np.arange(LAYERS)[None, :, None] * 3 + np.arange(K) + seed) % 60
    return base.astype(np.int16)


@settings(max_examples=80, deadline=None)
@given(length=st.integers(1, 40), cached_blocks=st.integers(0, 9), chunk=st.integers(1, 16))
def test_a_request_reading_a_cached_prefix_gets_the_experts_its_writer_computed(length, cached_blocks, chunk):
    store = ExpertStore(blocks=32, block_size=BLOCK, layers=LAYERS, k=K, version=3)
    table = list(range(20, 32))  # the blocks both requests' prefix sits in
    writer = experts_of(np.arange(length))
    for start in range(0, length, chunk):  # prefilled in chunks, then decoded one by one
        store.computed("a-12345678", table, start, writer[start:start + chunk])
    experts, versions = store.take("a")
    assert np.array_equal(experts, writer) and (versions == 3).all()
    store.version = 4  # a weight update (keep): the reader computes under the new weights, reads the old KV
    cached = min(cached_blocks * BLOCK, (length // BLOCK) * BLOCK)
    own = experts_of(np.arange(cached, length + 5), seed=1)  # what the reader computes itself
    store.computed("b-abcdefgh", table, cached, own)
    got, versions = store.take("b")
    assert np.array_equal(got[:cached], writer[:cached]) and (versions[:cached] == 3).all()
    assert np.array_equal(got[cached:], own) and (versions[cached:] == 4).all()
    assert store.take("b") is None
    store.computed("c-abcdefgh", table, 0, own[:2], version=9)  # a LoRA request: its adapter's version
    assert store.take("c")[1].tolist() == [9, 9]


def test_a_preempted_request_that_recomputes_keeps_the_new_experts():
    store = ExpertStore(blocks=8, block_size=BLOCK, layers=LAYERS, k=K)
    first = experts_of(np.arange(10))
    store.computed("r-00000000", [1, 2, 3], 0, first)
    again = experts_of(np.arange(4, 12), seed=5)  # resumed from position 4 (its first block still cached)
    store.computed("r-00000000", [1, 2, 3], 4, again)
    got, _ = store.take("r")
    assert np.array_equal(got[:4], first[:4]) and np.array_equal(got[4:], again)


def test_finished_requests_wait_to_be_taken_and_ids_match_exactly():
    store = ExpertStore(blocks=8, block_size=BLOCK, layers=LAYERS, k=K)
    store.computed("s-1-00000000", [1], 0, experts_of(np.arange(3)))
    store.computed("s-10-00000000", [2], 0, experts_of(np.arange(2)))
    store.finish(["s-1-00000000"])
    assert len(store.take("s-1")[0]) == 3  # not s-10's
    assert len(store.take("s-10")[0]) == 2
    assert store.take("s-1") is None


def test_rows_are_split_by_request_with_their_first_positions():
    positions = np.array([5, 6, 7, 0, 1, 40])
    assert rows_by_request(positions, [3, 2, 1]) == [(0, 3, 5), (3, 5, 0), (5, 6, 40)]


def test_experts_cross_the_rpc_unchanged():
    experts, versions = experts_of(np.arange(7)), np.arange(7, dtype=np.int32)
    back = unpack(pack((experts, versions)))
    assert np.array_equal(back[0], experts) and np.array_equal(back[1], versions) and unpack(pack(None)) is None
    assert adapter_version("verbatim-v12.3") == 12 and adapter_version(None) is None
    assert adapter_version("my-adapter") is None


def completion(ledger: Ledger, sampled: int, experts: np.ndarray | None, version: int = 0) -> Completion:
    return Completion(token_ids=np.arange(sampled) + 100, logprobs=np.full(sampled, -1.0), versions=np.zeros(sampled),
                      finish_reason="stop", prompt_tokens=len(ledger) - ledger.segment_start, cached_tokens=0,
                      routed_experts=experts,
                      experts_version=None if experts is None else np.full(len(experts), version))


def test_the_ledger_keeps_each_segments_newest_experts_and_marks_tokens_never_fed():
    ledger = Ledger()
    ledger.append_prompt(np.arange(6))
    first = experts_of(np.arange(6 + 4 - 1))
    ledger.append_completion(completion(ledger, 4, first))
    ledger.append_observation([7, 8, 9])
    second = experts_of(np.arange(13 + 3 - 1), seed=2)  # recomputed the history: it wins
    ledger.append_completion(completion(ledger, 3, second, version=1))
    experts = ledger.columns().routed_experts
    assert experts.shape == (16, LAYERS, K)
    assert np.array_equal(experts[:15], second)
    assert (experts[15] == NO_EXPERT).all()  # the last sampled token: never fed
    assert ledger.columns().experts_version.tolist() == [1] * 15 + [-1]
    start = ledger.start_segment([3, 3, 3])
    ledger.append_completion(completion(ledger, 2, experts_of(np.arange(4), seed=9)))
    ledger.append_observation([1, 2])  # never fed
    rollout = ledger.to_rollout(run_id="r", group_id="g", rollout_id="x")
    first_part, later = (piece.tokens.routed_experts for piece in rollout.segments())
    assert start == 16 and np.array_equal(first_part, experts)
    assert np.array_equal(later[:4], experts_of(np.arange(4), seed=9)) and (later[4:] == NO_EXPERT).all()


def test_the_ledger_refuses_experts_for_more_tokens_than_the_request_had():
    ledger = Ledger()
    ledger.append_prompt(np.arange(3))
    with pytest.raises(LedgerError, match="routed experts cover 9 tokens"):
        ledger.append_completion(completion(ledger, 2, experts_of(np.arange(9))))


def test_a_rollout_without_experts_has_none():
    ledger = Ledger()
    ledger.append_prompt(np.arange(3))
    ledger.append_completion(completion(ledger, 2, None))
    assert ledger.columns().routed_experts is None


def traced(with_experts: bool) -> Rollout:
    ledger = Ledger()
    ledger.append_prompt(np.arange(5))
    ledger.append_completion(completion(ledger, 3, experts_of(np.arange(7)) if with_experts else None))
    return ledger.to_rollout(run_id="r", group_id="g", rollout_id="x" if with_experts else "y")


def test_parquet_and_json_lines_carry_the_experts_exactly():
    rollouts = [traced(True), traced(False)]
    for back in (from_table(to_table(rollouts)), [from_json_line(to_json_line(r)) for r in rollouts]):
        assert all(a.same_as(b) for a, b in zip(rollouts, back))
        assert back[0].tokens.routed_experts.shape == (8, LAYERS, K) and back[1].tokens.routed_experts is None


def test_columns_with_experts_of_another_length_are_refused():
    with pytest.raises(ValueError, match="not aligned"):
        TokenColumns(token_id=[1, 2], source=[0, 2], logprob=[0, 0], policy_version=[0, 0], turn=[0, 0],
                     routed_experts=np.zeros((3, LAYERS, K)))


def test_lint_flags_tokens_without_experts_in_a_run_that_recorded_them():
    from verbatim.lint.findings import CacheSettings, recorded_routing
    from verbatim.lint.trace import lint_rollout

    recorded = CacheSettings(block_size=32, routing=True)
    assert not [p for p in lint_rollout(traced(True), recorded) if p.kind == "routing"]
    assert [p.detail for p in lint_rollout(traced(False), recorded) if p.kind == "routing"] == \
        ["the run recorded routed experts, but this sequence has none"]
    assert not [p for p in lint_rollout(traced(False), CacheSettings(block_size=32)) if p.kind == "routing"]
    holed = traced(True)
    experts = holed.tokens.routed_experts.copy()
    experts[2:4] = NO_EXPERT
    holed = holed.model_copy(update={"tokens": TokenColumns(**holed.tokens.as_dict(), routed_experts=experts,
                                                            experts_version=holed.tokens.experts_version)})
    problems = [p for p in lint_rollout(holed, CacheSettings(block_size=32)) if p.kind == "routing"]
    assert [p.detail for p in problems] == ["2 token(s) without routed experts before the last sampled one, the "
                                            "first at token 2"]
    assert recorded_routing({"train": {"engine": {"record_routing": False}, "learner": {"routing_replay": True}}})
    assert not recorded_routing({"run": {"engine": {"record_routing": False}}})


def test_lint_checks_the_version_each_tokens_experts_were_recorded_under():
    from verbatim.lint.findings import CacheSettings
    from verbatim.lint.trace import lint_rollout

    ledger = Ledger()
    ledger.append_prompt(np.arange(6))
    ledger.append_completion(completion(ledger, 4, experts_of(np.arange(9)), version=2))
    ledger.append_observation([7, 8, 9])
    read = Completion(token_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[3, 3], finish_reason="stop",
                      prompt_tokens=13, cached_tokens=8, kv_versions=(2,), routed_experts=experts_of(np.arange(14)),
                      experts_version=[2] * 8 + [3] * 6)
    ledger.append_completion(read)
    good = ledger.to_rollout(run_id="r", group_id="g", rollout_id="x")
    assert not [p for p in lint_rollout(good, CacheSettings(block_size=4)) if p.kind.startswith("routing")]
    tokens = good.tokens
    for wrong, says in ((0, "cached prompt tokens were recorded under version(s) [1]"),
                        (10, "prompt tokens it computed were recorded under version(s) [1]")):
        versions = tokens.experts_version.copy()
        versions[wrong] = 1
        bad = good.model_copy(update={"tokens": TokenColumns(**tokens.as_dict(), routed_experts=tokens.routed_experts,
                                                             experts_version=versions)})
        found = [p.detail for p in lint_rollout(bad, CacheSettings(block_size=4)) if p.kind == "routing_version"]
        assert len(found) == 1 and says in found[0], found


def test_the_trainer_exports_carry_the_experts_of_every_exported_token():
    from verbatim.harness.export import TABLE_BUILDERS

    with_experts, without = traced(True), traced(False)
    for fmt, build in TABLE_BUILDERS.items():
        table = build([with_experts, without])
        flat, shapes = table.column("routed_experts").to_pylist(), table.column("experts_shape").to_pylist()
        assert shapes == [[LAYERS, K], []], fmt
        want = with_experts.tokens.routed_experts[:8].reshape(-1).tolist()  # prompt 5 + 3 sampled: all exported
        assert flat == [want, []], fmt
        assert "routed_experts" not in build([without]).column_names  # a dense run's exports are unchanged
