"""bench rollouts: table shape and the docs section it rewrites (pure parts; the numbers come from a real run)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from verbatim.bench.rollouts import SCENARIOS, DialogueFactory, HarnessResult, engine_counts, markdown, write_section
from verbatim.bench.think_first import ThinkFirst, call_counts
from verbatim.datamodel import Completion
from verbatim.engine.protocol import Sampling
from verbatim.errors import InputError


def _row(name: str, prefill: int) -> HarnessResult:
    return HarnessResult(harness=name, requests=4, prompt_tokens=1000, cached_tokens=1000 - prefill,
                         prefill_tokens=prefill, min_prefill_tokens=200, generated_tokens=50, wall_s=2.0)


def test_table_reports_the_ratio_against_verbatim():
    table = markdown([(SCENARIOS[0], [_row("verbatim", 250), _row("re-render baseline", 1000)])])
    lines = table.splitlines()
    assert len(lines) == 4
    assert "| 2.0 | 1.00x | 25.0 | 1.00x |" in lines[2] and "| 2.0 | 1.00x | 25.0 | 4.00x |" in lines[3]
    assert lines[0].count("|") == lines[2].count("|")
    assert "| 25.0 |" in lines[2]  # generated tokens per second


def test_section_is_replaced_between_its_markers_only(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Renderers\n\nkeep me\n")
    with pytest.raises(InputError, match="bench-rollouts:begin"):
        write_section(doc, "| first |", machine_line="M.")
    doc.write_text("# Benchmarks\n\nkeep me\n\n<!-- bench-rollouts:begin -->\n<!-- bench-rollouts:end -->\n\nafter\n")
    write_section(doc, "| first |", machine_line="M.")
    write_section(doc, "| second |", machine_line="M.")
    text = doc.read_text()
    assert "keep me" in text and "| second |\n\nM.\n<!-- bench-rollouts:end -->\n\nafter\n" in text
    assert "| first |" not in text


class _Engine:
    """Answers every request with ``reply`` tokens; the prefix cache holds all but the last 3 prompt tokens."""

    def __init__(self, reply: tuple[int, ...]) -> None:
        self.reply, self.prompts = reply, []

    async def generate(self, prompt_ids, sampling=None, **route) -> Completion:
        self.prompts.append(list(prompt_ids))
        n = len(self.reply)
        return Completion(token_ids=np.array(self.reply), logprobs=np.zeros(n), versions=np.zeros(n),
                          finish_reason="stop", prompt_tokens=len(prompt_ids), cached_tokens=len(prompt_ids) - 3)


def test_reasoning_workload_counts_both_engine_calls_of_a_turn():
    think = ThinkFirst(_Engine((7, 8, 9, 2)), r"<think>.*", stop_ids=(2,))  # the think block ends with EOS (2)

    async def two_turns():
        first = await think.generate([1] * 10, Sampling(max_tokens=16), session_id="s")
        await think.generate([1] * 10 + list(first.token_ids) + [5] * 4, Sampling(max_tokens=16), session_id="s")

    asyncio.run(two_turns())
    # per turn: think (prompt P), answer (prompt P + 3 think tokens); turn 2's P = 10 + 3 + 4 + 4 + 4 = 21
    prompts = [len(p) for p in think.engine.prompts]
    assert prompts == [10, 13, 21, 24]
    counts = engine_counts(think, {"requests": 2})
    assert counts["requests"] == 4 and counts["prompt_tokens"] == 68
    assert counts["cached_tokens"] == 68 - 4 * 3 and counts["prefill_tokens"] == 12
    assert counts == call_counts(think.calls) and 0 < counts["min_prefill_tokens"] <= 21 + 4
    assert engine_counts(object(), {"requests": 2}) == {"requests": 2}  # unwrapped: the harness's own counts


def test_dialogue_workload_lasts_exactly_its_turns():
    from verbatim.datamodel import Message

    env = DialogueFactory().make()
    env.reset(DialogueFactory().tasks(1, 0)[0], 0)
    done = [env.step(Message(role="assistant", content="ok")).done for _ in range(10)]
    assert done == [False] * 9 + [True]


@pytest.mark.parametrize("command", ["rollouts", "policies", "logprobs", "router", "prefixflow", "render"])
def test_every_bench_refuses_a_write_target_without_its_section_before_any_work(tmp_path, command):
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    missing = CliRunner().invoke(app, ["bench", command, "--write", str(tmp_path / "nope.md")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    doc = tmp_path / "plain.md"
    doc.write_text("# Plain\n")
    unmarked = CliRunner().invoke(app, ["bench", command, "--write", str(doc)])
    assert unmarked.exit_code == 2 and ":begin -->" in unmarked.output and "add those two lines" in unmarked.output
    assert len(unmarked.output.strip().splitlines()) == 1 and doc.read_text() == "# Plain\n"


def test_logprob_agreement_table_has_a_row_per_dtype_and_names_its_command():
    from verbatim.bench.policy_report import agreement_table

    results = [{"dtype": "float32", "tokens": 152, "max_abs": 6.6e-5, "mean_abs": 5.6e-6, "p99_abs": 3.2e-5},
               {"dtype": "bfloat16", "tokens": 160, "max_abs": 0.21, "mean_abs": 0.036, "p99_abs": 0.16}]
    table = agreement_table(results, "smollm2", "verbatim bench logprobs --dtype float32 --dtype bfloat16")
    lines = table.splitlines()
    assert lines[2] == "| float32 | 152 | 5.6e-06 | 3.2e-05 | 6.6e-05 |"
    assert lines[3] == "| bfloat16 | 160 | 0.036 | 0.16 | 0.21 |"
    assert "`verbatim bench logprobs --dtype float32 --dtype bfloat16`" in table and "smollm2" in table


def test_a_benchmark_over_failed_rollouts_is_an_error_that_names_them():
    from verbatim.bench.failures import require_clean
    from verbatim.errors import BenchmarkError

    require_clean("group, verbatim: rollouts", [None, None])
    with pytest.raises(BenchmarkError) as caught:
        require_clean("group, verbatim: rollouts", [None, "bridge: no token '<think>'", "bridge: no token '<think>'",
                                                    "engine down"])
    line = caught.value.message
    assert line.startswith("group, verbatim: rollouts: 3 of 4 failed, so no table:")
    assert "bridge: no token '<think>' (×2)" in line and "engine down" in line


def test_the_baseline_records_a_failed_rollout_instead_of_raising():
    from verbatim.bench.baseline import baseline_run
    from verbatim.errors import EngineError
    from verbatim.harness.rollout import LoopConfig
    from verbatim.harness.run import RunPlan, plan_specs
    from verbatim.renderers.registry import get_renderer

    class Broken:
        async def generate(self, *args, **kwargs):
            raise EngineError("vLLM request failed: boom")

    factory = DialogueFactory(turns=2)
    groups = plan_specs(RunPlan(run_id="b", groups=1, group_size=2, seed=0), factory.tasks(1, 0))
    renderer = get_renderer("qwen3")
    loop = LoopConfig(max_turns=2, context_budget=4096, sampling=Sampling(max_tokens=4))
    rollouts = asyncio.run(baseline_run(Broken(), renderer, factory, groups, loop, concurrency=4))
    assert [r.error for r in rollouts] == ["vLLM request failed: boom"] * 2
    assert all(not r.requests for r in rollouts)


def test_the_reasoning_workload_plays_on_its_own_familys_tokenizer():
    reasoning = [s for s in SCENARIOS if s.think_regex]
    assert reasoning and all(s.tiny_family == "qwen3" and s.renderer == "qwen3" for s in reasoning)


def test_repeats_alternate_the_harnesses_on_a_cold_cache_and_keep_each_ones_fastest_pass(monkeypatch):
    """The trainer's view (the last two columns) is measured on the first pass only."""
    from types import SimpleNamespace

    from verbatim.bench import rollouts

    calls, walls = [], {"verbatim": iter([3.0, 1.0, 2.0]), "re-render baseline": iter([5.0, 6.0, 4.0])}

    def play(name):
        async def played(*args):
            judged = args[-1] is not None
            calls.append(name + (" judged" if judged else ""))
            view = {"trained_tokens": 7, "sampled_tokens": 9, "mean_abs_log_ratio": 0.5} if judged else {}
            return _row(name, 250).model_copy(update={"wall_s": next(walls[name]), **view})
        return played

    async def warm_up(*args):
        calls.append("warm-up")

    class Engine:
        config = SimpleNamespace(max_model_len=4096)

        async def reset_prefix_cache(self):
            calls.append("reset")

    monkeypatch.setattr(rollouts, "_verbatim", play("verbatim"))
    monkeypatch.setattr(rollouts, "_baseline", play("re-render baseline"))
    monkeypatch.setattr(rollouts, "_warm_up", warm_up)
    monkeypatch.setattr("verbatim.renderers.registry.get_renderer", lambda name, tokenizer: None)
    found = asyncio.run(rollouts.measure(Engine(), None, "trainer", SCENARIOS[:1], repeats=3))
    assert calls == (["warm-up", "reset", "verbatim judged", "reset", "re-render baseline judged"]
                     + ["reset", "verbatim", "reset", "re-render baseline"] * 2)
    (scenario, (mine, theirs)), = found
    assert scenario == SCENARIOS[0] and (mine.wall_s, theirs.wall_s) == (1.0, 4.0)
    assert (mine.trained_tokens, theirs.sampled_tokens, theirs.mean_abs_log_ratio) == (7, 9, 0.5)  # the first pass's
