"""What a message-keeping harness trains on: each rollout re-rendered by the chat template.

verbatim trains on the token sequences the engine saw. Many harnesses keep messages instead and,
to train, rebuild each rollout with the chat template and put the loss on the assistant replies
they find in it. That sequence can differ from what the model saw: a reply cut by ``max_tokens``
gets an end token the model never sampled, a template strips or reformats old turns, BPE merges
across the boundaries the sampler kept apart. And its tokens have no sampler logprob, so nothing
can correct for the difference: the trainer's own π_old stands in for μ.

:func:`rerendered` builds those rows from the messages every rollout records
(``info["messages"]``, ``info["tools"]``). ``TrainPlan(context="rerendered")`` trains on them; it
exists as the counterfactual that ``verbatim bench learn`` measures, not as a way to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout, Source, TokenColumns
from verbatim.errors import VerbatimError
from verbatim.harness.summary import recorded_conversation
from verbatim.trainer.step_input import StepInput


def rerendered(rollout: Rollout, renderer: Any) -> TokenColumns | None:
    """The rollout as the template renders its messages, its replies as model tokens (no logprobs),
    cut after the last reply; None where the template refuses the messages or a reply cannot be found."""
    messages, tools = recorded_conversation(rollout)
    replies = [j for j, m in enumerate(messages) if m.role == "assistant"]
    if not replies:
        return None
    try:
        rendered = renderer.render(messages, tools=tools, add_generation_prompt=False)
        spans = [_reply_span(rendered.token_ids, rendered.message_index, j,
                             renderer.completion_ids(messages, j, tools=tools)) for j in replies]
    except VerbatimError:
        return None
    if any(span is None for span in spans):
        return None
    return _columns(rendered.token_ids, spans, _turn_versions(rollout, len(spans)))


def rerendered_input(rows: StepInput, rollouts: Sequence[Rollout], renderer: Any) -> tuple[StepInput, dict]:
    """The step's rows re-rendered (same rows, groups and advantages), and how far they are from the trace:
    the fraction of rows that differ, the model tokens trained that were never sampled, and the rows the
    template could not re-render (those stay as traced)."""
    by_id = {r.rollout_id: r for r in rollouts}
    columns, differ, extra, failed, replies, reencoded = [], 0, 0, 0, 0, 0
    for rollout_id, traced in zip(rows.rollout_ids, rows.columns):
        rollout = by_id[rollout_id]
        again = rerendered(rollout, renderer)
        failed += again is None
        differ += changed(rollout, again)
        extra += never_sampled(rollout, again)
        replies += len(rollout.turns)
        reencoded += reencoded_replies(rollout, again, renderer.stop_token_ids)
        columns.append(traced if again is None else again)
    info = {"rerendered_changed": differ / max(1, len(columns)), "rerendered_never_sampled": extra,
            "rerendered_failed": failed, "rerendered_replies": replies, "rerendered_reencoded": reencoded}
    return replace(rows, columns=columns, behaviour_from_trainer=True), info


def closed(rollout: Rollout, stop_ids: Sequence[int]) -> tuple[TokenColumns, int]:
    """The traced rows with each reply that max tokens cut closed by a stop token labelled as the model's
    (μ unknown, the reply's version): the one change of the re-render that adds a token to every cut
    reply, alone. The stop token is the bridge's, where the trace goes on; appended, where it ends.
    Returns the rows and how many tokens were added that the model never sampled."""
    tokens = rollout.tokens
    columns = {name: np.array(column) for name, column in tokens.as_dict().items()}
    ends = [(k, turn.completion_end) for k, turn in enumerate(rollout.turns)
            if turn.finish_reason == "length" and turn.completion_end > turn.prompt_end]
    added = 0
    for k, at in ends:
        if at == len(tokens):
            columns = {name: np.append(column, column[-1:]) for name, column in columns.items()}
            columns["token_id"][at] = stop_ids[0]
        elif int(tokens.token_id[at]) not in stop_ids:
            continue  # this template's bridge does not close with a stop token
        columns["source"][at], columns["logprob"][at], columns["turn"][at] = Source.MODEL, np.nan, k
        columns["policy_version"][at] = tokens.policy_version[at - 1]
        added += 1
    return TokenColumns(**columns), added


def closed_input(rows: StepInput, rollouts: Sequence[Rollout], renderer: Any) -> tuple[StepInput, dict]:
    """The step's traced rows, each cut reply closed (:func:`closed`), and how many tokens that added."""
    by_id = {r.rollout_id: r for r in rollouts}
    pairs = [closed(by_id[rollout_id], renderer.stop_token_ids) for rollout_id in rows.rollout_ids]
    info = {"rerendered_never_sampled": sum(added for _, added in pairs),
            "rerendered_changed": sum(added > 0 for _, added in pairs) / max(1, len(pairs))}
    return replace(rows, columns=[c for c, _ in pairs], behaviour_from_trainer=True), info


def changed(rollout: Rollout, rows: TokenColumns | None) -> bool:
    """The re-rendered rows are not the traced sequence (up to its last model token)."""
    if rows is None:
        return True
    traced = rollout.tokens
    return not (np.array_equal(traced.token_id, rows.token_id) and np.array_equal(traced.source, rows.source))


def never_sampled(rollout: Rollout, rows: TokenColumns | None) -> int:
    """Model tokens of the re-rendered rows beyond what the model sampled, turn by turn (at least 0)."""
    if rows is None:
        return 0
    return sum(max(0, len(reply_ids(rows, k)) - len(reply_ids(rollout.tokens, k)))
               for k in range(len(rollout.turns)))


def reencoded_replies(rollout: Rollout, rows: TokenColumns | None, stop_ids: Sequence[int]) -> int:
    """Replies whose re-rendered tokens are not the sampled ones, not counting the end token the template
    adds to a reply cut by max tokens: the replies the re-render trains as other ids than the model chose."""
    if rows is None:
        return 0
    differ = 0
    for k in range(len(rollout.turns)):
        sampled, mine = reply_ids(rollout.tokens, k), reply_ids(rows, k)
        if len(mine) and mine[-1] in stop_ids and not (len(sampled) and sampled[-1] in stop_ids):
            mine = mine[:-1]
        differ += not np.array_equal(sampled, mine)
    return differ


def reply_ids(columns: TokenColumns, turn: int) -> np.ndarray:
    """The model tokens of ``turn``: its reply as these rows train it."""
    return columns.token_id[(columns.turn == turn) & (columns.source == Source.MODEL)]


def _reply_span(ids: Sequence[int], owners: Sequence[int], message: int,
                reply: Sequence[int]) -> tuple[int, int] | None:
    """Where ``reply`` (the reply re-encoded) lies inside the template's tokens of ``message``."""
    positions = [i for i, owner in enumerate(owners) if owner == message]
    if not positions or not reply:
        return None
    first, last = positions[0], positions[-1] + 1
    n = len(reply)
    for start in range(first, last - n + 1):
        if list(ids[start:start + n]) == list(reply):
            return start, start + n
    return None


def _turn_versions(rollout: Rollout, turns: int) -> list[int]:
    """The version that sampled each turn's reply (its first model token's), -1 where unknown."""
    versions = []
    for k in range(turns):
        if k < len(rollout.turns):
            turn = rollout.turns[k]
            versions.append(int(rollout.tokens.policy_version[turn.prompt_end])
                            if turn.completion_end > turn.prompt_end else -1)
        else:
            versions.append(-1)
    return versions


def _columns(ids: Sequence[int], spans: list[tuple[int, int]], versions: list[int]) -> TokenColumns:
    end = spans[-1][1]
    source = np.full(end, Source.ENV, np.int8)
    source[: spans[0][0]] = Source.PROMPT
    policy_version = np.full(end, -1, np.int32)
    turn = np.zeros(end, np.int16)
    before = 0  # as traced: turn k is the tokens after reply k - 1, up to the end of reply k
    for k, ((start, stop), version) in enumerate(zip(spans, versions)):
        source[start:stop] = Source.MODEL
        policy_version[start:stop] = version
        turn[before:stop] = k
        before = stop
    return TokenColumns(token_id=np.asarray(ids[:end], np.int32), source=source,
                        logprob=np.full(end, np.nan, np.float32), policy_version=policy_version, turn=turn)
