"""Which versions computed the reused KV: the per-block bookkeeping, without an engine."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from verbatim.engine.kv_provenance import BlockWrite, KvProvenance, computed_blocks
from verbatim.prefix_cache import token_block_keys

B = 4


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, size=n).tolist()


def write(kv: KvProvenance, prompt: list[int], versions: list[int], cached: int = 0, writer: str = "w",
          salt: str | None = None) -> list[int]:
    """Record a finished request; return its whole token sequence."""
    out = tokens(sum(writer.encode()), len(versions))
    kv.record(salt, prompt + out, writer, computed_blocks(len(prompt), cached, versions, B))
    return prompt + out


def test_block_keys_chain_over_every_earlier_token():
    a, b = tokens(1, 12), tokens(1, 12)
    b[1] += 1
    assert len(token_block_keys(a, B)) == 3 and token_block_keys(a, B, 2) == token_block_keys(a, B)[:2]
    assert token_block_keys(a[:11], B) == token_block_keys(a, B)[:2]  # only full blocks
    assert all(x != y for x, y in zip(token_block_keys(a, B), token_block_keys(b, B)))  # a change upstream changes all


def test_computed_blocks_prefill_with_the_first_version_and_each_token_with_the_next_one():
    # prompt 8 (cached 4), 7 tokens: token i's KV is computed when token i+1 is sampled, the last never
    writes = computed_blocks(8, 4, [0, 0, 0, 1, 1, 2, 2], B)
    assert [(w.index, set(w.versions)) for w in writes] == [(1, {0}), (2, {0, 1})]  # positions 12, 13 of 16
    assert [w.vllm_missed for w in writes] == [False, False]  # block 1 holds the last prompt token
    assert [set(w.versions) for w in computed_blocks(8, 4, [0, 0, 0, 1, 1, 1, 2, 2, 2], B)][-1] == {1, 2}
    assert computed_blocks(8, 0, [], B) == []


def test_only_a_block_vllm_looked_up_counts_as_missed():
    # an 8-token prompt all cached but its last block: vLLM never looks up the block with the last token
    assert not computed_blocks(8, 4, [3], B)[0].vllm_missed
    assert computed_blocks(9, 4, [3], B)[0].vllm_missed


def test_a_flush_recomputes_everything_before_the_first_token_after_it():
    writes = computed_blocks(6, 4, [0, 0, 5, 5, 5], B, recomputed_before=2)
    assert [(w.index, set(w.versions), w.vllm_missed) for w in writes] == [(0, {5}, False), (1, {5}, False)]


def test_a_read_names_only_the_versions_of_the_blocks_it_reused():
    kv = KvProvenance(B)
    shared = tokens(7, 12)
    write(kv, shared, [0, 0], writer="a")                    # version 0 computes the shared prompt
    kv.serve(1)
    write(kv, tokens(8, 12), [1, 1], writer="b")             # version 1 writes another prefix, same salt
    kv.serve(2)
    assert kv.reused(None, shared + tokens(9, 5), 12) == {0}
    assert kv.reused(None, shared, 0) == frozenset()
    assert kv.reused("other", shared, 12) is None             # salts never share records


def test_reads_of_generated_blocks_follow_the_tokens_versions():
    kv = KvProvenance(B)
    history = write(kv, tokens(3, 4), [0, 0, 0, 0, 0, 1, 1, 1, 1], writer="turn1")
    assert kv.reused(None, history, 8) == {0}
    assert kv.reused(None, history, 12) == {0, 1}


def test_a_second_copy_keeps_both_versions_until_vllm_shows_the_old_one_gone():
    kv = KvProvenance(B)
    prompt = tokens(4, 8)
    write(kv, prompt, [0], writer="first")
    kv.serve(1)
    # all cached: vLLM recomputes the last block beside a copy that may still live; a read may get either
    kv.record(None, prompt, "again", computed_blocks(8, 4, [1], B))
    assert kv.reused(None, prompt + [1], 8) == {0, 1}
    # a prompt that missed at block 1 proves no copy of it was left: the stale records go
    kv.serve(2)
    kv.record(None, prompt + [5], "after-eviction", computed_blocks(9, 4, [2], B))
    assert kv.reused(None, prompt + [5], 8) == {0, 2}


def test_recording_again_replaces_the_writers_own_copy():
    kv = KvProvenance(B)
    prompt = tokens(5, 8)
    kv.record(None, prompt, "r", [BlockWrite(0, frozenset({0}), True)])
    kv.record(None, prompt, "other", [BlockWrite(0, frozenset({1}), False)])
    kv.record(None, prompt, "r", [BlockWrite(0, frozenset({0}), True)])
    assert kv.reused(None, prompt, 4) == {0, 1}


def test_a_flush_forgets_every_record_and_starts_a_new_epoch():
    kv = KvProvenance(B)
    prompt = tokens(6, 8)
    write(kv, prompt, [0])
    kv.serve(1)
    kv.flush(2)
    assert kv.reused(None, prompt, 8) is None
    assert kv.epoch == 1 and kv.flushed_at == 2
    assert kv.served(0) == {0, 1} and kv.served(1) == {2}


def test_the_oldest_records_go_past_the_limit_and_reads_touch_theirs():
    kv = KvProvenance(B, limit_blocks=2)
    old, new = tokens(10, 4), tokens(11, 4)
    write(kv, old, [0], writer="old")
    write(kv, new, [0], writer="new")
    assert kv.reused(None, old, 4) == {0}
    write(kv, tokens(12, 4), [0], writer="newest")
    assert kv.reused(None, new, 4) is None and kv.reused(None, old, 4) == {0}


@given(st.integers(1, 20), st.integers(0, 20), st.lists(st.integers(0, 3), min_size=1, max_size=20))
def test_computed_blocks_cover_exactly_the_full_blocks_after_the_cached_ones(prompt_len, cached, versions):
    cached = min(cached, prompt_len - 1) // B * B
    versions = sorted(versions)
    writes = computed_blocks(prompt_len, cached, versions, B)
    assert [w.index for w in writes] == list(range(cached // B, (prompt_len + len(versions) - 1) // B))
    assert all(w.versions and w.versions <= set(versions) for w in writes)
    assert sum(w.vllm_missed for w in writes) <= 1


def test_finish_reads_before_it_records_and_falls_back_when_it_cannot_know():
    kv = KvProvenance(B)
    prompt = tokens(13, 9)
    first = np.array(tokens(14, 4))
    assert kv.finish(None, prompt, first, np.zeros(4), 0, "a", kv.epoch) == ()
    kv.serve(1)
    history = prompt + first.tolist()
    assert kv.finish(None, history, np.array([1, 2]), np.ones(2), 12, "b", kv.epoch) == (0,)
    assert kv.finish(None, history + [1], np.array([3]), np.ones(1), 12, "c", kv.epoch) == (0,)
    assert kv.finish(None, history, np.array([3]), np.ones(1), 6, "d", kv.epoch) == (0, 1)  # off the block grid
    epoch = kv.epoch
    kv.flush(2)
    assert kv.finish(None, history, np.array([3]), np.full(1, 1), 8, "e", epoch) == (0, 1)  # flushed meanwhile
    assert kv.reused(None, history, 4) is None  # and it recorded nothing
