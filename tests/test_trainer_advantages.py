"""Group advantages: hand-computed small cases, refusals, and the invariants under hypothesis."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verbatim.errors import InputError
from verbatim.trainer.advantages import group_advantages


def test_grpo_small_cases_by_hand():
    # rewards 0, 1: mean 0.5, population std 0.5
    np.testing.assert_allclose(group_advantages([0.0, 1.0], "grpo", eps=0.0), [-1.0, 1.0])
    # 1, 2, 3, 6: mean 3, deviations -2, -1, 0, 3, population variance 14/4
    std = math.sqrt(14 / 4)
    np.testing.assert_allclose(group_advantages([1, 2, 3, 6], "grpo", eps=0.0), np.array([-2, -1, 0, 3]) / std)
    # eps is added to the std, not the variance
    np.testing.assert_allclose(group_advantages([0.0, 1.0], "grpo", eps=0.5), [-0.5, 0.5])


def test_mean_small_cases_by_hand():
    # Dr. GRPO's: the group's mean subtracted, no division; 1, 2, 6: mean 3
    np.testing.assert_allclose(group_advantages([1.0, 2.0, 6.0], "mean"), [-2.0, -1.0, 3.0])
    # a group whose rewards barely differ keeps its small advantages (grpo would scale them to unit spread)
    np.testing.assert_allclose(group_advantages([0.0, 0.01], "mean"), [-0.005, 0.005])


def test_rloo_small_cases_by_hand():
    np.testing.assert_allclose(group_advantages([0.0, 1.0], "rloo"), [-1.0, 1.0])
    # 1 - mean(2, 6) = -3; 2 - mean(1, 6) = -1.5; 6 - mean(1, 2) = 4.5
    np.testing.assert_allclose(group_advantages([1.0, 2.0, 6.0], "rloo"), [-3.0, -1.5, 4.5])


@pytest.mark.parametrize("how", ["grpo", "rloo", "mean"])
def test_every_binary_reward_pattern_of_small_groups(how):
    """Exhaustive over 0/1 rewards for G = 2..5: a success gets more than a failure, all-equal gives 0."""
    for g in range(2, 6):
        for rewards in itertools.product([0.0, 1.0], repeat=g):
            adv = group_advantages(rewards, how)
            assert adv.dtype == np.float64 and adv.shape == (g,)
            k = sum(rewards)
            if k in (0, g):
                assert np.array_equal(adv, np.zeros(g))
                continue
            assert all(a > 0 for a, r in zip(adv, rewards) if r == 1.0)
            assert all(a < 0 for a, r in zip(adv, rewards) if r == 0.0)
            if how == "rloo":  # a success: 1 - (k - 1)/(g - 1); a failure: -k/(g - 1)
                want = [1 - (k - 1) / (g - 1) if r else -k / (g - 1) for r in rewards]
            elif how == "mean":  # p = k/g: a success 1 - p, a failure -p
                want = [(1 - k / g) if r else -k / g for r in rewards]
            else:  # p = k/g; deviations 1 - p and -p over std sqrt(p(1 - p))
                p = k / g
                want = [((1 - p) if r else -p) / (math.sqrt(p * (1 - p)) + 1e-6) for r in rewards]
            np.testing.assert_allclose(adv, want, rtol=1e-12)


@pytest.mark.parametrize("how", ["grpo", "rloo", "mean"])
def test_groups_without_a_baseline_are_refused_in_one_line(how):
    for rewards in ([1.0], []):
        with pytest.raises(InputError, match=f"no baseline for {how} advantages") as info:
            group_advantages(rewards, how)
        assert info.value.one_line().endswith("(use --group-size 2 or more)")
        assert "\n" not in info.value.one_line()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_refused_by_index(bad):
    with pytest.raises(InputError, match="reward 2 of the group is not finite"):
        group_advantages([0.0, 1.0, bad], "grpo")


def test_unknown_estimator_is_refused():
    with pytest.raises(InputError, match="unknown advantage estimator 'ppo'"):
        group_advantages([0.0, 1.0], "ppo")  # type: ignore[arg-type]


REWARDS = st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=2, max_size=16)


@settings(max_examples=200, deadline=None)
@given(REWARDS, st.sampled_from(["grpo", "rloo", "mean"]))
def test_advantages_sum_to_zero(rewards, how):
    adv = group_advantages(rewards, how)
    scale = max(1.0, float(np.abs(adv).max()))
    assert abs(float(adv.sum())) <= 1e-12 * len(rewards) * scale * 10


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), st.integers(2, 16),
       st.sampled_from(["grpo", "rloo", "mean"]))
def test_all_equal_rewards_give_exact_zeros(value, g, how):
    assert np.array_equal(group_advantages([value] * g, how), np.zeros(g))


@settings(max_examples=200, deadline=None)
@given(REWARDS)
def test_rloo_is_a_rescaled_centred_reward(rewards):
    r = np.asarray(rewards)
    g = r.size
    want = g / (g - 1) * (r - r.mean())
    atol = 1e-9 * max(1.0, float(np.abs(r).max()))
    np.testing.assert_allclose(group_advantages(rewards, "rloo"), want, rtol=1e-9, atol=atol)
    np.testing.assert_allclose(group_advantages(rewards, "mean"), want * (g - 1) / g, rtol=1e-9, atol=atol)


@settings(max_examples=100, deadline=None)
@given(REWARDS)
def test_grpo_has_unit_population_spread_when_rewards_differ(rewards):
    r = np.asarray(rewards)
    assume(np.ptp(r) > 1e-6 * max(1.0, float(np.abs(r).max())))  # no std lost to underflow
    assert float(group_advantages(rewards, "grpo", eps=0.0).std()) == pytest.approx(1.0, rel=1e-9)
