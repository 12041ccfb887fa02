"""pass@k: the chance that at least one of k samples of a task solves it, estimated from n samples of which c did.

The unbiased estimator of Chen et al. 2021 (arXiv 2107.03374): pass@k = 1 − C(n−c, k) / C(n, k), computed as
1 − ∏_{i=n−c+1}^{n} (1 − k/i), which never forms the binomials (they overflow for the n of a large eval). Over
tasks, the figure is the mean of the tasks' estimates. Pure: an evaluation (``verbatim eval``, issue #46) feeds it
each task's samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verbatim.errors import InputError


def pass_at_k(n: int, c: int, k: int) -> float:
    """The estimate for one task: ``n`` samples, ``c`` of them solved it, ``k`` draws (1 ≤ k ≤ n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise InputError(f"pass@{k} of {c} solved in {n} samples: need 0 <= solved <= samples and 1 <= k <= samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class TaskScore:
    """One task's samples: their rewards and, where the env says so, whether each solved the task."""

    task_id: str
    rewards: tuple[float, ...]
    solved: tuple[bool, ...] | None
    """None: the env never says "solved" for this task (avg@K only)."""

    @property
    def samples(self) -> int:
        return len(self.rewards)

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    @property
    def success_rate(self) -> float | None:
        return None if self.solved is None else sum(self.solved) / len(self.solved)

    def pass_at(self, k: int) -> float | None:
        return None if self.solved is None else pass_at_k(len(self.solved), sum(self.solved), k)


def ks(samples: int) -> tuple[int, ...]:
    """The k reported for ``samples`` samples a task: 1, the powers of two between, and ``samples``."""
    found, k = [], 1
    while k < samples:
        found.append(k)
        k *= 2
    return (*found, samples)


def check_ks(asked: Sequence[int], samples: int, flag: str = "--pass-k") -> tuple[int, ...]:
    """The k an eval reports: ``asked`` and 1 (every curve's figure), checked against the ``samples`` each task
    gets; else :func:`ks`."""
    if not asked:
        return ks(samples)
    wrong = [k for k in asked if not 1 <= k <= samples]
    if wrong:
        raise InputError(f"{flag} {','.join(map(str, asked))}: pass@{wrong[0]} needs 1 <= k <= the {samples} "
                         "samples a task gets", hint=f"ask for k up to {samples}, or raise the samples per task")
    return tuple(sorted({1, *asked}))


def ks_fit(asked: Sequence[int], samples: int, flag: str) -> None:
    """:func:`check_ks` as a config's rule across two fields: pydantic's ValueError (``--config`` waits for
    both)."""
    try:
        check_ks(asked, samples, flag)
    except InputError as exc:
        raise ValueError(exc.message) from None


def summary(tasks: Sequence[TaskScore], asked: Sequence[int] = ()) -> dict[str, object]:
    """The eval's figures: mean reward (avg@K), success rate and pass@k over the tasks that say "solved" (the
    mean of their estimates), for the k ``asked`` (default :func:`ks`), up to the fewest samples any task has."""
    if not tasks:
        raise InputError("an evaluation needs at least one task")
    judged = [t for t in tasks if t.solved is not None]
    fewest = min(t.samples for t in tasks)
    figures: dict[str, object] = {"tasks": len(tasks), "samples": fewest,
                                  "mean_reward": sum(t.mean_reward for t in tasks) / len(tasks)}
    if judged:
        figures["success_rate"] = sum(t.success_rate or 0.0 for t in judged) / len(judged)
        figures["pass_at_k"] = {str(k): sum(t.pass_at(k) or 0.0 for t in judged) / len(judged)
                                for k in check_ks(asked, fewest)}
    else:
        figures["success_rate"] = figures["pass_at_k"] = None
        figures["why_no_pass_at_k"] = "the env never said whether a rollout solved its task: avg@K only"
    return figures


def by_task(rows: Sequence[Mapping[str, object]]) -> list[TaskScore]:
    """Rollout rows (``task_id``, ``reward``, ``solved`` True/False/None) grouped by task, in first-seen order; a
    task scores "solved" only where every one of its samples says yes or no."""
    grouped: dict[str, list[Mapping[str, object]]] = {}
    for row in rows:
        grouped.setdefault(str(row["task_id"]), []).append(row)
    scores = []
    for task_id, members in grouped.items():
        said = [m.get("solved") for m in members]
        solved = tuple(bool(s) for s in said) if all(s is not None for s in said) else None
        scores.append(TaskScore(task_id, tuple(float(m.get("reward") or 0.0) for m in members), solved))
    return scores
