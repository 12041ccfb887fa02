"""bench prefixflow-loop: its table and its refusals (pure parts; the numbers come from a real run, written into
docs/benchmarks.md by the command)."""

from __future__ import annotations

import pytest

import verbatim.bench.prefixflow_loop as loop
from verbatim.errors import BenchmarkError


def _arm(update: float, path: str, tokens: dict) -> dict:
    history = [{"step": n, "version": n, "update_s": update, "policy_s": 2.0, "train_s": update + 2.0,
                "rollout_s": 5.0, "weight_sync_s": 0.5, "checkpoint_s": 0.5, "trainer_path": path,
                "trainer_peak_rss_mib": 1000.0 + update} for n in (1, 2)]
    return {"history": history, "paths": [path], "tokens": tokens, "prompts": [100, 100], "replies": [10, 10]}


def test_the_table_gives_the_update_against_its_flop_ideal_and_counts_the_same_rollouts(monkeypatch):
    arms = {"--no-prefixflow": _arm(8.0, "plain", {"a": [1, 2], "b": [1, 3]}),
            "--prefixflow": _arm(2.0, "prefixflow", {"a": [1, 2], "b": [1, 4]})}
    monkeypatch.setattr(loop, "run_arm", lambda work, switch, out: arms[switch])
    result = loop.measure(loop.LoopWork(group_size=2))
    assert result["same_rollouts"] == 1 and result["rollouts"] == 2
    assert result["ideal"]["prefix_tokens"] == 100 and result["ideal"]["reply_tokens"] == 10
    table = loop.markdown(result, "verbatim bench prefixflow-loop")
    assert "| measured | 4.00x | 2.50x | 1.60x |" in table  # update 8/2, trainer 10/4, step 16/10
    assert f"| share of the ideal | {4.0 / result['ideal']['flop_ideal']:.0%} |" in table
    assert "up to 4.395x" in table and "1 of 2 rollouts were token for token the same" in table


def test_arms_that_did_not_switch_prefixflow_make_no_table(monkeypatch):
    monkeypatch.setattr(loop, "run_arm", lambda work, switch, out: _arm(1.0, "plain", {}))
    with pytest.raises(BenchmarkError, match="PrefixFlow did not switch as asked"):
        loop.measure(loop.LoopWork())
