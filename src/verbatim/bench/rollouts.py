"""``verbatim bench rollouts``: verbatim against a re-rendering baseline, same engine, same sampling.

Two workloads of the prefix-reuse argument, each played by both harnesses on a
cold prefix cache: a group of G rollouts sharing one long prompt, and rollouts
of many turns. Prefill tokens are the engine's own numbers (prompt − cached).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from verbatim.bench import docsection, machine
from verbatim.bench.baseline import baseline_run
from verbatim.bench.engines import Say, engine_log, quiet, started
from verbatim.bench.failures import require_clean
from verbatim.bench.think_first import EngineCall, ThinkFirst, call_counts
from verbatim.bench.training_view import ViewMismatch, baseline_view, verbatim_view
from verbatim.datamodel import Frozen, Message
from verbatim.engine.protocol import Sampling
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.registry import load_env
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan, plan_specs
from verbatim.harness.store import RunManifest, read_run
from verbatim.harness.tiny_models import write_tiny_model


class HarnessResult(Frozen):
    harness: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    min_prefill_tokens: int
    generated_tokens: int
    wall_s: float
    trained_tokens: int = 0
    sampled_tokens: int = 0
    mean_abs_log_ratio: float = 0.0
    """Trainer (transformers fp32) vs sampler logprob on the sampled tokens the trainer's sequence keeps."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class Scenario(Frozen):
    name: str
    env: str
    groups: int
    group_size: int
    max_turns: int
    max_tokens: int
    env_options: dict[str, Any] = {}
    renderer: str = "smollm2"
    think_regex: str | None = None
    """Make every reply open with a think block matching this (see bench/think_first.py)."""
    tiny_family: str | None = None
    """Play on a small random model of this family (``verbatim models tiny``: its real tokenizer), not the
    benchmark's model: a renderer needs its own family's tokenizer."""


SCENARIOS = (
    Scenario(name="group of 16 sharing one long prompt", env="longdoc", groups=1, group_size=16, max_turns=1,
             max_tokens=16, env_options={"words": 2000}),
    Scenario(name="rollouts of 10 turns", env="dialogue", groups=2, group_size=2, max_turns=10, max_tokens=24),
    # The Qwen3 chat format on a small random Qwen3 model with Qwen's own tokenizer (its <think> tokens); a
    # regex makes every reply open with a think block, as a reasoning model does; the answer after it is
    # sampled freely. The template strips earlier reasoning on re-render.
    Scenario(name="Qwen3 template, reasoning in every turn", env="dialogue", groups=2, group_size=2,
             max_turns=4, max_tokens=64, env_options={"turns": 4}, renderer="qwen3",
             think_regex=r"<think>\n[a-z ,.]{10,80}\n</think>\n\n", tiny_family="qwen3"),
)


class _Dialogue:
    """Workload env: a user who keeps asking short follow-up questions for a fixed number of turns."""

    name = "dialogue"
    _QUESTIONS = ("Why?", "Give an example.", "Say it more simply.", "What else?", "Is that always true?",
                  "How would you test it?", "Summarise in one line.", "What is a common mistake?",
                  "Any exception?", "Thanks. Last point?")

    def __init__(self, turns: int = 10) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        return Reset(messages=(Message(role="system", content="You are a concise tutor."),
                               Message(role="user", content=f"Explain {task['topic']} briefly.")))

    def step(self, message: Message) -> StepResult:
        self.seen += 1
        reply = Message(role="user", content=self._QUESTIONS[(self.seen - 1) % len(self._QUESTIONS)])
        return StepResult(messages=(reply,), reward=float(bool(message.content.strip())),
                          done=self.seen >= self.turns)


class DialogueFactory:
    name = "dialogue"
    _TOPICS = ("prefix caching", "binary search", "photosynthesis", "compound interest", "hash tables")

    def __init__(self, turns: int = 10) -> None:
        self.turns = turns

    def make(self) -> _Dialogue:
        return _Dialogue(self.turns)

    def tasks(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"topic": self._TOPICS[(seed + i) % len(self._TOPICS)]} for i in range(count)]


def _factory(scenario: Scenario) -> Any:
    if scenario.env == "dialogue":
        return DialogueFactory(**scenario.env_options)
    return load_env(scenario.env, **scenario.env_options)


async def _verbatim(engine: Any, renderer: Any, scenario: Scenario, loop: LoopConfig, out: Path,
                   trainer_model: Any | None) -> HarnessResult:
    factory = _factory(scenario)
    plan = RunPlan(run_id="bench", groups=scenario.groups, group_size=scenario.group_size, seed=3)
    run = Run(plan, loop, engine, renderer, factory, factory.tasks(scenario.groups, 3), out,
              RunManifest(run_id="bench", engine={"block_size": engine.block_size}))
    summary = await run.play()
    rollouts = read_run(out).rollouts
    require_clean(f"{scenario.name}, verbatim: rollouts", [r.error if r.status == "error" else None
                                                          for r in rollouts])
    counts = {"requests": summary.turns, "prompt_tokens": summary.prompt_tokens,
              "cached_tokens": summary.cached_tokens, "prefill_tokens": summary.prefill_tokens,
              "min_prefill_tokens": summary.min_prefill_tokens}
    result = HarnessResult(harness="verbatim", **engine_counts(engine, counts),
                           generated_tokens=summary.generated_tokens, wall_s=summary.wall_s)
    if trainer_model is None:
        return result
    view = await asyncio.to_thread(verbatim_view, rollouts, trainer_model, getattr(engine, "constrained", None))
    return result.model_copy(update=view.model_dump())


async def _baseline(engine: Any, renderer: Any, scenario: Scenario, loop: LoopConfig,
                    trainer_model: Any | None) -> HarnessResult:
    started = time.perf_counter()
    rollouts = await _play_baseline(engine, renderer, scenario, loop, "bench", "re-render baseline")
    wall_s = time.perf_counter() - started
    requests = [r for rollout in rollouts for r in rollout.requests]
    counts = call_counts(EngineCall(r.prompt_ids, r.completion_ids, r.cached_tokens) for r in requests)
    result = HarnessResult(harness="re-render baseline", **engine_counts(engine, counts),
                           generated_tokens=sum(r.generated_tokens for r in requests), wall_s=wall_s)
    if trainer_model is None:
        return result
    view = await asyncio.to_thread(baseline_view, rollouts, renderer, trainer_model, tuple(renderer.stop_token_ids),
                                   getattr(engine, "constrained", None))
    return result.model_copy(update=view.model_dump())


async def _warm_up(engine: Any, renderer: Any, scenario: Scenario, loop: LoopConfig) -> None:
    """The workload once, untimed: whichever harness ran first would otherwise pay the engine's one-time
    costs for the workload's shapes (kernels for a long prefill, the regex's grammar) alone."""
    await _play_baseline(engine, renderer, scenario, loop, "warm-up", "warm-up")


async def _play_baseline(engine: Any, renderer: Any, scenario: Scenario, loop: LoopConfig, run_id: str,
                         label: str) -> list[Any]:
    """The scenario's groups played the re-rendering way; any failed rollout is a :class:`BenchmarkError`."""
    factory = _factory(scenario)
    plan = RunPlan(run_id=run_id, groups=scenario.groups, group_size=scenario.group_size, seed=3)
    rollouts = await baseline_run(engine, renderer, factory, plan_specs(plan, factory.tasks(scenario.groups, 3)),
                                  loop, plan.concurrency)
    require_clean(f"{scenario.name}, {label}: rollouts", [r.error for r in rollouts])
    return rollouts


def engine_counts(engine: Any, harness_counts: dict[str, int]) -> dict[str, int]:
    """Per engine call: the wrapper's own record where a turn makes several calls, else the harness's counts."""
    return call_counts(engine.calls) if isinstance(engine, ThinkFirst) else harness_counts


async def measure(engine: Any, tokenizer: Any, trainer_model: Any, scenarios=SCENARIOS,
                  say: Say = quiet, repeats: int = 1) -> list[tuple[Scenario, list[HarnessResult]]]:
    """Both harnesses on each scenario, on ``engine`` (cold prefix cache for each), ``repeats`` times in turn;
    each harness's row is its fastest pass (other work on the machine only ever slows a pass down)."""
    from verbatim.renderers.registry import get_renderer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, scenario in enumerate(scenarios):
            renderer = get_renderer(scenario.renderer, tokenizer=tokenizer)
            loop = LoopConfig(max_turns=scenario.max_turns, context_budget=engine.config.max_model_len,
                              sampling=Sampling(max_tokens=scenario.max_tokens, temperature=1.0, seed=7))
            say(f"{scenario.name}: warming the engine up…")
            await _warm_up(_wrap(engine, scenario, renderer), renderer, scenario, loop)
            mine, theirs = [], []
            for k in range(repeats):
                judge = trainer_model if k == 0 else None  # the trainer's view of the first pass only
                await engine.reset_prefix_cache()
                say(f"{scenario.name}: verbatim ({k + 1} of {repeats})…")
                mine.append(await _verbatim(_wrap(engine, scenario, renderer), renderer, scenario, loop,
                                            Path(tmp) / f"run{i}-{k}", judge))
                await engine.reset_prefix_cache()
                say(f"{scenario.name}: re-render baseline ({k + 1} of {repeats})…")
                theirs.append(await _baseline(_wrap(engine, scenario, renderer), renderer, scenario, loop, judge))
            results.append((scenario, [fastest(mine), fastest(theirs)]))
    return results


VIEW = tuple(ViewMismatch.model_fields)
"""The columns of the trainer's view of the traces, measured on the first pass only."""


def fastest(passes: list[HarnessResult]) -> HarnessResult:
    """A harness's fastest pass of a workload, with the first pass's trainer view."""
    best = min(passes, key=lambda result: result.wall_s)
    return best.model_copy(update={key: getattr(passes[0], key) for key in VIEW})


def _wrap(engine: Any, scenario: Scenario, renderer: Any) -> Any:
    if scenario.think_regex is None:
        return engine
    return ThinkFirst(engine, scenario.think_regex, tuple(renderer.stop_token_ids))


def markdown(results: list[tuple[Scenario, list[HarnessResult]]]) -> str:
    lines = ["| workload | harness | requests | prompt tokens | cached | prefill | min prefill | wall s | "
             "wall vs verbatim | gen tok/s | prefill vs verbatim | sampled tokens kept for training | "
             "mean abs(log π − log μ) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scenario, rows in results:
        base, wall = rows[0].prefill_tokens or 1, rows[0].wall_s or 1e-9
        for row in rows:
            lines.append(f"| {scenario.name} | {row.harness} | {row.requests} | {row.prompt_tokens} | "
                         f"{row.cached_tokens} | {row.prefill_tokens} | {row.min_prefill_tokens} | "
                         f"{row.wall_s:.1f} | {row.wall_s / wall:.2f}x | {row.tokens_per_s:.1f} | "
                         f"{row.prefill_tokens / base:.2f}x | "
                         f"{row.trained_tokens} / {row.sampled_tokens} | {row.mean_abs_log_ratio:.2e} |")
    return "\n".join(lines)


def run_bench(model: str = "default", command: str = "verbatim bench rollouts", say: Say = quiet,
              scenarios: tuple[Scenario, ...] = SCENARIOS, repeats: int = 1) -> str:
    """Every scenario on its model (the benchmark's, or a tiny family's), one engine per model at a time."""
    results: list[tuple[Scenario, list[HarnessResult]]] = []
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in dict.fromkeys(s.tiny_family for s in scenarios):
            mine = tuple(s for s in scenarios if s.tiny_family == family)
            folder = model if family is None else str(write_tiny_model(family, Path(tmp) / family, seed=0))
            found, name = asyncio.run(_on_model(folder, mine, say, family or "engine", repeats))
            results += found
            names.append(name if family is None else f"a random tiny {family} for its workload")
    order = {s.name: i for i, s in enumerate(scenarios)}
    table = markdown(sorted(results, key=lambda r: order[r[0].name]))
    note = (f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}, {', '.join(names)}, fp32; temperature 1, "
            f"each harness on a cold prefix cache after one untimed pass of the workload; {_passes(repeats)}). "
            "Requests, "
            "prompt, cached and prefill tokens count engine calls: the reasoning workload makes two per turn (the "
            "think block, then the answer, whose prompt holds the think block).")
    return table + note


def _passes(repeats: int) -> str:
    if repeats == 1:
        return "one pass each"
    return (f"the fastest of {repeats} passes each, the two harnesses in turn; the last two columns from the first "
            "pass")


async def _on_model(model: str, scenarios: tuple[Scenario, ...], say: Say, label: str,
                    repeats: int = 1) -> tuple[list[tuple[Scenario, list[HarnessResult]]], str]:
    from transformers import AutoTokenizer

    from verbatim.engine.inproc import InprocEngine
    from verbatim.engine.runtime import EngineConfig
    from verbatim.trainer.reference import load_model

    engine = InprocEngine(EngineConfig(model=model, kv_cache_gib=2, max_model_len=4096))
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    trainer_model = load_model(engine.model_dir)
    async with started(engine, engine_log("rollouts"), say, label):
        found = await measure(engine, tokenizer, trainer_model, scenarios, say, repeats)
    return found, f"{engine.model_dir.name} (block size {engine.block_size})"


SECTION = "bench-rollouts"
LIBRARIES = machine.ENGINE_LIBRARIES


def write_section(doc: Path, table: str, *, machine_line: str | None = None) -> None:
    """Replace the rollouts section of ``doc`` (its ``bench-rollouts`` markers)."""
    docsection.write_section(doc, SECTION, table, libraries=LIBRARIES, machine_line=machine_line)
