"""``verbatim bench train-step``: peak memory and time of one learner step, each memory option on and off.

For each model (the default model, SmolLM2-135M-Instruct, and ``0.5b``: a Qwen2.5-0.5B-shaped Qwen2
built at random from its config class, 494M parameters and a 151,936-token vocabulary, nothing
downloaded) and each setting of :data:`SETTINGS` (``fp32``: as before this option existed; ``chunked``: log π
in chunks of rows; ``bf16``: bfloat16 autocast; ``checkpointing``: activation checkpointing; ``all``: the
three together), one :meth:`~verbatim.trainer.learner.Learner.train_step` on
synthetic rows: ``groups`` groups of ``group_size`` rollouts, each a ``prompt``-token prompt shared by its
group and ``reply`` model tokens, random ids (the cost does not depend on them), with no sampler logprob
(π_old stands in for μ, so every model token is kept and trained).

Every (model, setting) runs in a fresh Python process, so one setting's allocations never lower or raise
another's peak. In it, one small warm-up step allocates AdamW's state and loads the kernels; the
measured step's peak memory is the rise of the resident set's high-water mark over the resident size
before the step (:func:`verbatim.bench.prefixflow.peak_rss_mb`, after ``malloc_trim``), gradients
included; ``peak RSS`` is the process's high-water mark over its whole life (model, optimizer state, the
step); ``optimizer state`` the bytes of AdamW's tensors after the step, ``push`` those of what the learner hands
the engine (the weights, or a LoRA run's adapter). A setting whose step fails fails the benchmark
(:class:`~verbatim.errors.BenchmarkError`): no table.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from verbatim.datamodel import Source, TokenColumns
from verbatim.errors import BenchmarkError
from verbatim.trainer.tiny import QWEN2_05B_SIZES

SECTION = "bench-train-step"
MODELS = ("default", "0.5b")
PATHS = ("plain", "prefixflow")
"""The learner's paths: the model's own full forward, or its PrefixFlow adapter (the default for a family
with one)."""
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {"logprob_chunk": 0},
    "chunked": {},
    "bf16": {"logprob_chunk": 0, "dtype": "bf16"},
    "checkpointing": {"logprob_chunk": 0, "checkpoint_layers": True},
    "all": {"dtype": "bf16", "checkpoint_layers": True},
    "lora": {"logprob_chunk": 0, "lora": {"rank": 16}},
}
"""Each setting's LearnerConfig fields over the config's defaults (the default chunk: ``logprob_chunk``); ``lora``:
fp32's step training a rank-16 LoRA adapter on every projection of the frozen model (docs/trainer.md)."""

QWEN2_05B = {"vocab_size": 151936, **QWEN2_05B_SIZES, "rope_theta": 1000000.0, "tie_word_embeddings": True}
"""Qwen2.5-0.5B's shape (its config.json), for a random model of that size."""


@dataclass(frozen=True)
class Workload:
    """The synthetic rows of the measured step, and how the learner runs them."""

    groups: int = 2
    group_size: int = 2
    prompt: int = 64
    reply: int = 192
    microbatch: int = 4
    prefixflow: bool = False
    threads: int | None = None

    @property
    def rows(self) -> int:
        return self.groups * self.group_size


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """``0.5b``: the random Qwen2.5-0.5B-shaped model; anything else: a bundled model or folder, float32."""
    if name == "0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).float().eval()
    from verbatim.engine.models import resolve
    from verbatim.trainer.reference import load_model

    return load_model(resolve(name))


def step_input(vocab: int, work: Workload, seed: int = 0, reply: int | None = None):
    """``work.groups`` groups of rows sharing a prompt, ``reply`` model tokens each; μ unknown (NaN)."""
    from verbatim.trainer.step_input import StepInput

    rng = np.random.default_rng(seed)
    reply = work.reply if reply is None else reply
    columns, groups = [], []
    for _ in range(work.groups):
        prompt = rng.integers(0, vocab, work.prompt)
        groups.append(list(range(len(columns), len(columns) + work.group_size)))
        for _ in range(work.group_size):
            ids = np.concatenate([prompt, rng.integers(0, vocab, reply)]).astype(np.int64)
            source = np.where(np.arange(ids.size) < work.prompt, int(Source.PROMPT), int(Source.MODEL))
            model = source == int(Source.MODEL)
            columns.append(TokenColumns(token_id=ids, source=source, logprob=np.full(ids.size, np.nan),
                                        policy_version=np.where(model, 0, -1), turn=np.zeros(ids.size)))
    advantages = rng.normal(size=len(columns))
    return StepInput(columns=columns, advantages=advantages, groups=groups, behaviour_from_trainer=True)


def measure(model_name: str, setting: str, work: Workload) -> dict[str, Any]:
    """One (model, setting) in this process: a warm-up step, then the measured one."""
    from verbatim.bench.prefixflow import peak_rss_mb
    from verbatim.trainer import lora
    from verbatim.trainer.learner import Learner
    from verbatim.trainer.learner_config import LearnerConfig

    if work.threads is not None:
        torch.set_num_threads(work.threads)
    model = build_model(model_name)
    config = LearnerConfig(microbatch=work.microbatch, prefixflow=work.prefixflow, **SETTINGS[setting])
    learner = Learner(model, config)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    learner.train_step(step_input(vocab, work, seed=1, reply=8))  # AdamW's state, kernels
    rows = step_input(vocab, work)
    with peak_rss_mb() as peak:
        started = time.perf_counter()
        metrics = learner.train_step(rows)
        seconds = time.perf_counter() - started
    if not np.isfinite(metrics["loss"]) or metrics["kept_tokens"] != work.rows * work.reply:
        raise BenchmarkError(f"{model_name} {setting}: the step trained {metrics['kept_tokens']} of "
                             f"{work.rows * work.reply} tokens, loss {metrics['loss']}")
    pushed = sum(t.numel() * t.element_size() for t in learner.engine_weights().values())
    return {"model": model_name, "setting": setting,
            "parameters": sum(p.numel() for name, p in model.named_parameters() if not lora.is_adapter_name(name)),
            "vocab": vocab, "path": metrics["trainer_path"], "step_s": round(seconds, 2),
            "step_peak_mb": peak.mb, "process_peak_mb": round(_max_rss_kb() / 1024, 1),
            "optimizer_mb": round(optimizer_bytes(learner.optimizer) / 2**20, 1), "push_mb": round(pushed / 2**20, 1),
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "config": config.model_dump(include={"dtype", "checkpoint_layers", "logprob_chunk"})}


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's state tensors (AdamW's two moments per trained parameter, and its steps)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _max_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def run_bench(models: list[str], settings: list[str], work: Workload, paths: Sequence[str] = ("plain",),
              progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every (model, path, setting), each in a fresh process; a failed one is a :class:`BenchmarkError`."""
    results = []
    for model in models:
        for path in paths:
            for setting in settings:
                results.append(_in_child(model, setting, replace(work, prefixflow=path == "prefixflow")))
                if progress is not None:
                    progress(results[-1])
    return results


def _in_child(model: str, setting: str, work: Workload) -> dict:
    job = json.dumps({"model": model, "setting": setting, "work": asdict(work)})
    done = subprocess.run([sys.executable, "-m", "verbatim.bench.train_step", job], check=False,
                          stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchmarkError(f"the learner step of {model} with {setting} failed (exit code {done.returncode})",
                             hint="its error is above")
    return json.loads(lines[-1])


def markdown_table(results: list[dict]) -> str:
    """One row per (model, path, setting); the ratios are against the model's fp32 row on the same path where
    there is one."""
    head = ("| model | setting | path | step (s) | step peak rise (MiB) | process peak RSS (MiB) "
            "| optimizer state (MiB) | push (MiB) | time vs fp32 | rise vs fp32 |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["model"], r["path"]): r for r in results if r["setting"] == "fp32"}
    for r in results:
        ref = base.get((r["model"], r["path"]))
        time_ratio = f"{r['step_s'] / ref['step_s']:.2f}x" if ref else "–"
        rise_ratio = f"{r['step_peak_mb'] / ref['step_peak_mb']:.2f}x" if ref and ref["step_peak_mb"] else "–"
        lines.append(f"| {r['model']} ({r['parameters'] / 1e6:.0f}M, vocab {r['vocab']:,}) | {r['setting']} "
                     f"| {r['path']} | {r['step_s']:.1f} | {_mb(r['step_peak_mb'])} | {_mb(r['process_peak_mb'])} "
                     f"| {_mb(r.get('optimizer_mb'))} | {_mb(r.get('push_mb'))} | {time_ratio} | {rise_ratio} |")
    return "\n".join(lines)


def section_text(results: list[dict], work: Workload, command: str) -> str:
    """The table and how it was measured, for the section ``--write`` replaces."""
    chunk = next((r["config"]["logprob_chunk"] for r in results if r["setting"] == "chunked"), None)
    rows = (f"{work.groups} groups × {work.group_size} rollouts of {work.prompt} prompt + {work.reply} model "
            f"tokens, microbatch {work.microbatch}" + (f", log π chunks of {chunk} rows" if chunk else ""))
    return (markdown_table(results) + f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}; {rows}; "
            f"torch threads: {work.threads or torch.get_num_threads()}).")


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _child(job: dict) -> None:
    from verbatim.durable import strict_json

    result = measure(job["model"], job["setting"], Workload(**job["work"]))
    print(strict_json(result), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
