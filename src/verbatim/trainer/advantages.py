"""Group-relative advantages: each rollout's reward against its group's other rewards.

A group is the G rollouts of one task prompt. Three estimators, each with a baseline taken
from the group itself (so G ≥ 2):

* ``"grpo"``: A_i = (r_i − mean(r)) / (std(r) + eps);
* ``"rloo"``: A_i = r_i − mean of the other G − 1 rewards (leave-one-out), which equals
  G/(G − 1) · (r_i − mean(r));
* ``"mean"``: A_i = r_i − mean(r), GRPO without the division by the group's std (Dr. GRPO,
  arXiv 2503.20783: dividing by the std weighs groups whose rewards barely differ, the tasks
  nearly always or nearly never solved, as much as the ones in between).

Each sums to 0 over the group. A group whose rewards are all equal carries no signal and
gets advantage 0 exactly (no rounding residue from the mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from verbatim.errors import InputError

Advantage = Literal["grpo", "rloo", "mean"]
ADVANTAGES: tuple[str, ...] = ("grpo", "rloo", "mean")


def group_advantages(rewards: Sequence[float], how: Advantage, eps: float = 1e-6) -> np.ndarray:
    """(G,) float64 advantages of one group's rewards.

    ``"grpo"`` divides by the population standard deviation (ddof=0): the spread of the
    group's own rewards, with no small-sample correction; ``eps`` keeps a group with std 0
    finite, and such a group (all rewards equal) gets advantage 0 exactly.
    ``"rloo"``: each reward minus the mean of the group's other rewards; ``"mean"``: each reward minus
    the group's mean.
    """
    if how not in ADVANTAGES:
        raise InputError(f"unknown advantage estimator {how!r}", hint=f"use one of {', '.join(ADVANTAGES)}")
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size < 2:
        size = "a group of one" if r.size == 1 else "an empty group"
        raise InputError(f"{size} has no baseline for {how} advantages", hint="use --group-size 2 or more")
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise InputError(f"reward {int(bad[0])} of the group is not finite ({r[bad[0]]})")
    if np.all(r == r[0]):
        return np.zeros(r.size, dtype=np.float64)
    centered = r - r.mean()
    if how == "grpo":
        return centered / (centered.std() + eps)
    if how == "mean":
        return centered
    return r - (r.sum() - r) / (r.size - 1)
