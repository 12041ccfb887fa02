"""``verbatim bench prefixflow-loop``: PrefixFlow's headline measured like for like, inside the real training loop.

The PrefixFlow paper (arXiv 2606.01143) reports its speedup on end-to-end RL training with a long shared prefix
(retrieval-augmented prompts) and on the actor update alone: up to 4.395×, and 2.930× with both sides
compiled. This benchmark measures ours the same way: ``verbatim train`` itself, twice, PrefixFlow on
(``--prefixflow``) and off (``--no-prefixflow``), each arm in a process of its own (its own engine and model,
its own peak memory), on ``longdoc``: one group a step, every rollout one turn over one shared document (the
group's prompt, its prefix) with a short reply. Both arms use one seed and ``--concurrency 1``, so they sample
the same tokens while their weights agree (PrefixFlow's gradients are full training's, to rounding): the table
counts the rollouts that are token for token the same in both, which is what "same rollouts" rests on.

Per arm, the mean over its steps of: the actor update (``update_s``: every optimizer update's forward, backward
and step), π_old's (and the KL reference's) forward before it (``policy_s``), the trainer's step (``train_s``,
both), the whole step (rollouts, trainer, weight sync, checkpoint) and the trainer's peak resident memory; the
ratios of the arm without PrefixFlow to the arm with it; and the update's FLOP ideal for the workload
(:func:`verbatim.bench.prefixflow.flop_ideal_speedup`: the prefix once against G times, on the measured
mean prompt and reply lengths), with the update's speedup as a share of it. A run whose rollouts failed, or
that trained fewer steps than asked, is an error, never a table.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verbatim.bench.failures import require_clean
from verbatim.errors import BenchmarkError

SECTION = "bench-prefixflow-loop"
PAPER = {"update": 4.395, "update_compiled": 2.930}
"""The paper's actor-update speedups: the largest it reports, and the one with both sides compiled."""
ARMS = (("PrefixFlow off", "--no-prefixflow"), ("PrefixFlow on", "--prefixflow"))
KL_COEF = 0.001
"""A KL penalty makes every row train whatever its reward: a group whose rewards are all equal (the default model
rarely answers a longdoc question right) has zero advantages and, without one, no update to time. Its reference
forward counts in π_old's column, not the update's."""


@dataclass(frozen=True)
class LoopWork:
    """The workload: ``longdoc`` documents of ``words`` words, groups of ``group_size`` one-turn rollouts with
    replies of at most ``reply_tokens`` tokens, ``steps`` steps of one group, on ``model``."""

    words: int = 1500
    group_size: int = 8
    reply_tokens: int = 32
    steps: int = 3
    microbatch_tokens: int = 4096
    """Both arms' microbatch budget in tokens (``--microbatch-tokens``, at least the context length): one whole
    sequence of full training, or every suffix of the group under PrefixFlow (whose phase B gets the memory
    budget of a whole microbatch, as ``bench prefixflow`` gives it). Four whole sequences of 2,400 tokens in one
    microbatch took more than this machine's 23 GiB."""
    model: str = "default"
    seed: int = 0

    def flags(self, out: Path) -> list[str]:
        return ["--env", "longdoc", "--env-arg", f"words={self.words}", "--env-arg", "questions=1",
                "--groups", "1", "--group-size", str(self.group_size), "--max-turns", "1",
                "--max-tokens", str(self.reply_tokens), "--steps", str(self.steps), "--seed", str(self.seed),
                "--concurrency", "1", "--microbatch-tokens", str(self.microbatch_tokens),
                "--max-model-len", str(self.microbatch_tokens), "--model", self.model,
                "--kl-coef", str(KL_COEF), "--kv-cache-gib", "1", "--out", str(out)]


def run_arm(work: LoopWork, switch: str, out: Path) -> dict[str, Any]:
    """``verbatim train`` with PrefixFlow ``switch``ed, in a process of its own; its metrics and rollouts."""
    done = subprocess.run([sys.executable, "-m", "verbatim.cli", "train", *work.flags(out), switch],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchmarkError(f"verbatim train {switch} failed (exit {done.returncode}): {tail}")
    from verbatim.harness.metrics_log import read_metrics
    from verbatim.harness.store import read_run

    history = read_metrics(out)
    if len(history) != work.steps:
        raise BenchmarkError(f"verbatim train {switch}: {len(history)} of {work.steps} steps trained, so no table")
    trace = read_run(out)
    errors = [f"{r.rollout_id}: {r.error}" for r in trace.rollouts if r.status == "error"]
    require_clean(f"verbatim train {switch}: rollouts", errors, total=len(trace.rollouts))
    paths = {record.get("trainer_path") for record in history}
    return {"history": history, "paths": sorted(str(p) for p in paths),
            "tokens": {r.rollout_id: r.tokens.token_id.tolist() for r in trace.rollouts},
            "prompts": [r.turns[0].prompt_end for r in trace.rollouts],
            "replies": [len(r.tokens.token_id) - r.turns[0].prompt_end for r in trace.rollouts]}


def measure(work: LoopWork, progress: Any = None) -> dict[str, Any]:
    """Both arms, one after the other, and what the table shows."""
    arms = {}
    with tempfile.TemporaryDirectory(prefix="verbatim-bench-prefixflow-loop-") as root:
        for label, switch in ARMS:
            arms[label] = run_arm(work, switch, Path(root) / switch.strip("-"))
            if progress:
                progress(label, arms[label])
    off, on = arms["PrefixFlow off"], arms["PrefixFlow on"]
    if "prefixflow" not in on["paths"] or "prefixflow" in off["paths"]:
        raise BenchmarkError(f"the arms trained on paths {on['paths']} and {off['paths']}: PrefixFlow did not "
                             "switch as asked, so no table")
    same = sum(off["tokens"].get(key) == tokens for key, tokens in on["tokens"].items())
    return {"work": asdict(work), "arms": {label: summary(arm) for label, arm in arms.items()},
            "same_rollouts": same, "rollouts": len(on["tokens"]), "ideal": ideal(work, on)}


def summary(arm: dict[str, Any]) -> dict[str, float]:
    """An arm's means over its steps (the first step too: both arms pay the same first-call costs)."""
    from verbatim.bench.step_split import split

    history = arm["history"]
    parts = split(arm)  # the mean of each part of a step (bench step's), and of their sum

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key) or 0.0) for r in history)

    return {"update_s": mean("update_s"), "policy_s": mean("policy_s"), "train_s": parts["train_s"],
            "rollout_s": parts["rollout_s"], "step_s": parts["step"],
            "peak_rss_mib": max(float(r.get("trainer_peak_rss_mib") or 0.0) for r in history)}


def ideal(work: LoopWork, arm: dict[str, Any]) -> dict[str, float]:
    """The actor update's FLOP ideal on the measured mean prompt (the shared prefix) and reply lengths."""
    from transformers import AutoConfig

    from verbatim.bench.prefixflow import Case, flop_ideal_speedup
    from verbatim.engine.models import resolve

    prefix, reply = statistics.fmean(arm["prompts"]), statistics.fmean(arm["replies"])
    seq = round(prefix + reply)
    case = Case(prefix_ratio=round(prefix) / seq, group_size=work.group_size, seq_len=seq)
    return {"prefix_tokens": round(prefix, 1), "reply_tokens": round(reply, 1),
            "flop_ideal": flop_ideal_speedup(case, AutoConfig.from_pretrained(resolve(work.model))),
            "token_ideal": case.ideal_speedup}


def markdown(result: dict[str, Any], command: str) -> str:
    work, arms, best = result["work"], result["arms"], result["ideal"]
    off, on = arms["PrefixFlow off"], arms["PrefixFlow on"]
    lines = ["| arm | actor update s | π_old forward s | trainer step s | rollouts s | whole step s | "
             "trainer peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, arm in arms.items():
        lines.append(f"| {label} | {arm['update_s']:.2f} | {arm['policy_s']:.2f} | {arm['train_s']:.2f} | "
                     f"{arm['rollout_s']:.2f} | {arm['step_s']:.2f} | {arm['peak_rss_mib']:.0f} |")
    update = off["update_s"] / on["update_s"]
    lines += ["", "| ratio, off / on | actor update | trainer step | whole step | peak RSS |",
              "|---|---:|---:|---:|---:|",
              f"| measured | {update:.2f}x | {off['train_s'] / on['train_s']:.2f}x | "
              f"{off['step_s'] / on['step_s']:.2f}x | {on['peak_rss_mib'] / off['peak_rss_mib']:.2f} of off |",
              f"| FLOP ideal of the update | {best['flop_ideal']:.2f}x | | | |",
              f"| share of the ideal | {update / best['flop_ideal']:.0%} | | | |",
              f"| the paper (its model, GPUs, RAG workload) | up to {PAPER['update']}x; "
              f"{PAPER['update_compiled']}x with both sides compiled | | | |"]
    note = (f"\n\nWorkload: `longdoc`, one group of {work['group_size']} one-turn rollouts a step over a document of "
            f"{work['words']} words (a prompt of {best['prefix_tokens']:.0f} tokens on average, the group's shared "
            f"prefix), replies of {best['reply_tokens']:.1f} tokens on average (at most {work['reply_tokens']}); "
            f"{work['steps']} steps per arm, microbatches of up to {work['microbatch_tokens']} tokens (a whole "
            "sequence, or all the group's suffixes under PrefixFlow), "
            f"the model `{work['model']}`, float32, seed {work['seed']}, `--kl-coef {KL_COEF}` (every row trains, "
            f"whatever its reward; the reference's forward counts in π_old's column). {result['same_rollouts']} of "
            f"{result['rollouts']} rollouts were token for token the same in both arms. Token ideal "
            f"{best['token_ideal']:.2f}x. Means over each arm's steps, measured by `{command}`, each arm a "
            "`verbatim train` process of its own, one after the other. What differs from the paper: a 135 M "
            "model on CPU cores in float32, eager PyTorch, one process, against its larger models on GPUs. Under "
            "PrefixFlow, π_old's and the reference's forwards run the group's prompt once too (the π_old column).")
    return "\n".join(lines) + note
