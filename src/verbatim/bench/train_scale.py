"""``verbatim bench train-scale``: one learner step of a fixed batch on one rank and on several.

Each team size in :data:`RANKS` runs the same step (the default model; ``groups`` groups of
``group_size`` rollouts sharing a ``prompt``-token prompt, ``reply`` model tokens each: the synthetic
rows of :mod:`verbatim.bench.train_step`) as that many fresh processes of a torch.distributed team,
launched the way torchrun launches them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
gloo on the CPU, NCCL where every rank has a GPU of its own. One rank is the learner in one process,
no group. Each rank trains a warm-up step (AdamW's state, the kernels), then the measured one, and
reports:

* the step's time, and the step's model tokens per second, over the team and per rank;
* what the rank holds between steps: its parameters and AdamW's state, counted from the tensors
  themselves (its shards under FSDP2), so sharding shows as bytes, not as the allocator's noise;
* the step's peak: the rise of the resident set over the step (CPU), or the device's peak allocation
  (GPU).

The same step must make the same update on every team size: the loss and the gradient's norm are
compared (a rank's gradient lost or doubled would show there), and so is what the ranks hold: a team
whose ranks hold no less than one process fails the benchmark, as does any rank's failure
(:class:`~verbatim.errors.BenchmarkError`: no table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from verbatim.errors import BenchmarkError
from verbatim.trainer.distributed import ENVIRONMENT, on_this_machine

SECTION = "bench-train-scale"


def section(dtype: str) -> str:
    """The docs section a run of this dtype writes: float32's, or its own (bf16's table beside it)."""
    return SECTION if dtype == "fp32" else f"{SECTION}-{dtype}"

RANKS = (1, 2)
TEAM_ENV = (*ENVIRONMENT, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
UPDATE_REL = {"fp32": 1e-4, "bf16": 0.1}
"""How far a team's loss and gradient norm may be from one process's, relative: float32 sums in another order; with
bf16, a team computing with bfloat16 weights and activations against autocast over float32 in one process (its
residual stream float32): 5 % apart in the gradient norm on the default model, the 10 % that
tests/test_trainer_distributed.py allows each parameter's gradient."""
MMAP_THRESHOLD_MIB = 1
"""Every CPU process of the benchmark pins glibc's mmap threshold here, one process and ranks alike: a freed
block of a MiB or more goes back to the system, so a rank's resident set is not its allocator's history of
gathers (each layer's weights gathered into a fresh block, freed after its call)."""


@dataclass(frozen=True)
class ScaleWork:
    """The measured step, the same on every team size."""

    model: str = "default"
    groups: int = 4
    group_size: int = 2
    prompt: int = 64
    reply: int = 128
    microbatch: int = 2
    microbatch_tokens: int | None = None
    """Microbatches of up to this many tokens (``--microbatch-tokens``) in place of ``microbatch`` rows."""
    prefixflow: bool | None = None
    """The learner's path: PrefixFlow (True), whole sequences (False), or the model's default (None)."""
    threads: int | None = None
    """Torch threads per rank (None: the machine's cores shared evenly over the team's ranks)."""
    dtype: str = "fp32"
    """The learner's ``--dtype``: ``bf16`` gathers bfloat16 weights on a team (autocast in one process)."""

    def threads_for(self, ranks: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // ranks)


def _held_mib(learner: Any) -> tuple[float, float]:
    """This rank's parameters and AdamW state, in MiB (a DTensor counts its local shard only)."""
    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in learner.model.parameters())
    state = sum(local_bytes(v) for s in learner.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return params / 2**20, state / 2**20


def measure_rank(work: ScaleWork, ranks: int) -> dict[str, Any]:
    """This process's rank of a team of ``ranks``: a warm-up step, then the measured step."""
    from verbatim.bench.prefixflow import fix_mmap_threshold, peak_rss_mb
    from verbatim.bench.train_step import Workload, step_input
    from verbatim.jobs.placement import GATHERED_BYTES
    from verbatim.trainer.distributed.sharding import unit_parameters
    from verbatim.trainer.distributed.team import join, leave
    from verbatim.trainer.learner import Learner
    from verbatim.trainer.learner_config import LearnerConfig

    torch.set_num_threads(work.threads_for(ranks))
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    if not gpu:  # the resident set follows the live tensors: glibc keeps no freed gather or gradient for reuse
        fix_mmap_threshold(MMAP_THRESHOLD_MIB)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu"
    team = join(device, timeout_s=900)
    with peak_rss_mb() as loading:
        model = _load(work.model, team, device, work.dtype)
    # a schedule whose second step has learning rate 0: the warm-up runs as that step (its kernels and AdamW's
    # state warm, the weights unchanged), so every team measures its step on the same weights (an update's rounding
    # differs with the team's sums, and AdamW's first step moves a near-zero gradient's weight by up to lr)
    config = LearnerConfig(microbatch=work.microbatch, microbatch_tokens=work.microbatch_tokens, lr_schedule="linear",
                           lr_final=0.0, prefixflow=work.prefixflow, dtype=work.dtype)
    learner = Learner(model, config, team=team)
    # the root's weights, gathered whole for a pass on a team, with their whole gradient
    root = unit_parameters(learner.model)[0] * GATHERED_BYTES[work.dtype] if team.size > 1 else 0
    rows = Workload(groups=work.groups, group_size=work.group_size, prompt=work.prompt, reply=work.reply)
    vocab = int(learner.model.get_input_embeddings().weight.shape[0])
    learner.train_step(step_input(vocab, rows, seed=1, reply=8), at=(1, 2))
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    with peak_rss_mb() as peak:
        started = time.perf_counter()
        metrics = learner.train_step(step_input(vocab, rows), at=(0, 2))
        seconds = time.perf_counter() - started
    params_mib, optimizer_mib = _held_mib(learner)
    step_peak = torch.cuda.max_memory_allocated(device) / 2**20 if gpu else peak.mb
    leave()
    return {"ranks": ranks, "rank": team.rank, "backend": "nccl" if gpu else ("gloo" if ranks > 1 else "none"),
            "device": device, "threads": work.threads_for(ranks), "dtype": work.dtype, "step_s": round(seconds, 2),
            "tokens": metrics["kept_tokens"], "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "params_mib": round(params_mib, 1), "optimizer_mib": round(optimizer_mib, 1),
            "step_peak_mib": None if step_peak is None else round(step_peak, 1),
            "load_peak_mib": loading.mb, "root_mib": round(root / 2**20, 4),
            "parameters": sum(p.numel() for p in learner.model.parameters())}


def _load(name: str, team: Any, device: str, dtype: str) -> Any:
    """The model as ``verbatim train`` loads it: on a team each rank reads its own rows of the model folder's
    weights into the meta-device model (the random ``0.5b`` built whole, then sharded); one process whole."""
    from verbatim.bench.train_step import build_model
    from verbatim.engine.models import resolve
    from verbatim.trainer.distributed.loading import sharded_from

    if team.size > 1 and name != "0.5b":
        sharded = sharded_from(resolve(name), team, dtype, device)
        if sharded is not None:
            return sharded
    model = build_model(name).to(device)
    with torch.no_grad():  # transformers maps the file: its weights reach memory when first read, here
        for param in model.parameters():
            param.view(-1)[::1024].sum()  # a read of every page (4 KiB, 1,024 float32s)
    return model


def run_team(work: ScaleWork, ranks: int) -> list[dict[str, Any]]:
    """The step on a team of ``ranks`` fresh processes; every rank's report, by rank."""
    from verbatim.engine.server import free_port

    job = json.dumps({"work": asdict(work), "ranks": ranks})
    base = {k: v for k, v in os.environ.items() if k not in TEAM_ENV}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "verbatim.bench.train_scale", job], stdout=subprocess.PIPE,
                              text=True, env=base if ranks == 1 else base | on_this_machine(rank, ranks, port))
             for rank in range(ranks)]
    outputs = [proc.communicate()[0] for proc in procs]
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0 or not outputs[rank].strip()]
    if failed:
        codes = ", ".join(f"rank {r}: exit code {procs[r].returncode}" for r in failed)
        raise BenchmarkError(f"the step on {ranks} rank(s) failed ({codes})", hint="its error is above")
    return sorted((json.loads(out.strip().splitlines()[-1]) for out in outputs), key=lambda r: r["rank"])


def check_scaling(teams: Sequence[list[dict[str, Any]]]) -> None:
    """The same update on every team size, and less held per rank on a bigger team; else one line."""
    alone = teams[0][0]
    for team in teams[1:]:
        for r in team:
            for key in ("loss", "grad_norm"):
                if abs(r[key] - alone[key]) > UPDATE_REL[r.get("dtype", "fp32")] * max(1.0, abs(alone[key])):
                    raise BenchmarkError(f"{r['ranks']} ranks made another update than one process: {key} "
                                         f"{r[key]:.6g} against {alone[key]:.6g} (rank {r['rank']})")
            if r["tokens"] != alone["tokens"]:
                raise BenchmarkError(f"{r['ranks']} ranks trained {r['tokens']} tokens, one process "
                                     f"{alone['tokens']}")
            if r["params_mib"] + r["optimizer_mib"] >= alone["params_mib"] + alone["optimizer_mib"]:
                raise BenchmarkError(f"rank {r['rank']} of {r['ranks']} holds "
                                     f"{r['params_mib'] + r['optimizer_mib']:.0f} MiB of parameters and AdamW "
                                     f"state, no less than one process's "
                                     f"{alone['params_mib'] + alone['optimizer_mib']:.0f} MiB")


def run_bench(work: ScaleWork, ranks: Sequence[int] = RANKS,
              progress: Callable[[list[dict[str, Any]]], None] | None = None) -> list[list[dict[str, Any]]]:
    """Every team size of ``ranks`` (one process first: the reference), checked against each other."""
    teams = []
    for size in sorted(set(ranks) | {1}):
        teams.append(run_team(work, size))
        if progress is not None:
            progress(teams[-1])
    check_scaling(teams)
    return teams


def floor(rank: dict[str, Any]) -> float:
    """The least a rank can hold at its step's peak with no activations at all (MiB): its parameters and AdamW
    state, its gradient's shard, and the root's weights gathered whole with their whole gradient (the output
    layer computes with, and backpropagates into, all of it; in the gather's dtype)."""
    return rank["params_mib"] + rank["optimizer_mib"] + rank["params_mib"] + rank["root_mib"]


def markdown_table(teams: Sequence[list[dict[str, Any]]]) -> str:
    """One row per rank of each team size; throughput and memory against one process."""
    alone = teams[0][0]
    lines = ["| ranks | rank | backend | threads | step (s) | tokens/s (team) | tokens/s per rank "
             "| parameters held (MiB) | AdamW state held (MiB) | held vs 1 rank | step peak (MiB) "
             "| held + step peak (MiB) | held + step peak vs 1 rank | floor vs 1 rank | load peak (MiB) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    held_alone = alone["params_mib"] + alone["optimizer_mib"]
    top_alone = None if alone["step_peak_mib"] is None else held_alone + alone["step_peak_mib"]
    floor_alone = held_alone + alone["params_mib"]  # and its whole gradient
    for team in teams:
        step_s = max(r["step_s"] for r in team)
        for r in team:
            held = r["params_mib"] + r["optimizer_mib"]
            peak, top, ratio = (("n/a",) * 3 if r["step_peak_mib"] is None or top_alone is None else
                                (f"{r['step_peak_mib']:.0f}", f"{held + r['step_peak_mib']:.0f}",
                                 f"{(held + r['step_peak_mib']) / top_alone:.2f}x"))
            lines.append(f"| {r['ranks']} | {r['rank']} | {r['backend']} | {r['threads']} | {r['step_s']:.1f} "
                         f"| {r['tokens'] / step_s:.0f} | {r['tokens'] / step_s / r['ranks']:.0f} "
                         f"| {r['params_mib']:.0f} | {r['optimizer_mib']:.0f} | {held / held_alone:.2f}x "
                         f"| {peak} | {top} | {ratio} | {floor(r) / floor_alone:.2f}x "
                         f"| {'n/a' if r['load_peak_mib'] is None else format(r['load_peak_mib'], '.0f')} |")
    return "\n".join(lines)


PLACED = {"Qwen3-8B": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                       "num_attention_heads": 32},
          "Qwen3-32B": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                        "num_attention_heads": 64}}
"""The configurations of the placement table: their published ``config.json`` (Hugging Face hub, Qwen/Qwen3-8B
and Qwen/Qwen3-32B; both: vocabulary 151,936, 8 key/value heads of 128, output layer untied)."""


def placement_table(ranks: int = 8) -> str:
    """Per GPU, before activations, on ``ranks`` ranks: what :func:`~verbatim.jobs.placement.trainer_bytes` (the
    accounting ``train`` refuses a placement with) counts for each configuration, built on the meta device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from verbatim.jobs.placement import TrainerSize, trainer_bytes
    from verbatim.trainer.distributed.sharding import unit_parameters

    lines = ["| model | parameters | gathered at once (root + largest unit) | ranks | fp32 (GB a GPU) "
             "| bf16 (GB a GPU) | bf16 with --kl-coef (GB a GPU) | one process, bf16 (GB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, shape in PLACED.items():
        config = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                             **shape)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        size = TrainerSize.of(total, *unit_parameters(model))
        gb = [trainer_bytes(size, "fp32", ranks), trainer_bytes(size, "bf16", ranks),
              trainer_bytes(size, "bf16", ranks, reference=True), trainer_bytes(size, "bf16")]
        lines.append(f"| {name} | {total / 1e9:.2f} B | {(size.root + size.unit) / 1e9:.2f} B | {ranks} | "
                     + " | ".join(f"{b / 1e9:.1f}" for b in gb) + " |")
    return "\n".join(lines)


def section_text(teams: Sequence[list[dict[str, Any]]], work: ScaleWork, command: str) -> str:
    """The table and how it was measured, for the section ``--write`` replaces."""
    alone = teams[0][0]
    gpu = any(r["backend"] == "nccl" for team in teams for r in team)
    where = ("every rank on a GPU of its own, NCCL" if gpu else
             "CPU processes on gloo; no GPU here, so NCCL was not measured")
    return (markdown_table(teams) + f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}; {where}; the "
            f"{work.model} model, {alone['parameters'] / 1e6:.0f}M parameters; --dtype {work.dtype}; one step of "
            f"{work.groups} groups × "
            f"{work.group_size} rollouts of {work.prompt} prompt + {work.reply} model tokens, microbatch "
            f"{work.microbatch}, after a warm-up step; every team made the same update: loss "
            f"{alone['loss']:.6g}, gradient norm {alone['grad_norm']:.6g}). Tokens/s: the step's model tokens "
            "over its slowest rank's time. Held: the rank's parameters and AdamW state between steps, from the "
            "tensors (FSDP2 shards). Step peak: the resident set's rise over the step (CPU) or the device's peak "
            "allocation (GPU), every CPU process with glibc's mmap threshold pinned at "
            f"{MMAP_THRESHOLD_MIB} MiB so that freed blocks leave the resident set: a rank holds one decoder "
            "layer's gathered weights at a time, the root's (output layer, tied embedding) for the whole pass, and "
            "its shard of the gradient (docs/scale.md). Floor: the least held + step peak any FSDP rank reaches "
            "with no activations at all: its parameters, AdamW state and gradient shard, and the root's weights "
            "gathered whole with their whole gradient, against one process's parameters, AdamW state and "
            "gradient. Load peak: the resident set's rise while the rank loads the model, its modules imported "
            "(a team's ranks each read their own rows of the model folder's weights, then make the first forward "
            "that makes FSDP's root; one process loads it whole, every page of its weights read).\n\n"
            "Placement of larger models, computed (not measured) by the accounting `verbatim train` refuses a "
            "placement with (`jobs/placement.py`): each rank's 1/N of the float32 weights, gradients and AdamW "
            "state, and the root and largest unit gathered at once with their gradients, per GPU, before "
            "activations.\n\n" + placement_table())


def _child(job: dict[str, Any]) -> None:
    from verbatim.durable import strict_json

    print(strict_json(measure_rank(ScaleWork(**job["work"]), job["ranks"])), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
