"""The prefix-cache arithmetic (verbatim.prefix_cache): exact small cases, and properties against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.datamodel import Turn
from verbatim.prefix_cache import (
    cacheable_blocks,
    chain_hashes,
    common_prefix,
    computed_tokens,
    full_blocks,
    group_prefilled_once,
    group_reusable,
    min_prefill,
    reusable_prefix,
    reusable_tokens,
    shared_prefix,
    token_block_hashes,
    whole_blocks,
)
from verbatim.sim.block_cache import BlockCache

tokens = st.lists(st.integers(0, 2), max_size=40)
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=40)
block_sizes = st.integers(1, 9)


# ---------------------------------------------------------------------------
# Exact cases
# ---------------------------------------------------------------------------


def test_whole_blocks_and_the_last_prompt_token():
    assert (full_blocks(47, 16), whole_blocks(47, 16), whole_blocks(48, 16), whole_blocks(-3, 16)) == (2, 32, 48, 0)
    assert cacheable_blocks(65, 16) == 4 and cacheable_blocks(64, 16) == 3  # 64 tokens: the 4th block holds the last
    assert cacheable_blocks(1, 16) == 0 and cacheable_blocks(0, 16) == 0


def test_what_a_request_computed():
    assert computed_tokens(40, 10) == 49  # the last sampled token is returned, never fed back
    assert computed_tokens(40, 0) == 40


@pytest.mark.parametrize("known,prompt,block,expected", [
    (49, 57, 16, 48), (49, 57, 32, 32), (49, 57, 128, 0), (100, 49, 16, 48), (100, 48, 16, 32), (0, 10, 4, 0),
])
def test_reusable_tokens(known, prompt, block, expected):
    assert reusable_tokens(known, prompt, block) == expected


def test_reusable_prefix_of_consecutive_turns():
    previous = Turn(index=0, prompt_end=40, completion_end=50)
    assert reusable_prefix(previous, Turn(index=1, prompt_end=57, completion_end=60), 16) == 48
    assert reusable_prefix(previous, Turn(index=1, prompt_end=57, completion_end=60), 32) == 32


def test_shared_and_common_prefixes():
    a, b, c = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 9, 4]), np.array([1, 7])
    assert shared_prefix(a, b) == 2 and shared_prefix(a, a) == 5 and shared_prefix(a, a[:0]) == 0
    assert common_prefix([a, b, c]) == 1 and common_prefix([a]) == 5 and common_prefix([a, a[:3]]) == 3


def test_the_group_rule():
    prompt = np.arange(40)
    assert group_reusable(prompt, [prompt.copy()], 16) == 32  # 39 cacheable tokens: 2 whole blocks
    assert group_reusable(prompt, [np.arange(20)], 16) == 16
    assert group_reusable(prompt, [], 16) == 0
    assert group_prefilled_once(0) and group_prefilled_once(1) and not group_prefilled_once(2)


def test_min_prefill_counts_a_group_prompt_once():
    prompt = list(range(100))
    assert min_prefill([(prompt, [5, 6]), (prompt, [7])]) == 100 + 1  # the second request: its last token only
    assert min_prefill([(prompt, [5, 6]), (prompt + [5, 6, 8], [])]) == 100 + 2  # 6 was never computed


def test_hash_chain_names_prefixes():
    assert chain_hashes([1, 2, 3])[:2] == chain_hashes([1, 2, 9])[:2]
    assert chain_hashes([1, 2, 3])[2] != chain_hashes([1, 2, 9])[2]
    assert chain_hashes([1, 2]) != chain_hashes([1, 2], salt=7)
    assert len(token_block_hashes(np.arange(47), 16)) == 2


# ---------------------------------------------------------------------------
# Properties against brute force
# ---------------------------------------------------------------------------


@given(a=tokens, b=tokens)
def test_shared_prefix_is_the_naive_loop(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert shared_prefix(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == n == shared_prefix(a, b)


@given(sequences=st.lists(tokens, min_size=1, max_size=5))
def test_common_prefix_is_the_longest_prefix_all_share(sequences):
    n = max(k for k in range(len(sequences[0]) + 1) if all(s[:k] == sequences[0][:k] for s in sequences))
    assert common_prefix(sequences) == n


@given(known=st.integers(-5, 60), prompt=st.integers(0, 60), block=block_sizes)
def test_reusable_tokens_is_the_naive_block_count(known, prompt, block):
    served = 0
    while served + block <= known and served + block <= prompt - 1:  # a whole block, never the last prompt token
        served += block
    assert reusable_tokens(known, prompt, block) == served
    assert cacheable_blocks(prompt, block) * block == reusable_tokens(prompt, prompt, block)


@given(prompt=st.integers(1, 50), sampled=st.integers(0, 20), observation=st.integers(0, 20), block=block_sizes)
def test_reusable_prefix_is_what_turn_k_minus_1_computed_in_whole_blocks(prompt, sampled, observation, block):
    sequence = list(range(prompt + sampled + observation))
    computed = sequence[: prompt + sampled - 1] if sampled else sequence[:prompt]  # brute force: the KV that exists
    turn_prompt = sequence[: prompt + sampled + observation]
    best = max(k for k in range(0, len(turn_prompt), block) if k <= len(computed))  # k < prompt: never the last
    previous = Turn(index=0, prompt_end=prompt, completion_end=prompt + sampled)
    turn = Turn(index=1, prompt_end=len(turn_prompt), completion_end=len(turn_prompt))
    assert reusable_prefix(previous, turn, block) == best


@given(prompt=prompts, others=st.lists(prompts, max_size=4), block=block_sizes)
def test_group_reusable_is_the_best_other_member_in_whole_blocks(prompt, others, block):
    best = 0
    for other in others:
        k = 0
        while k + block <= len(prompt) - 1 and prompt[:k + block] == other[:k + block]:
            k += block
        best = max(best, k)
    assert group_reusable(np.array(prompt), [np.array(o) for o in others], block) == best


def engine_prefill(requests, block: int) -> int:
    """What an engine with a never-evicting block cache prefills: per request, the prompt less its leading
    whole blocks that an earlier request computed (at most prompt − 1 tokens)."""
    cached_blocks: set[tuple[int, ...]] = set()
    total = 0
    for prompt, completion in requests:
        hit = 0
        while hit < cacheable_blocks(len(prompt), block) and tuple(prompt[:(hit + 1) * block]) in cached_blocks:
            hit += 1
        total += len(prompt) - hit * block
        sequence = list(prompt) + list(completion)
        computed = computed_tokens(len(prompt), len(completion))
        cached_blocks.update(tuple(sequence[:(i + 1) * block]) for i in range(full_blocks(computed, block)))
    return total


requests = st.lists(st.tuples(prompts, st.lists(st.integers(0, 2), max_size=6)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(pairs=requests, block=block_sizes)
def test_min_prefill_is_a_lower_bound_on_any_block_cache(pairs, block):
    assert min_prefill(pairs) <= engine_prefill(pairs, block)


@settings(max_examples=300, deadline=None)
@given(pairs=requests)
def test_min_prefill_is_reached_with_one_token_blocks(pairs):
    assert min_prefill(pairs) == engine_prefill(pairs, 1)


@given(a=tokens, b=tokens, block=block_sizes, salt=st.integers(0, 3))
def test_equal_hashes_block_by_block_iff_equal_prefixes(a, b, block, salt):
    ha, hb = token_block_hashes(np.array(a), block, salt), token_block_hashes(np.array(b), block, salt)
    assert len(ha) == full_blocks(len(a), block)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[:(i + 1) * block] == b[:(i + 1) * block])
    if ha:
        assert token_block_hashes(np.array(a), block, salt + 1)[0] != ha[0]


@given(first=prompts, second=prompts, block=block_sizes)
def test_the_block_pool_serves_exactly_the_reusable_prefix(first, second, block):
    """sim/block_cache.py's stateful pool and the pure rules agree: after ``first``'s prompt blocks are
    registered, ``second`` hits the whole blocks it shares with them, never its last token."""
    cache = BlockCache(capacity=64, block_size=block)
    hashes = token_block_hashes(np.array(first), block)
    prompt_blocks = full_blocks(len(first), block)
    assert cache.allocate(hashes, 0, prompt_blocks, prompt_blocks) is not None
    known = min(shared_prefix(first, second), whole_blocks(len(first), block))
    hit = cache.hit_blocks(token_block_hashes(np.array(second), block), len(second))
    assert hit * block == reusable_tokens(known, len(second), block)
