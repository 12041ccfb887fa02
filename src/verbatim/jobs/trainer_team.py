"""The trainer's processes: the team a training run's learner is sharded over.

``verbatim train`` run by torchrun (any ``--nnodes``/``--nproc-per-node``) finds ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in its environment and joins that group: rank 0 runs the loop
(rollouts, the engine, the run's files), every other rank follows its learner calls
(:mod:`verbatim.trainer.distributed.lead`). Without torchrun, ``--trainer-procs N`` starts N − 1
followers on this machine (``python -m verbatim.jobs.trainer_team``, the config in their environment,
their output in ``trainer-rank{R}.log`` of the run) and leads them as rank 0. A follower dies with the
command: when rank 0 ends, its next call fails, and the engine's reaper stops it with the engine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verbatim.errors import InputError, TeamError, stacks_on_request
from verbatim.trainer.distributed import ENVIRONMENT, on_this_machine

CONFIG_VARIABLE = "VERBATIM_TRAIN_CONFIG"
"""A spawned follower's TrainConfig, as JSON."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ENVIRONMENT)


def following() -> bool:
    """Whether this process is a rank above 0 that torchrun launched (it follows rank 0's learner)."""
    return launched_by_torchrun() and int(os.environ["RANK"]) > 0


def team_size(procs: int) -> int:
    """The trainer's ranks: torchrun's count under torchrun, else ``--trainer-procs``."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else procs


def rank_device(device: str, devices: tuple[int, ...] | None = None) -> str:
    """This rank's device (:func:`~verbatim.jobs.placement.rank_device`): the ``LOCAL_RANK``-th of
    ``--trainer-devices``, or ``--trainer-device``, whose ``cuda`` is GPU ``LOCAL_RANK``."""
    from verbatim.jobs.placement import rank_device as placed

    local = os.environ.get("LOCAL_RANK")
    return placed(device, devices, int(local) if local is not None else None)


def ranks_here(procs: int) -> int:
    """The trainer ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else ``--trainer-procs``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_by_torchrun() else procs


def check_procs(procs: int) -> None:
    """--trainer-procs against the group torchrun launched (it says how many ranks there are)."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if procs not in (1, world):
            raise InputError(f"--trainer-procs {procs} under torchrun, which launched {world} processes",
                             hint="drop --trainer-procs: torchrun's --nnodes × --nproc-per-node say how many")


def start_followers(config_json: str, procs: int, out: Path) -> list[subprocess.Popen]:
    """Ranks 1..procs-1 on this machine, this process rank 0 (its environment set to join them)."""
    if procs <= 1 or launched_by_torchrun():
        return []
    from verbatim.engine.server import free_port

    port = free_port()
    os.environ.update(on_this_machine(0, procs, port))
    out.mkdir(parents=True, exist_ok=True)
    followers = []
    for rank in range(1, procs):
        env = dict(os.environ, **on_this_machine(rank, procs, port), **{CONFIG_VARIABLE: config_json})
        with open(out / f"trainer-rank{rank}.log", "ab") as log:
            followers.append(subprocess.Popen([sys.executable, "-m", "verbatim.jobs.trainer_team"], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return followers


def join_team(device: str, timeout_s: float) -> tuple[Any, Any]:
    """This process in the team (a team of one without an environment) and the channel rank 0 announces on.
    ``timeout_s``: how long a call every rank makes waits for a silent rank (``--trainer-timeout``)."""
    from verbatim.trainer.distributed.lead import open_channel
    from verbatim.trainer.distributed.team import join

    team = join(device, timeout_s=timeout_s)
    channel = open_channel(timeout_s) if team.size > 1 else None
    if channel is not None and launched_by_torchrun():
        from verbatim.trainer.distributed.lead import roster

        ROSTER[:] = roster(channel, int(os.environ.get("GROUP_RANK", "0")))
    return team, channel


ROSTER: list[tuple[int, int, str]] = []
"""Under torchrun, every rank of this process's team: (rank, node, host), so rank 0 can name a lost one."""


def _others(entries: list[tuple[int, int, str]]) -> str | None:
    """The ranks rank 0 may have lost, by node: the one other rank, or the ranks of the other ranks."""
    others = [f"{rank} (node {node}, host {host})" for rank, node, host in entries if rank != 0]
    if not others:
        return None
    return f"trainer rank {others[0]}" if len(others) == 1 else f"one of trainer ranks {', '.join(others)}"


def follow_run(config: Any) -> int:
    """A follower rank: the model and the learner rank 0 builds, then its calls until it stops."""
    from verbatim.engine.models import resolve
    from verbatim.trainer.distributed.lead import follow
    from verbatim.trainer.reference import trainer_device

    device = rank_device(trainer_device(config.placement.trainer_device), config.placement.trainer_devices)
    check_own_device(config, resolve(config.engine.model), device)
    team, announcements = join_team(device, config.placement.trainer_timeout_s)
    try:
        return follow(build_learner(config, resolve(config.engine.model), team, device), announcements)
    finally:
        leave_team()


def check_own_device(config: Any, model_dir: Path, device: str) -> None:
    """A follower checks the device it trains on, as rank 0 checked those of its own machine: on another node
    (torchrun's ``GROUP_RANK`` above 0) no engine shares it. A refusal ends this rank, and torchrun the job."""
    if not device.startswith("cuda"):
        return
    from verbatim.jobs.placement import check_here
    from verbatim.jobs.train import trainer_size
    from verbatim.trainer.distributed.loading import empty_model

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    same_node = os.environ.get("GROUP_RANK", "0") == "0"
    check_here(config.engine if same_node else None, trainer_device=device,
               parameters=trainer_size(empty_model(model_dir), ranks), dtype=config.learner.dtype, ranks=ranks,
               reference=config.learner.loss.kl_coef > 0)


def build_learner(config: Any, model_dir: Path, team: Any, device: str, model: Any = None) -> Any:
    """This rank's learner of the run: on a team, each rank loads its own shards of the model folder (and of a KL
    reference), or, where the folder's files do not name every parameter, the whole model it then shards; in one
    process, ``model`` (already loaded) or the folder's, moved to ``device``."""
    from verbatim.trainer.distributed.loading import sharded_from
    from verbatim.trainer.learner import Learner
    from verbatim.trainer.reference import load_model

    options = config.learner
    empty = model is not None and next(model.parameters()).is_meta  # rank 0's, built for the placement check
    if team.size > 1 and options.lora.rank is not None:
        return Learner(lora_team_model(model_dir, options, team, device, config.plan.seed), options, team=team,
                       seed=config.plan.seed,
                       reference=(sharded_from(model_dir, team, options.dtype, device)
                                  if options.loss.kl_coef > 0 else None))
    if team.size > 1:
        sharded = sharded_from(model_dir, team, options.dtype, device, model if empty else None)
        if sharded is not None:
            reference = sharded_from(model_dir, team, options.dtype, device) if options.loss.kl_coef > 0 else None
            return Learner(sharded, options, team=team, seed=config.plan.seed, reference=reference)
    whole = model if model is not None and not empty else load_model(model_dir)
    return Learner(whole.to(device), options, team=team, seed=config.plan.seed)


def lora_team_model(model_dir: Path, options: Any, team: Any, device: str, seed: int) -> Any:
    """A LoRA run's model on a team (``options``: its learner's): built on the meta device with its adapter, sharded
    (the frozen base beside the adapter in each unit), each rank reading its own rows of the base's files and taking
    its shard of the fresh adapter one process would draw from ``seed``."""
    from verbatim.trainer import lora
    from verbatim.trainer.distributed.loading import empty_model, sharded_from
    from verbatim.trainer.distributed.sharding import ShardedModel
    from verbatim.trainer.reference import load_model

    model = lora.attach(empty_model(model_dir), options.lora, base=str(model_dir))
    sharded = sharded_from(model_dir, team, options.dtype, device, model)
    if sharded is None:  # files that do not name every weight: the base loaded whole, then sharded
        whole = lora.attach(load_model(model_dir), options.lora, base=str(model_dir))
        sharded = ShardedModel(whole.to(device), team, options.dtype)
    lora.init_adapter(sharded.model, seed)
    return sharded


def leave_team() -> None:
    """Leave the learner's process group if this process joined one (torch is not imported for a run without)."""
    if "torch.distributed" in sys.modules:
        from verbatim.trainer.distributed.team import leave

        leave()


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def named_ranks(followers: list[subprocess.Popen], timeout_s: float, settle_s: float = 2.0) -> Iterator[None]:
    """A lost rank named: a :class:`TeamError` inside says which follower ended and how, or, when none ended,
    which are still running but gave no answer within ``timeout_s`` (hung). :func:`end_followers` stops
    those still running."""
    try:
        yield
    except TeamError as exc:
        deadline = time.monotonic() + settle_s  # the dead rank's exit may lag its closed connection
        while followers and all(p.poll() is None for p in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        named = [f"trainer rank {rank} ended ({_how(p.returncode)})"
                 for rank, p in enumerate(followers, start=1) if p.poll() is not None]
        if not named:  # nobody died: the silent ones hang
            named = [f"trainer rank {rank} gave no answer within {timeout_s:g} s (hung; stopped with the run)"
                     for rank, p in enumerate(followers, start=1) if p.poll() is None]
        if not named and ROSTER:  # torchrun's ranks, on this node or others: name what rank 0 knows of them
            lost = _others(ROSTER)
            named = [f"{lost} stopped or was cut off"] if lost else []
        if not named:
            raise
        raise TeamError(f"{', '.join(named)}: {exc.message}", hint=exc.hint) from exc


def end_followers(followers: list[subprocess.Popen], wait_s: float = 60.0) -> list[int | None]:
    """Wait for followers released by rank 0 (killed past ``wait_s``); their exit codes."""
    codes = []
    for proc in followers:
        try:
            codes.append(proc.wait(timeout=wait_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def main() -> None:
    from verbatim.jobs.train import TrainConfig

    stacks_on_request()  # kill -USR1: this rank's stacks in its trainer-rank{R}.log
    follow_run(TrainConfig.model_validate_json(os.environ[CONFIG_VARIABLE]))
    gc.collect()  # the learner's cycles (and the process groups they hold) end before the interpreter does


if __name__ == "__main__":
    main()
