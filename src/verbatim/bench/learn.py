"""``verbatim bench learn``: proof that ``verbatim train`` learns, and what the correction is for.

The task is the built-in ``guess`` game made small: a number from 1 to 5, three guesses, higher/lower
feedback, three turns at most. Why it suits a 135M model on two CPU cores:

* the default model succeeds sometimes but rarely at step 0 (it mostly replies with prose that holds
  no number, which costs a guess): 8% of 128 games with these settings, so about half the groups of
  eight hold a win and group-relative advantages have signal from the first step;
* the game's text names no number but the range's bounds (counts are words), so echoing the prompt
  is not a strategy. With counts in digits it was: one seed learned to echo "You have 3 guesses…",
  which `guess` read as 3, 2, 1, and stalled near 0.5 (the run of 2026-12-01 in git history);
* the reward can climb far: answering with a bare number in range already gives 3/5 by chance, and
  using the feedback gives 1.0, so "learned" is a large, unambiguous change, not noise;
* turns are short (12 sampled tokens), so a step of 32 rollouts takes seconds and a run of tens of
  steps fits in minutes.

Settings: 4 groups of 8 per step (a group of 8 gives GRPO a better baseline than 4, and a step's
32 rollouts a less noisy gradient and reward), lr 3e-5 on a cosine schedule down to a tenth at the
last step. A first version (4 groups of 4, constant lr 2e-5) learned to about 0.6 by step 20 in both
seeds, then sagged, and one seed's last five steps ended only +0.175 above its first five.

Runs (each ``verbatim train``'s own run, :func:`~verbatim.jobs.train.run_training` of a
:class:`~verbatim.jobs.config.TrainConfig`, on a fresh in-process engine):
two seeds synchronous and on-policy (``max_lag 0``, ``keep+salt``); then the ablation, one seed
with ``max_lag 2`` and ``keep`` (stale tokens and hybrid KV) with the default correction and with
none; and every seed again with a trainer fed re-rendered contexts (rl/rerendered.py: the
chat template over each rollout's messages, as a message-keeping harness trains, without sampler
logprobs) and with only the re-render's addition to the traced tokens: a trained stop token after
each reply cut by max tokens. The verdict compares the mean reward of the last five steps with the
first five. Every run also evaluates on held-out tasks (``--eval-every``: before the first step and after the
last): guess's held-out part, the target training never draws (3 in 1..5, envs/held_out.py), so the table
says whether what a run learned carries over to a game it never trained on, beside its training reward.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from verbatim.bench.failures import require_clean
from verbatim.bench.learn_repeats import ON_POLICY, by_setting, setting_of
from verbatim.bench.learn_repeats import markdown as repeats_markdown
from verbatim.datamodel import Frozen
from verbatim.durable import strict_json
from verbatim.engine.protocol import CachePolicy
from verbatim.errors import InputError, TrainerError
from verbatim.harness.metrics_log import read_metrics
from verbatim.harness.step_metrics import StepMetrics, is_trained, steps_of
from verbatim.jobs.config import EngineChoice, Placement, PlaySource, TrainConfig, TrainOutput, TrainSampling
from verbatim.rl.plan import EvalPlan, TrainPlan
from verbatim.trainer.learner_config import CorrectionConfig, LearnerConfig, LoraConfig

SECTION = "bench-learn"
EXAMPLE_SECTION = "train-example"
ENV_ARGS = {"high": 5, "max_guesses": 3}
WINDOW = 5
GOAL = 0.2
NO_CORRECTION = CorrectionConfig(token_tis_cap=None, token_mask_band=None, version_lag_mask=False)


class LearnRun(Frozen):
    """One training run of the benchmark: a setting, with one seed."""

    label: str
    seed: int
    setting: str = ON_POLICY
    """What the run varies (``ON_POLICY`` or an ablation); its repeats share it and differ only by seed."""
    max_lag: int = 0
    cache_policy: CachePolicy = CachePolicy.KEEP_SALT
    correction: bool = True
    context: Literal["traced", "rerendered", "closed"] = "traced"
    sync: Literal["memory", "folder"] = "memory"
    """How the weights reach the engine: the in-process push (shared memory), or a published folder the
    engine reloads from disk (the served path; ``bench step``'s "before")."""
    checkpoint_every: int = 10
    lora_rank: int | None = None
    """Train a LoRA adapter of this rank instead of the whole model (docs/trainer.md)."""
    lr: float | None = None
    """The run's learning rate where it is not the settings' (a LoRA adapter's)."""


class LearnSettings(Frozen):
    steps: int = 40
    groups: int = 4
    group_size: int = 8
    max_turns: int = 3
    max_tokens: int = 12
    lr: float = 3e-5
    lr_schedule: str = "cosine"
    lr_final: float = 0.1
    eval_groups: int = 8
    """Held-out tasks evaluated before the first step and after the last (guess's held-out target); 0: none
    (bench step, which times the steps alone)."""
    eval_samples: int = 4
    """Samples per held-out task (K of pass@K)."""


ABLATIONS = {
    "lag 2 · keep · correction": {"max_lag": 2, "cache_policy": CachePolicy.KEEP},
    "lag 2 · keep · no correction": {"max_lag": 2, "cache_policy": CachePolicy.KEEP, "correction": False},
    "re-rendered context": {"context": "rerendered"},
    "cut replies closed": {"context": "closed"},
    "LoRA rank 16 · lr 3e-4": {"lora_rank": 16, "lr": 3e-4},
}
"""Each ablation's settings, beside the on-policy run's."""


def learn_seeds(seeds: list[int] | None, repeats: int | None) -> list[int]:
    """The seeds every setting runs with: ``--seed`` values, the first ``--repeats`` of them, 0..K-1 for
    ``--repeats K`` alone, or 0 and 1."""
    if repeats is None:
        return list(seeds or [0, 1])
    if seeds and len(seeds) < repeats:
        raise InputError(f"--repeats {repeats} needs {repeats} seeds; --seed gave {len(seeds)}",
                         hint="give more --seed values, or none (seeds 0..K-1)")
    return list(seeds[:repeats]) if seeds else list(range(repeats))


def plan_runs(seeds: list[int], ablation: bool) -> list[LearnRun]:
    """Every setting with every seed: the on-policy runs first, then each ablation's."""
    runs = [LearnRun(label=f"seed {s}", seed=s) for s in seeds]
    if ablation:
        runs += [LearnRun(label=f"seed {s} · {name}", seed=s, setting=name, **changes)
                 for name, changes in ABLATIONS.items() for s in seeds]
    return runs


def run_folder(run: LearnRun, root: Path) -> Path:
    """Where a run of the benchmark writes its trace and metrics under the benchmark's temporary folder."""
    return root / run.label.replace(" ", "").replace("·", "-")


def train_run(run: LearnRun, settings: LearnSettings, model: str, root: Path) -> dict[str, Any]:
    """Train once, through ``verbatim train``'s entry point; the run's metrics per step and its wall time."""
    from rich.console import Console

    from verbatim.jobs.train import run_training

    started = time.perf_counter()
    ended: list[Any] = []
    history = run_training(train_config(run, settings, model, run_folder(run, root)), Console(stderr=True, quiet=True),
                           on_end=ended.append)
    return {"run": run.model_dump(mode="json"), "history": history, "wall_s": time.perf_counter() - started,
            "share_s": ended[0].share_s if ended else 0.0}


def train_config(run: LearnRun, settings: LearnSettings, model: str, out: Path) -> TrainConfig:
    """The config of one run of the benchmark: ``verbatim train``'s, with the run's setting."""
    correction = CorrectionConfig() if run.correction else NO_CORRECTION
    return TrainConfig(
        play=PlaySource(env="guess", env_args=ENV_ARGS, max_turns=settings.max_turns),
        sampling=TrainSampling(max_tokens=settings.max_tokens, temperature=1.0),
        engine=EngineChoice(model=model, max_model_len=2048, kv_cache_gib=1), output=TrainOutput(out=str(out)),
        placement=Placement(weight_sync=run.sync),
        plan=TrainPlan(steps=settings.steps, groups=settings.groups, group_size=settings.group_size, seed=run.seed,
                       max_lag=run.max_lag, cache_policy=run.cache_policy, keep_checkpoints=1, context=run.context,
                       checkpoint_every=run.checkpoint_every),
        learner=LearnerConfig(lr=run.lr or settings.lr, lr_schedule=settings.lr_schedule, lr_final=settings.lr_final,
                              correction=correction, lora=LoraConfig(rank=run.lora_rank)),
        evaluation=EvalPlan(eval_every=settings.steps, eval_groups=settings.eval_groups,
                            eval_samples=settings.eval_samples) if settings.eval_groups else EvalPlan())


def trained_lines(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's lines of trained steps (not step 0's, the evaluation before the first step)."""
    return [line for line in history if is_trained(line)]


def trained(history: list[dict[str, Any]]) -> list[StepMetrics]:
    """:func:`trained_lines` as typed steps."""
    return steps_of(trained_lines(history))


def held_out(history: list[dict[str, Any]], samples: int) -> dict[str, float | None]:
    """Held-out pass@1 and pass@K before the first step and after the last (None where not evaluated)."""
    evaluated = [r.eval for r in steps_of(history) if r.eval is not None]
    figures: dict[str, float | None] = {}
    for when, found in (("before", evaluated[0] if evaluated else None),
                        ("after", evaluated[-1] if len(evaluated) > 1 else None)):
        passes = (found or {}).get("pass_at_k") or {}
        figures[f"pass1_{when}"], figures[f"passk_{when}"] = passes.get("1"), passes.get(str(samples))
    return figures


def gain(history: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Mean reward of the first and the last ``WINDOW`` steps, and the difference."""
    rewards = [r.reward_mean or 0.0 for r in trained(history)]
    if len(rewards) < 2 * WINDOW:
        raise InputError(f"--steps must be at least {2 * WINDOW} to compare the first and last {WINDOW} steps")
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    return first, last, last - first


def require_clean_runs(results: list[dict[str, Any]]) -> None:
    """No table over a run whose steps recorded an errored rollout (bench/failures.py)."""
    for result in results:
        history = trained(result["history"])
        errors = [f"step {r.step} had an errored rollout (its trace says why)"
                  for r in history for _ in range(r.errors)]
        require_clean(f"{result['run']['label']}: rollouts", errors, total=sum(r.rollouts for r in history))


def row(result: dict[str, Any]) -> dict[str, Any]:
    history = trained(result["history"])
    first, last, delta = gain(result["history"])
    rerendered = result["run"].get("context") == "rerendered"  # its π_old stands in for μ: no mismatch to show
    mismatch = [] if rerendered else [r.mismatch_mean_abs for r in history if r.mismatch_mean_abs is not None]
    dropped = [r.dropped["any"] for r in history if r.dropped]
    return {"run": result["run"]["label"], "first": first, "last": last, "gain": delta,
            "mismatch": sum(mismatch) / len(mismatch) if mismatch else None,
            "dropped": sum(dropped) / len(dropped) if dropped else 0.0,
            "hybrid": sum(r.hybrid_tokens for r in history),
            "cache_hit": sum(r.cache_hit_rate or 0.0 for r in history) / len(history),
            "wall_min": result["wall_s"] / 60,
            **held_out(result["history"], result.get("settings", {}).get("eval_samples", 0))}


def verdict(results: list[dict[str, Any]]) -> str:
    seeds = [row(r) for r in results if setting_of(r) == ON_POLICY]
    gains = ", ".join(f"{s['gain']:+.3f}" for s in seeds)
    met = all(s["gain"] >= GOAL for s in seeds) and len(seeds) >= 2
    return (f"Goal (last {WINDOW} steps' mean reward at least {GOAL} above the first {WINDOW} in every seed): "
            f"{'met' if met else 'NOT met'} (gains {gains}).")


def markdown(results: list[dict[str, Any]], settings: LearnSettings, command: str, image: str | None) -> str:
    """With repeats (a setting run with more than one seed), first each setting's mean ± sd and verdict
    (bench/learn_repeats.py), then every run."""
    grouped = by_setting(results, row)
    repeated = any(len(rows) > 1 for rows in grouped.values())
    k = settings.eval_samples
    head = repeats_markdown(grouped, WINDOW, k) + "\nEvery run:\n\n" if repeated else ""
    lines = [f"| run | first {WINDOW} steps | last {WINDOW} steps | gain | held-out pass@1 | held-out pass@{k} "
             "| mean \\|Δ logp\\| | dropped | hybrid tokens | cache hit | minutes |", "|" + "---|" * 11]
    for r in map(row, results):
        mismatch = "–" if r["mismatch"] is None else f"{r['mismatch']:.1e}"
        lines.append(f"| {r['run']} | {r['first']:.3f} | {r['last']:.3f} | {r['gain']:+.3f} | "
                     f"{before_after(r, 'pass1')} | {before_after(r, 'passk')} | {mismatch} | "
                     f"{r['dropped']:.1%} | {r['hybrid']} | {r['cache_hit']:.0%} | {r['wall_min']:.1f} |")
    text = head + "\n".join(lines) + "\n\n" + verdict(results) + "\n" + rerender_note(results)
    if image:
        text += f"\n![reward per step]({image})\n"
    s = settings
    text += (f"\nMeasured by `{command}`: guess 1..{ENV_ARGS['high']} with {ENV_ARGS['max_guesses']} guesses, "
             f"{s.steps} steps × {s.groups} groups × {s.group_size} rollouts, ≤ {s.max_turns} turns of ≤ "
             f"{s.max_tokens} tokens, lr {s.lr:g} ({s.lr_schedule} to {s.lr_final:g}× at the last step), grpo, AdamW, "
             "fp32 engine and trainer, default model. Held out: "
             f"{s.eval_groups} games × {s.eval_samples} samples of the target training never draws (the env's "
             "held-out part, envs/held_out.py: 3 in 1..5), evaluated before the first step and after the last "
             "(before → after).\n")
    return text


def before_after(r: dict[str, Any], key: str) -> str:
    """A held-out figure before the first step and after the last: ``0.125 → 0.531``."""
    before, after = r.get(f"{key}_before"), r.get(f"{key}_after")
    return "–" if before is None or after is None else f"{before:.3f} → {after:.3f}"


def rerender_note(results: list[dict[str, Any]]) -> str:
    """How far each ablation's training rows were from what its model saw (its metrics.jsonl)."""
    notes = {"rerendered": _rerendered_note, "closed": _closed_note}
    return "".join(notes[r["run"]["context"]](r) for r in results if r["run"].get("context") in notes)


def _total(history: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key) or 0 for r in history)


def _rerendered_note(result: dict[str, Any]) -> str:
    history = trained_lines(result["history"])
    changed = _total(history, "rerendered_changed") / len(history)
    replies, reencoded = _total(history, "rerendered_replies"), _total(history, "rerendered_reencoded")
    other_ids = (f"; {reencoded} of its {replies} trained replies were trained as other ids than sampled "
                 "(not counting that end token)") if replies else ""
    return (f"\n{result['run']['label']}: {changed:.0%} of its trained rollouts re-render to other "
            f"tokens than the model saw; {_total(history, 'rerendered_never_sampled')} of its "
            f"{_total(history, 'model_tokens')} trained reply tokens were never "
            f"sampled (the end token it adds to a reply cut by max tokens, or a reply re-encoded into "
            f"more tokens){other_ids}; {_total(history, 'rerendered_failed')} rollouts "
            "could not be re-rendered. It has no sampler logprobs to correct against, so its "
            "mismatch column is empty.\n")


def _closed_note(result: dict[str, Any]) -> str:
    history = trained_lines(result["history"])
    return (f"\n{result['run']['label']}: the traced tokens, and after each reply cut by max tokens the stop "
            f"token the re-render adds, trained with the reply's advantage: "
            f"{_total(history, 'rerendered_never_sampled')} of its {_total(history, 'model_tokens')} trained "
            "reply tokens; π_old stands in for their μ.\n")


def example(result: dict[str, Any], command: str) -> str:
    """One run's metrics.jsonl, a few steps of it, as a table (docs/trainer.md)."""
    history = trained_lines(result["history"])
    shown = history[:3] + history[-2:] if len(history) > 5 else history
    lines = ["| step | reward | loss | grad norm | \\|Δ logp\\| | k3 | prompt | cached | prefill | generated "
             "| rollout s | train s | sync s | checkpoint s | trainer RSS MiB | engine RSS MiB |",
             "|" + "---|" * 16]
    for r in shown:
        lines.append(f"| {r['step']} | {r['reward_mean']:.3f} | {r['loss']:+.4f} | {r['grad_norm']:.2f} | "
                     f"{r['mismatch_mean_abs']:.1e} | {r['k3']:.1e} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{r['prefill_tokens']} | {r['generated_tokens']} | {r['rollout_s']:.1f} | {r['train_s']:.1f} | "
                     f"{r['weight_sync_s']:.1f} | {r.get('checkpoint_s', 0):.1f} | {r['trainer_peak_rss_mib']:.0f} | "
                     f"{r['engine_peak_rss_mib'] or 0:.0f} |")
    label = result["run"]["label"]
    return "\n".join(lines) + f"\n\nSteps of the `{label}` run of `{command}` (its metrics.jsonl).\n"


def run_all(runs: list[LearnRun], settings: LearnSettings, model: str, progress: Any = None,
            record: Path | None = None, on_step: Any = None) -> list[dict]:
    """Train every run, each in a fresh process (an engine and a model per run, all memory given back
    when it ends). With ``record``, runs already in that JSON-lines file (same label and settings) are
    taken from it, not trained again, and each new result is appended as it finishes: a benchmark
    killed mid-way (out of memory, a reboot) goes on where it stopped. ``on_step(run, steps done, its
    index among runs)`` is called as a training run logs its steps (a run takes tens of minutes)."""
    done = {r["run"]["label"]: r for r in _recorded(record, settings)}
    results = []
    with tempfile.TemporaryDirectory(prefix="verbatim-bench-learn-") as root:
        for index, run in enumerate(runs):
            watch = (lambda steps, run=run, index=index: on_step(run, steps, index)) if on_step else None
            result = done.get(run.label) or _train_in_child(run, settings, model, Path(root), watch)
            if run.label not in done and record is not None:
                with record.open("a") as handle:
                    handle.write(strict_json(result) + "\n")
            results.append(result)
            if progress:
                progress(result)
    return results


def _recorded(record: Path | None, settings: LearnSettings) -> list[dict]:
    if record is None or not record.exists():
        return []
    results = []
    for number, line in enumerate(record.read_text().splitlines(), start=1):
        try:
            result = json.loads(line)
        except ValueError:
            raise InputError(f"{record} line {number} is not JSON", hint="remove the line or pass another file") \
                from None
        if result.get("settings", settings.model_dump(mode="json")) == settings.model_dump(mode="json"):
            results.append(result)
    return results


def _train_in_child(run: LearnRun, settings: LearnSettings, model: str, root: Path, watch: Any = None) -> dict:
    answer = root / f"{run.label.replace(' ', '')}.json"
    job = json.dumps({"run": run.model_dump(mode="json"), "settings": settings.model_dump(mode="json"),
                      "model": model, "root": str(root), "answer": str(answer)})
    child = subprocess.Popen([sys.executable, "-m", "verbatim.bench.learn", job])
    try:
        code = wait_reporting_steps(child, run_folder(run, root) / "metrics.jsonl", watch)
    except BaseException:  # Ctrl-C, a failing watcher: no training run left behind
        child.kill()
        child.wait()
        raise
    if code != 0 or not answer.exists():
        raise TrainerError(f"the training run {run.label!r} failed (exit code {code})",
                         hint="its output is above; rerun with the same --record to go on from the runs done")
    return json.loads(answer.read_text())


def wait_reporting_steps(child: subprocess.Popen, metrics: Path, watch: Any, every_s: float = 5.0) -> int:
    """Wait for ``child`` to exit, calling ``watch(steps)`` whenever the count of trained steps in ``metrics``
    (a line each; not step 0's, the evaluation before the first) has grown; its exit code."""
    seen = 0
    while True:
        try:
            code = child.wait(timeout=every_s)
        except subprocess.TimeoutExpired:
            code = None
        steps = len(trained(read_metrics(metrics.parent))) if watch and metrics.exists() else 0
        if watch and steps > seen:
            seen = steps
            watch(steps)
        if code is not None:
            return code


def _child(job: dict) -> None:
    run, settings = LearnRun(**job["run"]), LearnSettings(**job["settings"])
    result = train_run(run, settings, job["model"], Path(job["root"]))
    result["settings"] = settings.model_dump(mode="json")
    Path(job["answer"]).write_text(strict_json(result))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
