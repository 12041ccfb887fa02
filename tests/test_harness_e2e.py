"""End to end on the real engine: every built-in env, traces that lint clean, exports that read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from verbatim.datamodel import Message, Source
from verbatim.engine.protocol import Sampling
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.registry import load_env
from verbatim.harness.export import export_run
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run
from verbatim.harness.summary import RunSummary
from verbatim.lint.trace import lint_run
from verbatim.renderers.registry import get_renderer

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


def play(engine_runner, renderer, factory, out: Path, *, groups=1, group_size=2, max_turns=3, max_tokens=32,
         tasks=None, resume=False) -> RunSummary:
    engine = engine_runner.engine
    plan = RunPlan(run_id=out.name, groups=groups, group_size=group_size, seed=1)
    loop = LoopConfig(max_turns=max_turns, context_budget=engine.config.max_model_len,
                      sampling=Sampling(max_tokens=max_tokens, temperature=1.0), step_timeout_s=30)
    manifest = RunManifest(run_id=out.name, model="smollm2-135m-instruct", renderer="smollm2",
                           engine={"kind": "inproc", "block_size": engine.block_size, "cache_policy": "keep"},
                           config={"plan": plan.model_dump(exclude={"run_id"})})
    run = Run(plan, loop, engine, renderer, factory, tasks or factory.tasks(groups, 1), out, manifest)
    return engine_runner.run(run.play(resume=resume), timeout=900)


def check_run(out: Path, summary: RunSummary, block: int) -> None:
    trace = read_run(out)
    assert trace.problems == []
    report = lint_run(out)
    assert report.ok, [v.as_json() for v in report.verdicts if not v.ok]
    assert summary.prefill_tokens == summary.prompt_tokens - summary.cached_tokens
    assert summary.min_prefill_tokens <= summary.prefill_tokens <= summary.min_prefill_tokens + block * summary.turns
    assert summary.rerender_prefill_tokens is not None and summary.rerender_prefill_tokens >= 0
    for rollout in trace.rollouts:
        cols = rollout.tokens
        model = cols.source == Source.MODEL
        assert np.isfinite(cols.logprob[model]).all() and (cols.policy_version[model] >= 0).all()
        assert rollout.status in ("ok", "truncated", "error")
    for fmt in ("parquet", "jsonl", "verl", "trl", "prime"):
        path = export_run(out, fmt)
        rows = (sum(1 for _ in path.open()) if fmt == "jsonl" else pq.read_table(path).num_rows)
        assert rows >= 1, fmt


@pytest.mark.parametrize("env_name", ["guess", "tools", "python"])
def test_builtin_env_end_to_end(engine_runner, renderer, tmp_path, env_name):
    out = tmp_path / env_name
    summary = play(engine_runner, renderer, load_env(env_name), out, groups=1, group_size=2, max_turns=3)
    assert summary.rollouts == 2 and summary.turns >= 2
    check_run(out, summary, engine_runner.engine.block_size)


def test_longdoc_group_reads_the_shared_document_once(engine_runner, renderer, tmp_path):
    out = tmp_path / "longdoc"
    factory = load_env("longdoc")
    summary = play(engine_runner, renderer, factory, out, groups=1, group_size=4, max_turns=2, max_tokens=24)
    check_run(out, summary, engine_runner.engine.block_size)
    trace = read_run(out)
    first_prompts = [r.tokens.token_id[: r.turns[0].prompt_end] for r in trace.rollouts]
    assert len(first_prompts[0]) > 1000, "the shared document should be long"
    # the followers read the leader's prompt from the cache: the group pays for it about once
    followers = sorted(trace.rollouts, key=lambda r: r.turns[0].cached_tokens)[1:]
    block = engine_runner.engine.block_size
    assert all(r.turns[0].cached_tokens >= (len(first_prompts[0]) - 1) // block * block for r in followers)


class _Broken:
    name = "broken"

    def __init__(self, fail_on: int) -> None:
        self.fail_on, self.turn = fail_on, 0

    def reset(self, task, seed):
        return Reset(messages=(Message(role="user", content=f"Count to {task['n']}."),))

    def step(self, message):
        self.turn += 1
        if self.turn >= self.fail_on:
            raise RuntimeError(f"env exploded on turn {self.turn}")
        return StepResult(messages=(Message(role="user", content="Go on."),), reward=0.5)


class _HalfBroken:
    """Rollout seeds decide: odd members' envs raise in step, the others play normally."""

    name = "halfbroken"

    def __init__(self) -> None:
        self.made = 0

    def make(self):
        self.made += 1
        return _Broken(fail_on=2 if self.made % 2 else 99)

    def tasks(self, count, seed):
        return [{"n": 3 + i} for i in range(count)]


def test_env_errors_are_recorded_and_the_others_complete(engine_runner, renderer, tmp_path):
    out = tmp_path / "broken"
    summary = play(engine_runner, renderer, _HalfBroken(), out, groups=1, group_size=4, max_turns=3,
                   max_tokens=16)
    trace = read_run(out)
    assert summary.rollouts == 4 == len(trace.rollouts)
    errored = [r for r in trace.rollouts if r.status == "error"]
    assert len(errored) == 2
    assert all("env.step raised RuntimeError: env exploded on turn 2" in r.error for r in errored)
    assert all(len(r.turns) == 2 for r in errored)  # the completion that triggered the error is kept
    assert {r.status for r in trace.rollouts if r not in errored} == {"truncated"}
    assert lint_run(out).ok


def test_mismatch_report_on_a_real_run(engine_runner, renderer, tmp_path):
    import json

    from typer.testing import CliRunner

    from verbatim.cli.app import app

    out = tmp_path / "for-mismatch"
    play(engine_runner, renderer, load_env("guess"), out, groups=1, group_size=2, max_turns=2, max_tokens=16)
    plot = tmp_path / "ratios.png"
    result = CliRunner().invoke(app, ["mismatch", str(out), "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model_tokens"] > 0 and report["rollouts"] == 2
    assert report["mean_abs_log_ratio"] < 1e-3  # fp32 engine vs fp32 transformers on the same weights
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = CliRunner().invoke(app, ["mismatch", str(out)])
    assert table.exit_code == 0 and "lag 0" in table.stdout.replace("\n", " ")
