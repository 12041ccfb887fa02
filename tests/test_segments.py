"""A rollout of several segments (an agent that rewrote its history): the ledger, the trace, and every reader.

Built with the real :class:`Ledger` from plain token ids (no engine): two turns in segment 0, a break, one
turn in segment 1, exactly as the agent endpoint records it.
"""

from __future__ import annotations

import numpy as np
import pytest

from verbatim.datamodel import Completion, Rollout, Source, Turn
from verbatim.errors import LedgerError
from verbatim.harness.export import export_rollouts
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter, read_run
from verbatim.harness.summary import request_prompts, summarize
from verbatim.lint.findings import CacheSettings
from verbatim.lint.trace import lint_rollout
from verbatim.rl.train_step import step_input
from verbatim.view.detail import prefill_counts, rollout_detail

BREAK = {"message": 1, "role": "user", "field": "content", "what": "message 1 (user): content differs",
         "turn": 2, "start": 22, "tools_changed": False, "messages": [{"role": "user", "content": "again"}]}


def completion(prompt: int, ids: list[int], cached: int, version: int = 0) -> Completion:
    return Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.5), versions=np.full(len(ids), version),
                      finish_reason="stop", prompt_tokens=prompt, cached_tokens=cached)


def segmented(reward: float = 1.0, rollout_id: str = "g0-r00", seed: int = 0) -> Rollout:
    ledger = Ledger()
    ledger.append_prompt([10 + seed, 11, 12, 13, 14, 15, 16, 17])          # 0..8
    ledger.append_completion(completion(8, [20, 21, 22, 23], cached=0))     # 8..12
    ledger.append_observation([30, 31, 32, 33, 34, 35])                    # 12..18
    ledger.append_completion(completion(18, [40, 41, 42, 43], cached=16))   # 18..22
    start = ledger.start_segment([10 + seed, 11, 12, 99, 98, 97, 96])      # 22..29: rendered afresh
    assert start == 22 and ledger.view().tolist() == [10 + seed, 11, 12, 99, 98, 97, 96]
    ledger.append_completion(completion(7, [50, 51, 52], cached=0))         # 29..32
    return ledger.to_rollout(run_id="run", group_id="g0", rollout_id=rollout_id, reward=reward,
                             info={"messages": [{"role": "user", "content": "hi"}], "segments": [BREAK]})


def test_the_ledger_starts_a_segment_only_after_a_completion_and_samples_for_it_alone():
    ledger = Ledger()
    ledger.append_prompt([1, 2, 3])
    with pytest.raises(LedgerError, match="right after a completion"):
        ledger.start_segment([4])
    ledger.append_completion(completion(3, [5], cached=0))
    ledger.start_segment([6, 7])
    with pytest.raises(LedgerError, match="2 tokens in its segment from 4"):
        ledger.append_completion(completion(6, [8], cached=0))  # sampled for the whole sequence: refused
    turn = ledger.append_completion(completion(2, [8], cached=0))
    assert (turn.prompt_start, turn.prompt_end, turn.completion_end, turn.prompt_tokens) == (4, 6, 7, 2)


def test_segments_split_the_tokens_and_rebase_the_turns():
    rollout = segmented()
    first, second = rollout.segments()
    assert first.tokens.token_id.tolist() == rollout.tokens.token_id[:22].tolist()
    assert second.tokens.token_id.tolist() == rollout.tokens.token_id[22:].tolist()
    assert [(t.index, t.prompt_start, t.prompt_end, t.completion_end) for t in second.turns] == [(2, 0, 7, 10)]
    assert second.info["segment"] == 1 and second.info["messages"] == BREAK["messages"]
    assert (first.row_id, second.row_id) == ("g0-r00", "g0-r00#1")
    assert request_prompts(rollout)[2].tolist() == [10, 11, 12, 99, 98, 97, 96]
    plain = first.model_copy(update={"info": {}})
    assert plain.segments() == (plain,)


def test_a_turn_cannot_start_a_segment_inside_the_previous_turn():
    rollout = segmented()
    bad = list(rollout.turns)
    bad[2] = bad[2].model_copy(update={"prompt_start": 20})
    with pytest.raises(ValueError, match="inside turn 1"):
        Rollout.model_validate({**rollout.model_dump(exclude={"tokens", "turns"}), "tokens": rollout.tokens,
                                "turns": tuple(bad)})
    with pytest.raises(ValueError, match="prompt_end must not precede prompt_start"):
        Turn(index=0, prompt_start=5, prompt_end=4, completion_end=6)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_segments_survive_the_trace(tmp_path, fmt):
    manifest = RunManifest(run_id="run", model="m", renderer="r", engine={"block_size": 16},
                           config={"options": {}, "plan": {}}, format=fmt)
    writer = TraceWriter(tmp_path / "run", manifest)
    writer.write_batch([segmented()])
    (back,) = read_run(tmp_path / "run").rollouts
    assert back.same_as(segmented()) and [t.prompt_start for t in back.turns] == [0, 0, 22]


def test_lint_names_the_break_and_its_cost_and_checks_each_segment_on_its_own():
    problems = lint_rollout(segmented(), CacheSettings(block_size=4))
    assert [p.kind for p in problems] == ["history_break"]
    (found,) = problems
    assert found.turn == 2 and "message 1 (user): content differs" in found.detail
    assert "segment 1 starts at token 22" in found.detail and "prefilled 7 of its 7 prompt tokens" in found.detail


def test_lint_still_finds_a_rewrite_that_no_segment_records():
    rollout = segmented()
    turns = list(rollout.turns)
    turns[2] = turns[2].model_copy(update={"prompt_start": 0})  # the same tokens, claimed as one sequence
    hidden = rollout.model_copy(update={"turns": tuple(turns)})
    kinds = {p.kind for p in lint_rollout(hidden, CacheSettings(block_size=4))}
    assert "source" in kinds or "cache_shortfall" in kinds


def test_the_summary_counts_breaks_and_the_prompts_each_request_sent():
    summary = summarize([segmented(), segmented(rollout_id="g0-r01").model_copy(update={"info": {}})],
                        block_size=4)
    assert summary.history_breaks == 2 and summary.broken_rollouts == 2
    assert summary.prompt_tokens == 2 * (8 + 18 + 7)


def test_the_trainer_gets_one_row_per_segment_with_the_rollouts_advantage():
    rows, info = step_input([segmented(1.0, "g0-r00"), segmented(0.0, "g0-r01", seed=1)], "grpo")
    assert rows.rollout_ids == ["g0-r00", "g0-r00#1", "g0-r01", "g0-r01#1"]
    assert rows.groups == [[0, 1, 2, 3]] and info["rows"] == 4
    assert rows.advantages[0] == rows.advantages[1] > 0 > rows.advantages[2] == rows.advantages[3]
    assert [len(c) for c in rows.columns] == [22, 10, 22, 10]
    assert (rows.columns[1].source == Source.MODEL).sum() == 3


def test_exports_for_trainers_hold_a_row_per_segment_in_one_group(tmp_path):
    import pyarrow.parquet as pq

    result = export_rollouts([segmented(1.0, "g0-r00"), segmented(0.0, "g0-r01", seed=1)], "verl",
                             tmp_path / "out.parquet")
    table = pq.read_table(result.path).to_pylist()
    assert [row["rollout_id"] for row in table] == ["g0-r00", "g0-r00#1", "g0-r01", "g0-r01#1"]
    assert {row["group_size"] for row in table} == {2}
    assert result.line() == f"wrote 4 rows (2 rollouts) (verl) to {result.path}"  # rows and rollouts, each named
    plain = export_rollouts([segmented(1.0, "g0-r00")], "jsonl", tmp_path / "one.jsonl")
    assert plain.line() == f"wrote 1 row (jsonl) to {plain.path}"


def test_the_viewer_marks_where_a_segment_opens():
    rollout = segmented()
    problems = lint_rollout(rollout, CacheSettings(block_size=4))
    texts = [str(t) for t in rollout.tokens.token_id.tolist()]
    detail = rollout_detail(rollout, problems, texts, [False] * len(texts), block_size=4)
    assert [t["opens_segment"] for t in detail["turns"]] == [False, False, True]
    assert [t["segment"] for t in detail["turns"]] == [0, 0, 1]
    assert detail["problems"][0]["position"] == 22
    assert prefill_counts(rollout)[22:].tolist() == [1] * 10  # the new segment was computed once, by turn 2


def test_show_marks_the_history_break_where_the_segment_opens():
    from verbatim.cli.show import transcript

    lines = [line.plain for line in transcript(segmented(), None)]
    mark = next(k for k, line in enumerate(lines) if line.startswith("══ history break"))
    assert lines[mark] == ("══ history break before turn 2: the agent rewrote its history (message 1 (user): "
                           "content differs); a new segment starts here")
    assert "tokens 22–28 (7)" in lines[mark + 1]  # the segment's freshly rendered prompt follows
