"""Held-out tasks: the part of an env's task space training never draws from, which evaluation draws from.

An env factory may say which of its tasks are held out: ``held_out(task) -> bool``, a rule on the task's
content (never its id). The built-in envs do: ``guess`` holds out one target in five, ``longdoc`` the
documents of one seed in five, ``tools`` and ``python`` one task in five by a hash of its content. Training
then draws only tasks the rule keeps (:func:`draw` with ``held_out=False``) and an evaluation only tasks it
holds out (``held_out=True``), both from the env's own seeded generator: no eval task equals a training task,
by construction, however small the task space.

A factory without the rule still gets eval tasks from seeds training never uses (:func:`eval_seed`); tasks of
a small space may then repeat training's, which :func:`overlap` finds and a training run refuses unless
``--allow-overlap`` (jobs/evaluate.py).
Pure: no I/O beyond the factory's own generator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from verbatim.errors import InputError

SHARE = 5
"""One task in this many is held out (20 %)."""
EVAL_SEED_BASE = 2**62
"""Eval tasks are drawn with seeds from here up: every training seed (``seed × 100_003 + step`` with a seed below
2³², run's ``seed``) is smaller."""
MOST_DRAWS = 64
"""A draw asks the generator for at most this many times the tasks it needs before it says the part is too
small."""


def eval_seed(seed: int) -> int:
    """The generator seed of a run's eval tasks: apart from every seed its training draws with."""
    return EVAL_SEED_BASE + seed


def content_key(task: dict[str, Any]) -> str:
    """A task's content as one string: the task without its ``id``, keys sorted (two tasks are equal when this is)."""
    return json.dumps({k: v for k, v in task.items() if k != "id"}, sort_keys=True, default=str)


def hashed_share(task: dict[str, Any]) -> bool:
    """One task in :data:`SHARE` by a hash of its content: the rule of an env whose tasks are many and varied."""
    digest = hashlib.sha256(content_key(task).encode()).digest()
    return int.from_bytes(digest[:8], "big") % SHARE == 0


def rule_of(factory: Any) -> Callable[[dict[str, Any]], bool] | None:
    """The factory's held-out rule, None where it has none."""
    rule = getattr(factory, "held_out", None)
    return rule if callable(rule) else None


def draw(factory: Any, count: int, seed: int, *, held_out: bool) -> list[dict[str, Any]]:
    """``count`` tasks from the factory's generator under ``seed``: those its rule holds out (``held_out``) or
    those it keeps for training, in the generator's order. A factory without a rule: its first ``count`` tasks
    (training as ever; an evaluation passes :func:`eval_seed`). The part being too small for ``count`` in
    :data:`MOST_DRAWS` × ``count`` tasks is one line."""
    rule = rule_of(factory)
    if rule is None:
        return list(factory.tasks(count, seed))
    asked = count
    while True:
        made = list(factory.tasks(asked, seed))
        chosen = [task for task in made if bool(rule(task)) == held_out][:count]
        if len(chosen) == count:
            return chosen
        if asked >= count * MOST_DRAWS or len(made) < asked:
            part = "held-out" if held_out else "training"
            raise InputError(f"env {factory.name!r} gave {len(chosen)} {part} tasks of the {count} asked in "
                             f"{len(made)} it generated: its {part} part is too small",
                             hint="widen the env's task space (--env-arg), or give --eval-tasks FILE")
        asked *= 2


def eval_tasks(factory: Any, count: int, seed: int) -> list[dict[str, Any]]:
    """An evaluation's tasks from the env's generator: held out (a factory with a rule) or of eval seeds, each
    named ``eval-{i}`` so that a trace says which tasks were evaluation's."""
    drawn = draw(factory, count, eval_seed(seed), held_out=True)
    return [{**task, "id": f"eval-{i}"} for i, task in enumerate(drawn)]


def overlap(trained: Sequence[dict[str, Any]], evaluated: Sequence[dict[str, Any]]) -> list[int]:
    """The indices of ``evaluated`` tasks whose content equals a ``trained`` one's."""
    seen = {content_key(task) for task in trained}
    return [i for i, task in enumerate(evaluated) if content_key(task) in seen]
