"""Run accounting: the least prefill (design invariant 5's bound) against a brute-force count."""

from __future__ import annotations

from pathlib import Path

from fakes import tiny_rollout
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from verbatim.cli.run import summary_table
from verbatim.harness.summary import min_prefill, summarize

requests = st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=4)),
                    max_size=8)


def brute_force(pairs) -> int:
    """Prefixes as tuples: a prompt token is prefilled unless its prefix was prompted or decoded before."""
    computed: set[tuple[int, ...]] = set()
    total = 0
    for prompt, completion in pairs:
        prefixes = [tuple(prompt[:k]) for k in range(1, len(prompt) + 1)]
        total += max(sum(p not in computed for p in prefixes), 1)
        computed.update(prefixes)
        whole = list(prompt) + list(completion)
        computed.update(tuple(whole[:k]) for k in range(len(prompt) + 1, len(whole)))  # all but the last sampled
    return total


@settings(max_examples=300, deadline=None)
@given(pairs=requests)
def test_min_prefill_equals_brute_force(pairs):
    assert min_prefill(pairs) == brute_force(pairs)


def test_group_and_turn_sharing():
    prompt = list(range(100))
    # a group of 4 sharing a 100-token prompt: each samples 5 tokens, the env adds 10, then a second turn
    pairs = []
    for member in range(4):
        sampled = [500 + member] * 5
        pairs += [(prompt, sampled), (prompt + sampled + [1000 + member] * 10, [7])]
    # the prompt once, each other member's identical first request at least one token, and per second
    # turn the last sampled token (its KV was never computed) plus the 10 new ones
    assert min_prefill(pairs) == 100 + 3 * 1 + 4 * (1 + 10)
    assert min_prefill([(prompt, [])] * 2) == 101


def test_summary_table_and_json_count_solved_rollouts():
    said = [{"env": {"solved": True}}, {"env": {"solved": False}}, {"env": {}}, {}]
    rollouts = [tiny_rollout(i).model_copy(update={"info": info}) for i, info in enumerate(said)]
    summary = summarize(rollouts, block_size=16)
    assert (summary.solved, summary.success_rate) == (1, 0.5)
    assert summary.model_dump()["solved"] == 1
    console = Console(width=120, record=True)
    console.print(summary_table(summary, Path("out")))
    text = console.export_text()
    assert "success_rate" in text and "50.0%" in text and "ok: the env ended the episode" in text
    unsaid = summarize(rollouts[2:], block_size=16)
    assert (unsaid.solved, unsaid.success_rate) == (None, None)


def test_a_failed_rollouts_reward_is_null_and_no_mean_counts_it():
    """One rule (``Rollout``): an error or interrupted rollout holds no reward, whatever its player summed; the
    summary's mean leaves it out and says how many it left out."""
    from verbatim.datamodel import Rollout

    ok = tiny_rollout(0)
    errored = Rollout.model_validate({**ok.model_dump(), "rollout_id": "e", "status": "error", "error": "boom",
                                      "reward": 1.0})
    stopped = Rollout(run_id="r", group_id="g0", rollout_id="i", status="interrupted", error="SIGINT", reward=0.0)
    cut = ok.model_copy(update={"rollout_id": "t", "status": "truncated", "error": "max turns (2) reached before "
                                "the env was done", "reward": None})
    assert errored.reward is None and stopped.reward is None
    summary = summarize([ok, errored, stopped, cut], block_size=16)
    assert summary.mean_reward == 1.0 and summary.rewards_left_out == 3
    assert summary.cut_at_max_turns == 1 and summary.first_error == "boom"


def test_the_outcome_line_says_what_failed_was_cut_or_broke():
    from verbatim.harness.summary import outcome_line

    assert outcome_line({"ok": 4}) is None
    assert outcome_line({"error": 2}, first="the agent raised KeyError: 'x'") == (
        "2 of 2 rollouts failed (2 error: no reward), first: the agent raised KeyError: 'x'")
    assert outcome_line({"ok": 1, "truncated": 2, "interrupted": 1}, cut=2, breaks=1) == (
        "1 of 4 rollouts failed (1 interrupted: no reward); 2 of 4 were cut at --max-turns; 1 history breaks "
        "(agents rewrote their history; 'verbatim lint trace' says where)")


def test_every_field_of_the_summary_is_documented():
    """docs/traces.md's table of the summary names every field ``--summary-json`` writes."""
    from verbatim.harness.summary import RunSummary

    docs = (Path(__file__).resolve().parent.parent / "docs" / "traces.md").read_text()
    table = docs.split("## The run's summary")[1].split("\n## ")[0]
    missing = [name for name in RunSummary.model_fields if f"`{name}`" not in table]
    assert not missing, f"docs/traces.md's summary table lacks {missing}"
