"""pass@k (harness/pass_at_k.py): the unbiased estimator against hand-computed cases and its laws (hypothesis),
and an eval's figures over tasks."""

from __future__ import annotations

from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verbatim.errors import InputError
from verbatim.harness.pass_at_k import TaskScore, by_task, ks, pass_at_k, summary


@pytest.mark.parametrize("n,c,k,want", [(4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (4, 0, 4, 0.0),
                                        (4, 4, 1, 1.0), (10, 3, 5, 1 - comb(7, 5) / comb(10, 5)), (5, 3, 3, 1.0)])
def test_hand_computed_cases(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_bounded_monotone_in_k_the_success_rate_at_1_and_exact_at_none_and_all(case):
    n, c = case
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(c / n, abs=1e-12)
    if c == 0:
        assert values == [0.0] * n
    if c == n:
        assert values == [1.0] * n
    for k in range(1, n + 1):
        assert values[k - 1] == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-9)


def test_out_of_range_counts_are_refused():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(InputError):
            pass_at_k(n, c, k)


def test_an_evals_figures_average_the_tasks_and_say_why_when_no_task_is_judged():
    assert ks(1) == (1,) and ks(4) == (1, 2, 4) and ks(6) == (1, 2, 4, 6)
    rows = [{"task_id": "a", "reward": 1.0, "solved": True}, {"task_id": "a", "reward": 0.0, "solved": False},
            {"task_id": "b", "reward": 0.5, "solved": False}, {"task_id": "b", "reward": 0.5, "solved": False}]
    figures = summary(by_task(rows))
    assert figures["tasks"] == 2 and figures["samples"] == 2 and figures["mean_reward"] == pytest.approx(0.5)
    assert figures["success_rate"] == pytest.approx(0.25)
    assert figures["pass_at_k"] == {"1": pytest.approx(0.25), "2": pytest.approx(0.5)}
    unjudged = summary([TaskScore("x", (0.2, 0.4), None)])
    assert unjudged["pass_at_k"] is None and "never said" in unjudged["why_no_pass_at_k"]
    assert unjudged["mean_reward"] == pytest.approx(0.3)
    with pytest.raises(InputError):
        summary([])


def test_asked_ks_are_reported_with_pass_at_1_and_checked_against_the_samples():
    from verbatim.harness.pass_at_k import check_ks

    assert check_ks((4, 2), 4) == (1, 2, 4) and check_ks((), 8) == (1, 2, 4, 8)
    scores = [TaskScore("t", (1.0, 0.0, 0.0, 1.0), (True, False, False, True))]
    assert list(summary(scores, (4,))["pass_at_k"]) == ["1", "4"]
    with pytest.raises(InputError, match="pass@5 needs 1 <= k <= the 4 samples"):
        check_ks((5,), 4)
