"""Rank 0 leads, the other ranks follow: the learner calls every rank makes together.

The training loop (rollouts, the engine, the run's files) runs on rank 0 only. Its learner is a
:class:`Lead`: before each call that needs every rank (a step, gathering the weights for the engine, a
checkpoint, a resume) it announces the call, with what the other ranks need to make it, on gloo groups
of its own (objects travel on the CPU whatever device trains); :func:`follow` is the other ranks' loop,
making each announced call on their own :class:`~verbatim.trainer.learner.Learner` until rank 0 says
``stop``. Everything else the loop reads (``version``, ``config``) is rank 0's learner's.

Between two calls rank 0 plays rollouts, for as long as they take, so a follower waits for the next call
on a :class:`Channel`'s ``bell``, a one-number broadcast with a timeout of days (a rank 0 that dies closes
its connections, which ends the wait at once). The call itself travels on ``words``, whose timeout is the
team's: a follower that hangs fails rank 0's announcement or the step's first collective within it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verbatim.errors import TeamError
from verbatim.trainer.learner import Learner
from verbatim.trainer.step_input import StepInput

STOP = "stop"
LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")
"""What gloo's RuntimeError says when a peer rank is gone or silent."""
BETWEEN_CALLS = datetime.timedelta(days=7)
"""How long a follower waits for rank 0's next call (rank 0 plays a step's rollouts meanwhile)."""


@dataclass(frozen=True)
class Channel:
    """The gloo groups rank 0 announces on: ``bell`` rings before each call (followers wait on it while rank 0
    plays rollouts), ``words`` carries the call within the team's timeout."""

    bell: Any
    words: Any


def open_channel(timeout_s: float) -> Channel:
    """The announcements' groups; every rank creates them, in the same order. ``timeout_s``: the team's."""
    bell = dist.new_group(backend="gloo", timeout=BETWEEN_CALLS)
    return Channel(bell, dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))


def roster(channel: Channel, node: int) -> list[tuple[int, int, str]]:
    """Each rank's (rank, node, host), gathered on every rank: who rank 0 names when one is lost."""
    import socket

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), node, socket.gethostname()), group=channel.words)
    return sorted(tuple(entry) for entry in every)


def _hear(channel: Channel) -> tuple[Any, ...]:
    dist.broadcast(torch.zeros(1), src=0, group=channel.bell)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=channel.words)
    return box[0]


def _say(channel: Channel, *call: Any) -> None:
    """The bell is not waited for until the words have gone: a silent rank fails the words within the team's
    timeout, where the bell's wait would take days."""
    bell = torch.ones(1)
    rung = dist.broadcast(bell, src=0, group=channel.bell, async_op=True)
    dist.broadcast_object_list([call], src=0, group=channel.words)
    rung.wait()


def _reason(exc: BaseException) -> str:
    """The first sentence of a collective's error, without gloo's source location."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0][:200]


@contextlib.contextmanager
def _together(call: str) -> Iterator[None]:
    """A call every rank makes: a rank lost in it (its connection closed, or silent past the group's timeout)
    is one :class:`TeamError`."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        if not isinstance(exc, dist.DistError) and not any(word in str(exc) for word in LOST):
            raise  # an error of the step itself, not of the team
        raise TeamError(f"a trainer rank stopped during {call}: {_reason(exc)}",
                        hint="the run stopped; rerun the same command with --resume to go on") from exc


class Lead:
    """Rank 0's learner: the calls every rank makes are announced first."""

    def __init__(self, learner: Learner, channel: Channel) -> None:
        self.learner = learner
        self.channel = channel
        self.closed = False

    @property
    def version(self) -> int:
        return self.learner.version

    @version.setter
    def version(self, value: int) -> None:
        self.learner.version = value

    @property
    def config(self) -> Any:
        return self.learner.config

    @property
    def team(self) -> Any:
        return self.learner.team

    def train_step(self, step: StepInput, at: tuple[int, int] = (0, 1)) -> dict[str, Any]:
        with _together("a training step"):
            _say(self.channel, "train_step", step, at, self.learner.version)
            return self.learner.train_step(step, at)

    def engine_weights(self) -> dict[str, Any]:
        with _together("the gathering of the weights for the engine"):
            _say(self.channel, "engine_weights")
            return self.learner.engine_weights()

    @property
    def trains_adapter(self) -> bool:
        return self.learner.trains_adapter

    def write_adapter(self, folder: Path) -> Path:
        """The adapter, gathered by every rank (announced as ``engine_weights``), written by rank 0."""
        with _together("the gathering of the adapter for the engine"):
            _say(self.channel, "engine_weights")
            return self.learner.write_adapter(folder)

    def merged_weights(self) -> dict[str, Any]:
        return self.learner.merged_weights()  # refused on a team (sharding.py): no call to announce

    def keep_weights_in(self, views: dict[str, Any]) -> int:
        """Sharded parameters cannot live in the engine's buffer: every push copies into it."""
        return 0

    def save(self, root: Path, step: int, state: dict[str, Any], keep: int, model_files: Any) -> Path | None:
        with _together("a checkpoint"):
            _say(self.channel, "save")
            return self.learner.save(root, step, state, keep, model_files)

    def restore(self, path: Path) -> dict[str, Any]:
        with _together("a resume"):
            _say(self.channel, "restore", str(path))
            return self.learner.restore(path)

    def close(self) -> None:
        """Release the followers (they return from :func:`follow`); once."""
        if not self.closed:
            self.closed = True
            _say(self.channel, STOP)


def follow(learner: Learner, channel: Channel) -> int:
    """Make rank 0's announced calls on ``learner`` until it says stop; returns the steps trained."""
    steps = 0
    while True:
        call = _hear(channel)
        kind = call[0]
        if kind == STOP:
            return steps
        if kind == "train_step":
            _, step, at, version = call
            learner.version = version
            learner.train_step(step, at)
            steps += 1
        elif kind == "engine_weights":
            learner.engine_weights()
        elif kind == "save":
            learner.save(Path(), 0, {}, 1, ())
        elif kind == "restore":
            learner.restore(Path(call[1]))
        else:
            raise RuntimeError(f"rank {learner.team.rank}: rank 0 announced an unknown call {kind!r}")
