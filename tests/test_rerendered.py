"""The re-rendered-context ablation (rl/rerendered.py): what a message-keeping harness trains on.

Rollouts are grown as the harness grows them (render, sampled ids as sampled, bridge) with the real
SmolLM2 tokenizer, and carry their messages in ``info`` as the rollout loop records them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verbatim.datamodel import Completion, Message, Rollout, Source
from verbatim.errors import TrainerError
from verbatim.harness.ledger import Ledger
from verbatim.renderers.registry import get_renderer
from verbatim.rl.rerendered import (
    changed,
    closed,
    closed_input,
    never_sampled,
    reencoded_replies,
    reply_ids,
    rerendered,
    rerendered_input,
)
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.step_input import StepInput

OPENING = [Message(role="system", content="Reply with one whole number only."),
           Message(role="user", content="I picked a whole number from 1 to 5. Guess it!")]


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


def played(renderer, replies: list[list[int]], observations: list[str], rollout_id: str = "r") -> Rollout:
    """A rollout whose turn k sampled ``replies[k]`` (ids as sampled), followed by ``observations[k]``."""
    ledger, messages = Ledger(), list(OPENING)
    ledger.append_prompt(renderer.render(messages, add_generation_prompt=True).token_ids)
    for k, ids in enumerate(replies):
        stopped = ids[-1] in renderer.stop_token_ids
        ledger.append_completion(Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.5),
                                            versions=np.full(len(ids), 3), finish_reason="stop" if stopped
                                            else "length", prompt_tokens=len(ledger), cached_tokens=0))
        messages.append(renderer.parse_completion(ids))
        if k < len(observations):
            said = [Message(role="user", content=observations[k])]
            ledger.append_observation(renderer.bridge(ledger.view(), said))
            messages += said
    info = {"messages": [m.model_dump(mode="json", exclude_defaults=True) for m in messages], "tools": None}
    return ledger.to_rollout(run_id="run", group_id="g", rollout_id=rollout_id, reward=1.0, info=info)


def reply(renderer, text: str) -> list[int]:
    return renderer.encode(text) + [renderer.stop_token_ids[0]]


def test_replies_that_ended_and_re_encode_alike_re_render_to_the_trace(renderer):
    """The control: where re-rendering changes nothing, the rows are the traced tokens (minus μ)."""
    rollout = played(renderer, [reply(renderer, "3"), reply(renderer, "4")], ["Higher. One guess left."])
    rows = rerendered(rollout, renderer)
    assert rows is not None and not changed(rollout, rows) and never_sampled(rollout, rows) == 0
    assert reencoded_replies(rollout, rows, renderer.stop_token_ids) == 0
    traced = rollout.tokens
    assert np.array_equal(rows.token_id, traced.token_id) and np.array_equal(rows.source, traced.source)
    assert np.array_equal(rows.turn, traced.turn)
    assert np.array_equal(rows.policy_version[rows.source == Source.MODEL], [3] * int(traced.loss_mask.sum()))
    assert np.isnan(rows.logprob).all()  # a re-render has no sampler logprobs


def test_a_reply_cut_by_max_tokens_gains_an_end_token_it_never_sampled(renderer):
    cut = renderer.encode("I think it is 3 or maybe")
    rollout = played(renderer, [cut, reply(renderer, "4")], ["Reply with one whole number from 1 to 5."])
    rows = rerendered(rollout, renderer)
    assert changed(rollout, rows) and never_sampled(rollout, rows) == 1
    assert reencoded_replies(rollout, rows, renderer.stop_token_ids) == 0  # the same ids, closed
    first = reply_ids(rows, 0)
    assert first[-1] == renderer.stop_token_ids[0] and list(first[:-1]) == cut


def test_a_reply_sampled_in_pieces_is_re_encoded_whole(renderer):
    """The sampler may emit a word as pieces that BPE would merge: the re-render trains other tokens."""
    pieces = [i for ch in "Four" for i in renderer.encode(ch)] + [renderer.stop_token_ids[0]]
    assert pieces[:-1] != renderer.encode("Four")
    rollout = played(renderer, [pieces], [])
    rows = rerendered(rollout, renderer)
    assert changed(rollout, rows) and never_sampled(rollout, rows) == 0
    assert reencoded_replies(rollout, rows, renderer.stop_token_ids) == 1
    assert list(rows.token_id[rows.source == Source.MODEL]) == reply(renderer, "Four")


def test_a_rollout_without_messages_cannot_be_re_rendered(renderer):
    rollout = played(renderer, [reply(renderer, "3")], [])
    bare = rollout.model_copy(update={"info": {}})
    assert rerendered(bare, renderer) is None and changed(bare, None)


def one_step(renderer) -> tuple[StepInput, Rollout, Rollout]:
    """A group of two: a reply that ended ("a") and one cut by max tokens ("b")."""
    same = played(renderer, [reply(renderer, "3")], [], "a")
    cut = played(renderer, [renderer.encode("maybe 3 or")], [], "b")
    rows = StepInput(columns=[same.tokens, cut.tokens], advantages=np.array([1.0, -1.0]), groups=[[0, 1]],
                     rollout_ids=["a", "b"])
    return rows, same, cut


def test_the_step_keeps_its_rows_groups_and_advantages_and_says_how_far_it_moved(renderer):
    rows, same, cut = one_step(renderer)
    again, info = rerendered_input(rows, [cut, same], renderer)
    assert again.behaviour_from_trainer and list(again.advantages) == [1.0, -1.0] and again.groups == [[0, 1]]
    assert info == {"rerendered_changed": 0.5, "rerendered_never_sampled": 1, "rerendered_failed": 0,
                    "rerendered_replies": 2, "rerendered_reencoded": 0}


def test_closing_a_cut_reply_trains_the_bridge_stop_token_and_leaves_every_other_row_as_traced(renderer):
    """The ablation that isolates the re-render's added end token: relabel it, change nothing else."""
    cut = renderer.encode("I think it is 3 or maybe")
    rollout = played(renderer, [cut, reply(renderer, "4")], ["Reply with one whole number from 1 to 5."])
    rows, added = closed(rollout, renderer.stop_token_ids)
    traced, at = rollout.tokens, rollout.turns[0].completion_end
    assert added == 1 and np.array_equal(rows.token_id, traced.token_id)
    assert rows.token_id[at] == renderer.stop_token_ids[0] and traced.source[at] == Source.ENV
    assert rows.source[at] == Source.MODEL and np.isnan(rows.logprob[at])
    assert rows.turn[at] == 0 and rows.policy_version[at] == 3
    others = np.arange(len(traced)) != at
    for name, column in traced.as_dict().items():
        assert np.array_equal(getattr(rows, name)[others], column[others], equal_nan=True), name
    again = rerendered(rollout, renderer)  # the same model tokens as the re-render, on the traced rows
    assert list(rows.token_id[rows.source == Source.MODEL]) == list(again.token_id[again.source == Source.MODEL])


def test_a_rollout_cut_at_its_last_reply_gets_the_stop_token_appended(renderer):
    cut = renderer.encode("maybe 3 or")
    rollout = played(renderer, [cut], [])
    rows, added = closed(rollout, renderer.stop_token_ids)
    assert added == 1 and len(rows) == len(rollout.tokens) + 1
    assert rows.token_id[-1] == renderer.stop_token_ids[0] and rows.source[-1] == Source.MODEL
    ended = played(renderer, [reply(renderer, "3")], [])
    rows, added = closed(ended, renderer.stop_token_ids)  # a reply that ended itself: nothing to close
    assert added == 0 and rows.equals(ended.tokens)


def test_the_closed_step_says_how_many_tokens_it_added(renderer):
    rows, same, cut = one_step(renderer)
    again, info = closed_input(rows, [cut, same], renderer)
    assert again.behaviour_from_trainer and again.columns[0].equals(same.tokens) and again.groups == [[0, 1]]
    assert info == {"rerendered_never_sampled": 1, "rerendered_changed": 0.5}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def tiny_rows(behaviour_from_trainer: bool) -> StepInput:
    ledger = Ledger()
    ledger.append_prompt([1, 2, 3, 4])
    ledger.append_completion(Completion(token_ids=np.array([5, 6, 7]), logprobs=np.full(3, -4.0),
                                        versions=np.zeros(3), finish_reason="stop", prompt_tokens=4,
                                        cached_tokens=0))
    traced = ledger.columns()
    bare = type(traced)(**(traced.as_dict() | {"logprob": np.full(len(traced), np.nan, np.float32)}))
    return StepInput(columns=[bare, bare], advantages=np.array([1.0, -1.0]), groups=[[0, 1]],
                     behaviour_from_trainer=behaviour_from_trainer)


def test_without_sampler_logprobs_the_trainer_stands_in_for_mu_only_when_told(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-3, prefixflow=False))
    with pytest.raises(TrainerError, match="6 model tokens of the step have no sampler logprob"):
        learner.train_step(tiny_rows(False))
    learned = learner.train_step(tiny_rows(True))
    every = learned["correction"]["all"]
    assert every["mean_abs_log_ratio"] == 0.0 and every["dropped"]["any"] == 0.0 and np.isfinite(learned["loss"])
