"""One step's rollouts to the learner's rows, and the step's metrics record: pure logic on synthetic rollouts."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.datamodel import TRAINED_STATUSES, Rollout, TokenColumns, Turn, TurnSampling
from verbatim.errors import InputError
from verbatim.harness.summary import RunSummary
from verbatim.rl.train_step import peak_rss_mib, step_input, step_record, success_rate
from verbatim.trainer.advantages import group_advantages
from verbatim.trainer.correction import correct
from verbatim.trainer.learner_config import CorrectionConfig


def rollout(group: int, index: int, reward: float | None = 1.0, status: str = "ok", *, solved: object = None,
            turns: bool = True, error: str | None = None, sampling: TurnSampling | None = None) -> Rollout:
    """A rollout of step 0 as the harness writes it: three prompt tokens, three sampled, ids distinct per member."""
    tokens = TokenColumns(token_id=np.arange(6) + 10 * group + index, source=np.array([0, 0, 0, 2, 2, 2]),
                          logprob=np.array([np.nan] * 3 + [-0.5] * 3), policy_version=np.array([-1] * 3 + [0] * 3),
                          turn=np.zeros(6))
    turn = Turn(index=0, prompt_end=3, completion_end=6, sampling=sampling)
    if error is None and status != "ok":
        error = f"{status} in g{group} r{index}"
    env = {} if solved is None else {"solved": solved}
    group_id = f"s0000-g{group:04d}"
    return Rollout(run_id="run", group_id=group_id, rollout_id=f"{group_id}-r{index:02d}", tokens=tokens,
                   turns=(turn,) if turns else (), reward=reward, status=status, error=error,
                   info={"step": 0, "env": env})


# -- step_input --------------------------------------------------------------------------------------


def test_ok_and_truncated_rollouts_train_error_and_interrupted_do_not():
    played = [rollout(0, 0, 1.0, "ok"), rollout(0, 1, 0.0, "error"), rollout(0, 2, 0.5, "truncated"),
              rollout(0, 3, 0.0, "interrupted")]
    rows, info = step_input(played, "rloo")
    assert [c is r.tokens for c, r in zip(rows.columns, [played[0], played[2]])] == [True, True]
    assert rows.groups == [[0, 1]]
    np.testing.assert_allclose(rows.advantages, [0.5, -0.5])
    assert info == {"groups_trained": 1, "groups_skipped": 0, "rows": 2, "advantage_std": 0.5,
                    "advantage_abs_mean": 0.5, "zero_advantage_groups": 0}


def test_the_step_trains_at_the_temperature_its_turns_record():
    hot = TurnSampling(temperature=1.3)
    rows, _ = step_input([rollout(0, 0, 1.0, sampling=hot), rollout(0, 1, 0.0, sampling=hot)], "grpo")
    assert rows.temperature == 1.3 and rows.truncation is None
    rows, _ = step_input([rollout(0, 0, 1.0), rollout(0, 1, 0.0)], "grpo")  # schema 2: raw logprobs, T = 1
    assert rows.temperature == 1.0
    greedy = TurnSampling(temperature=0.0)  # vLLM applies no temperature to a greedy request's logprobs
    assert step_input([rollout(0, 0, 1.0, sampling=greedy), rollout(0, 1, 0.0, sampling=greedy)],
                      "grpo")[0].temperature == 1.0


def test_rollouts_sampled_with_different_settings_are_refused():
    played = [rollout(0, 0, 1.0, sampling=TurnSampling(temperature=0.7)),
              rollout(0, 1, 0.0, sampling=TurnSampling(temperature=1.0))]
    with pytest.raises(InputError, match=r"different settings \(temperature 0.7 \(processed\); temperature 1 "):
        step_input(played, "grpo")


@pytest.mark.parametrize("sampling,shown,truncation", [
    (TurnSampling(temperature=1.0, top_p=0.9), "top-p 0.9", (0.9, 0)),
    (TurnSampling(temperature=0.8, top_k=5), "top-k 5", (1.0, 5)),
    (TurnSampling(temperature=1.0, regex="[0-9]+"), "regex '[0-9]+'", None),
])
def test_a_truncated_distribution_needs_the_users_opt_in(sampling, shown, truncation):
    played = [rollout(0, 0, 1.0, sampling=sampling), rollout(0, 1, 0.0, sampling=sampling)]
    needle = re.escape(f"{shown}: a mask of the sampling distribution the trainer does not reproduce")
    with pytest.raises(InputError, match=needle) as caught:
        step_input(played, "grpo")
    assert "--allow-truncated-sampling" in caught.value.one_line()
    rows, info = step_input(played, "grpo", allow_truncated=True)
    assert rows.truncation == truncation and info["truncated_sampling"] == shown


def test_a_group_with_fewer_than_two_trained_rollouts_is_skipped():
    played = [rollout(0, 0, 1.0), rollout(0, 1, 0.0, "error"),               # one trained
              rollout(1, 0, 1.0), rollout(1, 1, None),                       # ok without a reward
              rollout(2, 0, 1.0), rollout(2, 1, 0.0, turns=False),           # ok without a turn
              rollout(3, 0, 2.0), rollout(3, 1, 0.0), rollout(3, 2, 1.0, "interrupted")]
    rows, info = step_input(played, "grpo")
    assert [c is r.tokens for c, r in zip(rows.columns, played[6:8])] == [True, True]
    assert rows.groups == [[0, 1]]
    assert (info["groups_trained"], info["groups_skipped"], info["rows"]) == (1, 3, 2)


def test_rows_are_grouped_and_ordered_by_rollout_id():
    played = [rollout(g, i, float(i + g)) for g in (2, 0, 1) for i in (2, 0, 1)]
    shuffled = [played[k] for k in (4, 8, 0, 3, 7, 1, 6, 2, 5)]
    rows, info = step_input(shuffled, "grpo")
    expected = sorted(played, key=lambda r: r.rollout_id)
    assert [c is r.tokens for c, r in zip(rows.columns, expected, strict=True)] == [True] * 9
    assert rows.groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert info["groups_trained"] == 3


def test_grpo_advantages_use_the_population_std_within_each_group():
    played = [rollout(0, i, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])] + [rollout(1, i, r) for i, r in
                                                                               enumerate([3.0, 1.0])]
    rows, info = step_input(played, "grpo")
    spread = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(rows.advantages, [spread, -spread, -spread, spread, 1 / (1 + 1e-6), -1 / (1 + 1e-6)])
    assert rows.advantages.dtype == np.float64


def test_rloo_advantages_leave_each_rollout_out_of_its_baseline():
    played = [rollout(0, i, r) for i, r in enumerate([1.0, 0.0, 0.0])] + [rollout(1, i, 2.0) for i in range(3)]
    rows, info = step_input(played, "rloo")
    np.testing.assert_allclose(rows.advantages, [1.0, -0.5, -0.5, 0.0, 0.0, 0.0])
    assert info["zero_advantage_groups"] == 1
    assert info["advantage_abs_mean"] == pytest.approx(2 / 6)


def test_no_trainable_group_is_one_line_naming_the_first_error():
    played = [rollout(0, 0, 1.0), rollout(0, 1, 0.0, "error", error="env crashed: KeyError 'x'"),
              rollout(1, 0, 0.0, "interrupted", error="stopped by SIGTERM"), rollout(1, 1, None)]
    with pytest.raises(InputError) as caught:
        step_input(played, "grpo")
    line = caught.value.one_line()
    assert "\n" not in line
    assert "no group of this step has two rollouts" in line
    assert "2 of 4 rollouts failed (env crashed: KeyError 'x')" in line
    assert "verbatim lint trace" in line


def test_no_trainable_group_without_errors_says_why():
    with pytest.raises(InputError, match="all 2 rollouts did, but no group holds two of them"):
        step_input([rollout(0, 0, 1.0), rollout(1, 0, 1.0)], "rloo")
    with pytest.raises(InputError, match="2 of 3 rollouts ended without a reward from the env"):
        step_input([rollout(0, 0, 1.0), rollout(0, 1, None), rollout(1, 0, None)], "rloo")


def test_rollouts_cut_at_max_turns_are_named_as_the_cause_not_the_env():
    """An agent that asks for a third turn under --max-turns 2 and raises on the refusal: truncated, no reward."""
    cut = "max turns (2) reached: the agent asked for more; then the agent raised APIStatusError: refused"
    played = [rollout(0, 0, None, "truncated", error=cut), rollout(0, 1, None, "truncated", error=cut)]
    with pytest.raises(InputError) as caught:
        step_input(played, "grpo")
    line = caught.value.one_line()
    assert "2 of 2 rollouts were cut at --max-turns before they ended with a reward" in line
    assert "raise --max-turns" in line and "env's rewards" not in line


MEMBER = st.tuples(st.sampled_from(["ok", "truncated", "error", "interrupted"]),
                   st.sampled_from([0.0, 0.5, 1.0, 2.0]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(MEMBER, min_size=1, max_size=5), min_size=1, max_size=4),
       st.sampled_from(["grpo", "rloo", "mean"]),
       st.randoms(use_true_random=False))
def test_rows_are_the_trained_members_of_groups_with_two(groups, how, random):
    played = [rollout(g, i, reward, status) for g, members in enumerate(groups) for i, (status, reward) in
              enumerate(members)]
    random.shuffle(played)
    trained = [[rollout(g, i, reward, status) for i, (status, reward) in enumerate(members)
                if status in TRAINED_STATUSES] for g, members in enumerate(groups)]
    kept = [members for members in trained if len(members) >= 2]
    if not kept:
        with pytest.raises(InputError):
            step_input(played, how)
        return
    rows, info = step_input(played, how)
    assert [len(g) for g in rows.groups] == [len(m) for m in kept]
    assert [i for g in rows.groups for i in g] == list(range(len(rows.columns)))
    expected = [r.tokens for members in kept for r in members]
    assert all(a.equals(b) for a, b in zip(rows.columns, expected, strict=True))
    for members, group in zip(kept, rows.groups):
        np.testing.assert_allclose(rows.advantages[group], group_advantages([r.reward for r in members], how))
        assert abs(rows.advantages[group].sum()) < 1e-9
    assert (info["groups_trained"], info["groups_skipped"]) == (len(kept), len(groups) - len(kept))


# -- success_rate -------------------------------------------------------------------------------------


def test_success_rate_counts_the_rollouts_whose_env_said():
    played = [rollout(0, 0, solved=True), rollout(0, 1, solved=False), rollout(0, 2, solved=True),
              rollout(0, 3), rollout(0, 4, 0.0, "error"), rollout(0, 5, solved=1)]
    assert success_rate(played) == pytest.approx(2 / 3)
    assert success_rate([rollout(0, 0), rollout(0, 1, 0.0, "error")]) is None
    assert success_rate([]) is None


# -- step_record ---------------------------------------------------------------------------------------


def learned_on_lagged_tokens() -> dict:
    """What the learner reports for a step whose second row was sampled one version behind (trainer at 2)."""
    mask = torch.tensor([[False, True, True, True], [False, True, True, False]])
    versions = torch.tensor([[-1, 2, 2, 2], [-1, 1, 1, -1]], dtype=torch.int32)
    logp_mu = torch.tensor([[float("nan"), -1.0, -2.0, -0.5], [float("nan"), -1.0, -1.5, float("nan")]])
    logp_pi = torch.tensor([[0.0, -1.1, -2.0, -0.4], [0.0, -1.0, -1.2, 0.0]])
    fix = correct(logp_pi, logp_mu, mask, versions, 2, CorrectionConfig(max_version_lag=0))
    return {"rows": 2, "loss": 0.25, "grad_norm": 1.5, "grad_norm_max": 1.5, "updates": 1,
            "kept_tokens": int(fix.keep.sum()), "model_tokens": 5, "train_s": 0.5,
            "correction": fix.metrics.as_dict(), "entropy": 2.5}


def test_step_record_holds_the_steps_numbers():
    played = [rollout(0, 0, 1.0, solved=True), rollout(0, 1, 0.0, solved=False), rollout(0, 2, 0.5, "truncated"),
              rollout(0, 3, 0.0, "error")]
    rows, row_info = step_input(played, "grpo")
    learned = learned_on_lagged_tokens()
    summary = RunSummary(block_size=16, prompt_tokens=200, cached_tokens=50, prefill_tokens=150,
                         min_prefill_tokens=40, generated_tokens=30)
    times = {"rollout": 1.23456, "train": 0.5, "weight_sync": 0.0104}
    record = step_record(3, 4, played, summary, row_info, learned, times)
    assert json.loads(json.dumps(record)) == record  # one line of metrics.jsonl
    assert record["step"] == 3 and record["version"] == 4
    assert record["reward_mean"] == pytest.approx(0.5)  # ok and truncated only: the error's 0.0 is not trained
    assert record["success_rate"] == 0.5
    assert (record["rollouts"], record["statuses"]) == (4, {"ok": 2, "truncated": 1, "error": 1})
    assert {k: record[k] for k in row_info} == row_info
    assert (record["loss"], record["grad_norm"], record["updates"]) == (0.25, 1.5, 1)
    assert (record["kept_tokens"], record["model_tokens"]) == (3, 5)  # the lagged row's two tokens dropped
    assert record["entropy"] == 2.5
    every = learned["correction"]["all"]
    assert record["mismatch_mean_abs"] == pytest.approx(every["mean_abs_log_ratio"]) and every["tokens"] == 5
    assert record["k3"] == every["k3"] and record["ratio_quantiles"] == every["ratio_quantiles"]
    assert record["dropped"]["version_lag"] == pytest.approx(2 / 5)
    assert record["policy_lag"] == {"0": 3, "1": 2}
    assert record["hybrid_tokens"] == 0
    assert {k: record[k] for k in ("prompt_tokens", "cached_tokens", "prefill_tokens", "min_prefill_tokens",
                                   "generated_tokens", "cache_hit_rate")} == {
        "prompt_tokens": 200, "cached_tokens": 50, "prefill_tokens": 150, "min_prefill_tokens": 40,
        "generated_tokens": 30, "cache_hit_rate": 0.25}
    assert (record["rollout_s"], record["train_s"], record["weight_sync_s"]) == (1.235, 0.5, 0.01)
    assert record["trainer_peak_rss_mib"] > 0


def test_step_record_without_a_summary_or_a_correction():
    played = [rollout(0, 0, 1.0), rollout(0, 1, 0.0)]
    record = step_record(0, 1, played, None, {}, {"rows": 0, "loss": 0.0, "grad_norm": 0.0, "updates": 0,
                                                  "correction": None}, {})
    assert "prompt_tokens" not in record and "cache_hit_rate" not in record
    assert record["policy_lag"] == {} and record["hybrid_tokens"] == 0
    assert record["mismatch_mean_abs"] is None and record["kept_tokens"] is None
    assert record["success_rate"] is None and record["reward_mean"] == 0.5


# -- peak_rss_mib --------------------------------------------------------------------------------------


def test_peak_rss_counts_the_trainer_and_its_child_processes():
    alone = peak_rss_mib()
    assert set(alone) == {"trainer_peak_rss_mib", "engine_peak_rss_mib"}
    assert alone["trainer_peak_rss_mib"] > 10  # a Python process with torch imported
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"  # the interpreter has started: its pages are resident
        with_child = peak_rss_mib()
    finally:
        child.communicate(b"")
    assert with_child["engine_peak_rss_mib"] is not None and with_child["engine_peak_rss_mib"] > 1
    assert with_child["trainer_peak_rss_mib"] >= alone["trainer_peak_rss_mib"]


def test_a_step_that_ran_out_of_context_names_the_context_as_the_cause():
    """Not the env's rewards: every rollout ended at the context budget, so the fix is the context length."""
    reason = "context budget: the opening prompt needs 60 + 5000 tokens, over the 4096-token context"
    played = [rollout(0, i, None, "truncated", error=reason, turns=False) for i in range(2)]
    with pytest.raises(InputError) as refused:
        step_input(played, "grpo")
    assert "2 of 2 rollouts ran out of context (context budget: the opening prompt needs 60" in str(refused.value)
    assert refused.value.hint == "raise --max-model-len or lower --max-tokens"
    failing = [rollout(0, i, None, "error", error="env raised") for i in range(2)]
    with pytest.raises(InputError) as other:
        step_input(failing, "grpo")
    assert "2 of 2 rollouts failed (env raised)" in str(other.value) and "verbatim lint trace" in other.value.hint
