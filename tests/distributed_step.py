"""One learner step of a tiny random Llama, as a process of a torch.distributed team or alone.

Run by tests/test_trainer_distributed.py: once with no torch.distributed environment (one process),
and as two processes with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, as torchrun
sets them. Rank 0 (or the lone process) writes the gradients AdamW stepped on, per update, the
weights the engine would receive after the step, and the step's metrics to ``sys.argv[1]`` (``--jobs FILE``: several
steps, one after another, each to its own file).
``--divide N`` sets FSDP's gradient divide factor to N: N=2 averages over the ranks instead of summing,
the mistake the comparison must catch. ``--save DIR`` checkpoints the learner after the step into DIR
(every rank writes its optimizer shards) and records the whole optimizer state; ``--restore CKPT`` skips
the step and records the whole optimizer state of a fresh learner restored from CKPT instead;
``--dtype bf16`` trains in bfloat16 (autocast in one process, FSDP's mixed precision on a team);
``--no-step`` saves before any update (the optimizer's state still empty); ``--kl`` adds a k2 KL penalty
toward a reference moved away from the starting weights (the same seeded noise on every rank), so the penalty
and its gradient are not 0 in the first step. ``--case NAME`` picks the step's rows (:data:`CASES`: uneven
shares of the ranks); rank 0 records how many all-gathers and reduce-scatters each rank made. ``--no-idle``
makes rank 1 skip the idle calls that keep it in step (``--timeout S``: the team's timeout). ``--untied``: a
model whose output layer is not its embedding (the embedding then a unit of its own). ``--from DIR``: a team's
ranks build the model on the meta device and each loads its own rows of DIR's weights (the saved tiny model).
``--file-bytes N``: a checkpoint's weight files hold at most N bytes each (numbered files and an index), the
model's ``config.json`` beside them. ``--lora``: a rank-4 LoRA adapter trains on the frozen model (with
``--from`` on a team, built as a LoRA run's team builds it). ``--moe``: a tiny Qwen3-MoE instead, its rows with
recorded experts that the learner replays (``--routing-replay``).
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from test_trainer_learner import step_rows

from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.trainer.distributed.team import Team, join, leave
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig, LoraConfig, LossConfig
from verbatim.trainer.step_input import StepInput

CONFIG = LearnerConfig(lr=1e-3, microbatch=2, updates_per_step=2, max_grad_norm=0.5)
"""Two updates, two rows a microbatch, a norm cap the step's gradient exceeds (clipping bites)."""

CASES: dict[str, Callable[[torch.nn.Module], tuple[StepInput, LearnerConfig]]] = {
    # three groups of three sharing a prompt each: on two ranks one rank trains two groups
    "three-groups": lambda model: (step_rows(model, groups=3, size=3), CONFIG),
    # one group: every rank but one has no row, and makes only idle calls
    "one-group": lambda model: (step_rows(model, groups=1, size=3), CONFIG),
    # a group sharing a long prompt (PrefixFlow, on one rank) beside a group whose rows share none (plain rows,
    # on the other)
    "mixed": lambda model: (step_rows(model, groups=2, size=[4, 4], prompt=[20, 3], apart=frozenset({1})), CONFIG),
    # groups of different sizes and prefix lengths, one of plain rows, in microbatches of at most 40 tokens
    "uneven": lambda model: (step_rows(model, groups=4, size=[3, 4, 2, 3], prompt=[7, 19, 3, 11],
                                       apart=frozenset({2})), CONFIG.model_copy(update={"microbatch_tokens": 40})),
}
"""``--case``: the step's rows and the learner's settings."""


def count_collectives() -> dict[str, int]:
    """Counts of FSDP's all-gathers and reduce-scatters made by this process from now on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

    counts = {"all_gather": 0, "reduce_scatter": 0}
    for name, key in (("foreach_all_gather", "all_gather"), ("foreach_reduce", "reduce_scatter")):
        real = getattr(groups, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            counts[_key] += 1
            return _real(*args, **kwargs)

        setattr(groups, name, counted)
    return counts


ARGS: list[str] = sys.argv
"""The flags of the step being made (one of ``--jobs``' steps, or the command line's)."""


def option(flag: str) -> str | None:
    return ARGS[ARGS.index(flag) + 1] if flag in ARGS else None


def with_adapter(model: torch.nn.Module, config: LearnerConfig, team: Team) -> Any:
    """``model`` with the run's fresh adapter (seed 5), its B then set to the same noise on every rank (so that A's
    gradient is not 0): attached whole, or, with ``--from`` on a team, as a LoRA run's team builds it (each rank
    its own rows of the saved model's files and its shard of the adapter)."""
    from torch.distributed.tensor import distribute_tensor

    from verbatim.jobs.trainer_team import lora_team_model
    from verbatim.trainer import lora

    if option("--from") is not None and team.size > 1:
        model = lora_team_model(Path(option("--from")), config, team, "cpu", seed=5)
    else:
        lora.attach(model, config.lora, seed=5)
    noise = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in getattr(model, "model", model).named_parameters():
            if ".lora_B." in name:
                value = 0.05 * torch.randn(param.shape, generator=noise)
                param.copy_(distribute_tensor(value, param.device_mesh, param.placements)
                            if hasattr(param, "device_mesh") else value)
    return model


def tiny_moe() -> torch.nn.Module:
    """A random 3-layer Qwen3-MoE (tests/test_adapters.py's), 4 experts, top-2."""
    from test_adapters import family_model

    return family_model("qwen3_moe", seed=1)


def with_routing(step: StepInput) -> StepInput:
    """``step``'s rows with seeded random experts recorded for every token (2 of 4 in each of 3 layers)."""
    import numpy as np

    rng = np.random.default_rng(3)
    columns = [replace(c, routed_experts=np.stack([rng.permutation(4)[:2] for _ in range(3 * len(c))])
                       .reshape(len(c), 3, 2), experts_version=np.zeros(len(c))) for c in step.columns]
    return replace(step, columns=columns)


def whole_moments(learner: Learner) -> dict:
    """The optimizer's state, every tensor whole, keyed by parameter name, on rank 0 (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(learner.model, learner.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True)).get("state", {})


def main(out: str, team: Team, args: list[str]) -> None:
    global ARGS
    ARGS = args
    divide, save, restore = option("--divide"), option("--save"), option("--restore")
    divide = None if divide is None else float(divide)
    model = tiny_llama(tied="--untied" not in ARGS, seed=1) if "--moe" not in ARGS else tiny_moe()
    step, config = CASES[option("--case") or "three-groups"](model)
    if "--moe" in ARGS:  # Rollout Routing Replay of experts recorded for every token (the same on every rank)
        step, config = with_routing(step), config.model_copy(update={"routing_replay": True})
    if "--lora" in ARGS:
        config = config.model_copy(update={"lora": LoraConfig(rank=4)})
        model = with_adapter(model, config, team)
    if "--kl" in ARGS:
        config = config.model_copy(update={"loss": LossConfig(kl_coef=0.5, kl_estimator="k2")})
    step = replace(step, truncation=(0.5, 0))  # counted outside π's top-p mask: a metric each rank sums
    config = config.model_copy(update={"dtype": option("--dtype") or "fp32"})
    reference = None
    if option("--from") is not None and team.size > 1 and "--lora" not in ARGS:  # its own rows of the saved model
        from verbatim.trainer.distributed.loading import sharded_from

        model = sharded_from(option("--from"), team, config.dtype, "cpu")
        if config.loss.kl_coef > 0:
            reference = sharded_from(option("--from"), team, config.dtype, "cpu")
    if "--no-idle" in ARGS and team.rank == 1:  # rank 1 makes only its own calls: the team cannot keep step
        Team.agree = lambda self, shape, device="cpu": shape
    collectives = count_collectives()
    learner = Learner(model, config, team=team, reference=reference)
    if learner.reference is not None:
        noise = torch.Generator().manual_seed(11)
        for param in learner.reference.parameters():  # the same noise on every rank, each adding its shard
            moved = 0.05 * torch.randn(param.shape, generator=noise)
            if hasattr(param, "device_mesh"):  # sharded over the team, as the learner's own model is
                from torch.distributed.tensor import distribute_tensor

                moved = distribute_tensor(moved, param.device_mesh, param.placements)
            param.add_(moved)
    if restore is not None:
        saved = learner.restore(Path(restore))
        empty = not learner.optimizer.state  # before whole_moments, which fills an empty state
        moments = whole_moments(learner)
        weights = learner.engine_weights()  # each rank read its own rows of the checkpoint's weights
        if team.leader:
            torch.save({"moments": moments, "saved": saved, "team": team.size, "empty": empty, "weights": weights},
                       out)
        return
    if divide is not None:
        for unit in learner.placement.units:
            unit.set_gradient_divide_factor(divide)
    gathered: list[str] = []  # the dtype of the weights a decoder layer computes with
    first = learner.model.model.layers[0]
    first.register_forward_pre_hook(lambda m, _: gathered.append(str(getattr(m.mlp, "up_proj", m.self_attn.q_proj)
                                                                     .weight.dtype)))
    names = {id(p): n for n, p in learner.model.named_parameters()}
    updates: list[dict[str, torch.Tensor]] = []

    def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
        grads = {names[id(p)]: p.grad for group in optimizer.param_groups for p in group["params"]}
        updates.append({n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()})

    learner.optimizer.register_step_pre_hook(record)
    if "--no-step" in ARGS:
        written = learner.save(Path(save), 0, {"version": 0}, 2, ())
        if team.leader:
            torch.save({"written": str(written), "gathered": sorted(set(gathered))}, out)
        return
    files: tuple[Path, ...] = ()
    if option("--file-bytes") is not None:
        from verbatim.trainer import weight_files

        weight_files.FILE_BYTES = int(option("--file-bytes"))
        model.config.save_pretrained(Path(save).parent / f"config-{team.rank}")
        files = (Path(save).parent / f"config-{team.rank}" / "config.json",)
    metrics = learner.train_step(step)
    every_rank = [None] * team.size  # each rank's collectives in the step, on rank 0
    if team.size > 1:
        torch.distributed.all_gather_object(every_rank, dict(collectives))
    weights = learner.engine_weights()
    written = learner.save(Path(save), 1, {"version": learner.version}, 2, files) if save is not None else None
    moments = whole_moments(learner) if save is not None else None
    if team.leader:
        keep = ("loss", "grad_norm", "grad_norm_max", "kept_tokens", "model_tokens", "rows", "updates",
                "outside_support", "entropy", "kl_ref", "ranks", "padding_tokens")
        torch.save({"updates": updates, "weights": weights, "metrics": {k: metrics.get(k) for k in keep},
                    "team": team.size, "version": learner.version, "moments": moments,
                    "written": str(written), "gathered": sorted(set(gathered)), "collectives": every_rank}, out)


def jobs() -> list[tuple[str, list[str]]]:
    """The steps to make: ``--jobs FILE`` (a JSON list of ``[out, [flags...]]``, made one after another by one
    team, which saves a launch each), or the command line's one."""
    if "--jobs" in sys.argv:
        with open(option("--jobs")) as handle:
            return [(out, list(flags)) for out, flags in json.load(handle)]
    return [(sys.argv[1], sys.argv[2:])]


if __name__ == "__main__":
    torch.set_num_threads(1)
    team = join("cpu", timeout_s=float(option("--timeout") or 120))
    for out, args in jobs():
        main(out, team, args)
    leave()
    gc.collect()  # as verbatim's entry points: a rank aborted in interpreter teardown without it (about 1 run in 30)
