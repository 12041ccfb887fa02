"""Microbatches by rows or by a token budget (trainer/packing.py): pure."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verbatim.errors import TrainerError
from verbatim.trainer.packing import Microbatching, by_tokens, padded, padding


@given(st.lists(st.integers(1, 400), max_size=40), st.integers(1, 2000))
def test_a_token_budget_covers_every_row_once_within_the_budget_longest_first(lengths, budget):
    batches = by_tokens(lengths, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert padded(lengths, batch) <= budget or len(batch) == 1  # a row over the budget goes alone
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
    firsts = [lengths[batch[0]] for batch in batches]
    assert firsts == sorted(firsts, reverse=True)  # each opens on the longest row left
    for batch in batches[:-1]:  # a microbatch closes only when the next row does not fit
        assert (len(batch) + 1) * lengths[batch[0]] > budget


def test_rows_of_like_length_share_a_microbatch_and_padding_counts_what_is_no_rows():
    lengths = [200, 8000, 190, 7900, 210]
    assert Microbatching(rows=2).split(lengths) == [[0, 1], [2, 3], [4]]
    assert padding(lengths, Microbatching(rows=2).split(lengths)) == (8000 - 200) + (7900 - 190)
    assert by_tokens(lengths, 16000) == [[1, 3], [4, 0, 2]]
    assert padding(lengths, by_tokens(lengths, 16000)) == 100 + 10 + 20


@pytest.mark.parametrize("bad", [dict(rows=0), dict(tokens=0)])
def test_a_microbatch_of_nothing_is_refused(bad):
    with pytest.raises(TrainerError, match="at least 1"):
        Microbatching(**bad)
