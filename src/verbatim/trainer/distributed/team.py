"""The process group the learner's ranks share: who this process is, and the sums they agree on.

:func:`join` starts or joins the default torch.distributed group from the environment torchrun (or
``verbatim train --trainer-procs``) sets: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
NCCL where the trainer runs on a GPU (gloo beside it for CPU tensors; each rank bound to its own GPU), gloo on
the CPU. Ranks start at their own pace (a model to load, a
node to boot), so the default group waits :data:`START_TIMEOUT` for them; the learner's collectives run
on a group of their own whose timeout is the run's (a silent rank fails a step within it).
:class:`Team` is that group as the learner uses it: an all-reduced sum and the shape of a pass the ranks
agree on (:mod:`.lockstep`), and nothing else, so one process is the same team of one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verbatim.errors import InputError
from verbatim.trainer.distributed import ENVIRONMENT
from verbatim.trainer.distributed.lockstep import CallShape, as_numbers, from_numbers

START_TIMEOUT = datetime.timedelta(minutes=30)
"""How long the first rank waits for the last to join."""


@dataclass(frozen=True)
class Team:
    """This process's place among the learner's ranks (``size`` 1: one process, no group)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    """The learner's process group (None: one process)."""

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that plays rollouts, pushes weights and writes what one process writes."""
        return self.rank == 0

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (every rank ends with the sum)."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def total(self, value: float) -> float:
        """A float summed over the ranks (in float64)."""
        return float(self.sum_(torch.tensor([value], dtype=torch.float64)).item())

    def agree(self, shape: CallShape, device: torch.device | str = "cpu") -> CallShape:
        """The shape of a pass every rank runs (:func:`~.lockstep.agree`: the maximum, slot by slot), from two
        all-reduces of a few integers on ``device`` (the collective's device)."""
        if self.size == 1:
            return shape
        slots = torch.tensor([len(shape.flows)], dtype=torch.int64, device=device)
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=self.group)
        numbers = torch.tensor(as_numbers(shape, int(slots.item())), dtype=torch.int64, device=device)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=self.group)
        return from_numbers(numbers.tolist())


def backend(device: str) -> str:
    """gloo on the CPU. On CUDA devices NCCL for device tensors with gloo beside it for CPU ones: the step's
    float64 sums (:meth:`Team.total`), and the object collectives and checkpoint planning, which torch runs on
    the CPU where a group has a CPU backend (NCCL alone refuses a CPU tensor)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def bound_device(device: str) -> torch.device | None:
    """The GPU this rank binds before joining (``cuda:N``), so NCCL's collectives and torch's current device are
    its own rather than every rank's ``cuda:0``; None on the CPU, or for ``cuda`` with no index (one GPU)."""
    chosen = torch.device(device)
    return chosen if chosen.type == "cuda" and chosen.index is not None else None


def join(device: str, timeout_s: float = 600.0) -> Team:
    """Join (or start) the default process group named by the environment; a process with no such
    environment is a team of one. ``device``: where this rank trains (cpu, cuda, cuda:N); a collective of the
    learner's that waits longer than ``timeout_s`` fails."""
    if dist.is_initialized():
        return _team(device, timeout_s)
    missing = [name for name in ENVIRONMENT if name not in os.environ]
    if len(missing) == len(ENVIRONMENT):
        return Team()
    if missing:
        raise InputError(f"torch.distributed needs {', '.join(missing)} in the environment beside "
                         f"{', '.join(n for n in ENVIRONMENT if n not in missing)}",
                         hint="launch with torchrun, or set all four")
    bound = bound_device(device)
    if bound is not None:
        torch.cuda.set_device(bound)
    dist.init_process_group(backend(device), timeout=max(START_TIMEOUT, datetime.timedelta(seconds=timeout_s)),
                            device_id=bound)
    return _team(device, timeout_s)


def _team(device: str, timeout_s: float) -> Team:
    """This rank in a new group of every rank, whose collectives fail past ``timeout_s``."""
    group = dist.new_group(backend=backend(device), timeout=datetime.timedelta(seconds=timeout_s))
    return Team(dist.get_rank(), dist.get_world_size(), group)


def leave() -> None:
    """Leave the process group, if this process joined one (its threads end before the interpreter's)."""
    if dist.is_initialized():
        dist.destroy_process_group()
