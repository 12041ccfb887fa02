"""The ledger only grows: properties over random append sequences, and refused mutations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from verbatim.datamodel import Completion, Source
from verbatim.errors import LedgerError
from verbatim.harness.ledger import Ledger

token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=40)
completions = st.lists(
    st.tuples(st.integers(0, 50_000), st.floats(-30.0, 0.0, allow_nan=False, width=32), st.integers(0, 9)),
    min_size=0, max_size=30)


def make_completion(ledger: Ledger, sampled: list[tuple[int, float, int]]) -> Completion:
    ids, logprobs, versions = zip(*sampled) if sampled else ((), (), ())
    return Completion(token_ids=list(ids), logprobs=list(logprobs), versions=list(versions),
                      finish_reason="stop", prompt_tokens=len(ledger), cached_tokens=0)


@settings(max_examples=150, deadline=None)
@given(prompt=token_lists.filter(bool), turns=st.lists(st.tuples(completions, token_lists), max_size=8))
def test_every_earlier_prefix_stays_byte_identical(prompt, turns):
    ledger = Ledger(capacity=16)  # small, so appends reallocate
    ledger.append_prompt(prompt)
    snapshots = [ledger.columns()]
    views = [ledger.view()]
    for sampled, observation in turns:
        ledger.append_completion(make_completion(ledger, sampled))
        snapshots.append(ledger.columns())
        if observation:
            ledger.append_observation(observation)
            snapshots.append(ledger.columns())
        views.append(ledger.view())
    final = ledger.columns()
    for snap in snapshots:
        n = len(snap)
        for name, column in snap.as_dict().items():
            now = final.as_dict()[name][:n]
            assert column.tobytes() == now.tobytes(), name
    for view in views:  # views handed out earlier still show exactly their prefix
        assert np.array_equal(view, final.token_id[: len(view)])


@settings(max_examples=100, deadline=None)
@given(prompt=token_lists.filter(bool), turns=st.lists(st.tuples(completions, token_lists), max_size=6))
def test_columns_stay_aligned_and_mark_sources(prompt, turns):
    ledger = Ledger()
    ledger.append_prompt(prompt)
    expected_sources = [Source.PROMPT] * len(prompt)
    for sampled, observation in turns:
        turn = ledger.append_completion(make_completion(ledger, sampled))
        assert turn.completion_tokens == len(sampled)
        expected_sources += [Source.MODEL] * len(sampled)
        if observation:
            ledger.append_observation(observation)
            expected_sources += [Source.ENV] * len(observation)
    cols = ledger.columns()
    assert {len(c) for c in cols.as_dict().values()} == {len(ledger)}
    assert cols.source.tolist() == [int(s) for s in expected_sources]
    model = cols.source == Source.MODEL
    assert np.isfinite(cols.logprob[model]).all() and (cols.policy_version[model] >= 0).all()
    assert np.isnan(cols.logprob[~model]).all() and (cols.policy_version[~model] == -1).all()
    for turn in ledger.turns:  # turn k's completion is tagged k; its prompt is everything before
        assert (cols.turn[turn.prompt_end:turn.completion_end] == turn.index).all()
        assert (cols.source[turn.prompt_end:turn.completion_end] == Source.MODEL).all()


def _ledger() -> Ledger:
    ledger = Ledger()
    ledger.append_prompt([1, 2, 3])
    ledger.append_completion(make_completion(ledger, [(7, -0.5, 0), (8, -0.25, 0)]))
    ledger.append_observation([4, 5])
    return ledger


def test_views_and_snapshots_are_read_only():
    ledger = _ledger()
    with pytest.raises(ValueError):
        ledger.view()[0] = 99
    with pytest.raises(ValueError):
        ledger.column("logprob")[3] = 0.0
    with pytest.raises(ValueError):
        ledger.columns().token_id[0] = 99
    with pytest.raises(ValueError):  # the view cannot be made writable again
        ledger.view().flags.writeable = True
    assert ledger.view().tolist() == [1, 2, 3, 7, 8, 4, 5]


def test_no_api_overwrites_or_drops_tokens():
    ledger = _ledger()
    with pytest.raises(TypeError):
        ledger[0] = 5  # type: ignore[index]
    with pytest.raises(TypeError):
        del ledger[0]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        ledger.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(LedgerError, match="before the first completion"):
        ledger.append_prompt([9])
    turns = ledger.turns
    with pytest.raises(ValidationError, match="frozen"):
        turns[0].prompt_end = 0
    assert ledger.view().tolist() == [1, 2, 3, 7, 8, 4, 5]


def test_completion_must_match_the_prompt_it_was_sampled_for():
    ledger = _ledger()
    stale = Completion(token_ids=[1], logprobs=[-1.0], versions=[0], finish_reason="stop",
                       prompt_tokens=3, cached_tokens=0)
    with pytest.raises(LedgerError, match="3-token prompt"):
        ledger.append_completion(stale)
    assert len(ledger) == 7


@pytest.mark.parametrize("logprob,version,match", [
    (float("nan"), 0, "finite sampler logprob"),
    (float("-inf"), 0, "finite sampler logprob"),
    (-1.0, -1, "policy version"),
])
def test_model_tokens_need_logprob_and_version(logprob, version, match):
    ledger = _ledger()
    bad = make_completion(ledger, [(3, logprob, version)])
    with pytest.raises(LedgerError, match=match):
        ledger.append_completion(bad)
    assert len(ledger) == 7 and len(ledger.turns) == 1


def test_observation_needs_a_completion_and_tokens_must_be_valid():
    ledger = Ledger()
    with pytest.raises(LedgerError, match="prompt before"):
        ledger.append_completion(Completion(token_ids=[], logprobs=[], versions=[], finish_reason="stop",
                                            prompt_tokens=0, cached_tokens=0))
    ledger.append_prompt([1])
    with pytest.raises(LedgerError, match="need a completion"):
        ledger.append_observation([2])
    with pytest.raises(LedgerError, match="non-negative"):
        ledger.append_prompt([-1])
    with pytest.raises(LedgerError, match="non-negative"):
        ledger.append_prompt([1.5])
    assert ledger.view().tolist() == [1]


def test_turn_rewards_attach_once():
    ledger = _ledger()
    assert ledger.set_turn_reward(1.0).reward == 1.0
    with pytest.raises(LedgerError, match="already has a reward"):
        ledger.set_turn_reward(2.0)


def test_rollout_snapshot_keeps_columns_and_turns():
    ledger = _ledger()
    rollout = ledger.to_rollout(run_id="r", group_id="g0", rollout_id="g0-0", task={"q": 1}, reward=1.0)
    assert rollout.tokens.equals(ledger.columns())
    assert rollout.turns == ledger.turns
    assert rollout.tokens.loss_mask.tolist() == [False] * 3 + [True] * 2 + [False] * 2
    ledger.append_completion(make_completion(ledger, [(1, -0.1, 1)]))
    assert len(rollout.tokens) == 7  # the snapshot does not grow with the ledger
