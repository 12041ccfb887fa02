"""An evaluation's figures from its rollouts: avg@K, the success rate and pass@k, overall and per task.

An evaluation is an ordinary run (``verbatim eval``, or ``RUN_DIR/eval/step-N/`` of ``train --eval-every``):
each group is one task and its members are the task's K samples. The figures are computed from the rollouts
alone, so a trace gives them again (:func:`folder_figures`): what ``--summary-json`` and ``metrics.jsonl`` say
is what the trace holds. Where the env says whether a sample solved its task, a sample that did not finish (an
error) did not; where it never says, the evaluation gets avg@K only (harness/pass_at_k.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verbatim.datamodel import Rollout
from verbatim.errors import InputError
from verbatim.harness.pass_at_k import by_task, summary
from verbatim.harness.store import read_run
from verbatim.harness.transcript import solved


def sample_solved(rollout: Rollout, judged: bool) -> bool | None:
    """Whether a sample solved its task: what the env said; in an evaluation whose env says it (``judged``),
    False for a sample that did not finish (an error, before the env could say); None otherwise."""
    said = solved(rollout)
    if said is None and judged and rollout.status != "ok":
        return False
    return said


def figures(rollouts: Sequence[Rollout], asked: Sequence[int] = (), version: int | None = None) -> dict[str, Any]:
    """The evaluation's figures (pass_at_k.summary) and a row per task; ``version``: the policy version every
    sampled token carries, checked (a token of another version is an error: the eval would not be of one
    policy)."""
    if version is not None:
        check_version(rollouts, version)
    rollouts = sorted(rollouts, key=lambda r: r.rollout_id)  # tasks in plan order, as the trace is not
    judged = any(solved(r) is not None for r in rollouts)  # the env says "solved" at all
    rows = [{"task_id": r.group_id, "reward": r.reward, "solved": sample_solved(r, judged)} for r in rollouts]
    scores = by_task(rows)
    found = summary(scores, asked)
    labels = {r.group_id: r.task.get("id", r.group_id) for r in rollouts}
    ks = list(found["pass_at_k"]) if found.get("pass_at_k") else []
    found["per_task"] = [{"task": labels[s.task_id], "group_id": s.task_id, "samples": s.samples,
                          "mean_reward": s.mean_reward, "success_rate": s.success_rate,
                          "pass_at_k": None if s.solved is None else {k: s.pass_at(int(k)) for k in ks}}
                         for s in scores]
    return found if version is None else {"version": version, **found}


def check_version(rollouts: Sequence[Rollout], version: int) -> None:
    """Every sampled token of an evaluation carries ``version``."""
    for rollout in rollouts:
        other = sorted({int(v) for v in rollout.tokens.policy_version[rollout.tokens.loss_mask]} - {version})
        if other:
            raise InputError(f"evaluation rollout {rollout.rollout_id} holds tokens of version {other[0]}, "
                             f"not {version}: an evaluation is of one policy")


def folder_figures(folder: Path, asked: Sequence[int] = (), version: int | None = None) -> dict[str, Any]:
    """The figures of the evaluation written in ``folder`` (its trace read again)."""
    return figures(read_run(folder).rollouts, asked, version)


def score(found: dict[str, Any] | None) -> float | None:
    """An evaluation's one figure for a curve: pass@1 where the env says solved, else avg@K (None: no
    evaluation)."""
    if not found:
        return None
    passes = found.get("pass_at_k") or {}
    return passes.get("1", found.get("mean_reward"))


def headline(found: dict[str, Any]) -> str:
    """One line: pass@1 and pass@K (where the env says solved), avg@K, tasks × samples."""
    samples, tasks = found["samples"], found["tasks"]
    passes = found.get("pass_at_k") or {}
    shown = [f"pass@{k} {passes[k]:.3f}" for k in dict.fromkeys(("1", str(samples))) if k in passes]
    return ", ".join([*shown, f"avg@{samples} {found['mean_reward']:.3f}", f"{tasks} tasks × {samples} samples"])
