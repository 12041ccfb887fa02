"""Run accounting: distinct-prefix counting (the minimum prefill) against brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from verbatim.harness.summary import distinct_prefix_tokens

sequences = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=8)


@settings(max_examples=300, deadline=None)
@given(seqs=sequences)
def test_distinct_prefixes_equal_brute_force(seqs):
    brute = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert distinct_prefix_tokens(seqs) == len(brute)


def test_group_and_turn_sharing():
    prompt = list(range(100))
    # a group of 4 sharing a 100-token prompt, each with 2 turns adding 10 distinct tokens
    requests = []
    for member in range(4):
        turn2 = prompt + [1000 + member] * 10
        requests += [prompt, turn2]
    assert distinct_prefix_tokens(requests) == 100 + 4 * 10
