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
