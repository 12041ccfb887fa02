"""Is the run whole? What a run directory's manifest says about the run against what it holds.

Token checks judge each rollout that was written; they cannot see rollouts that never were. A run
killed mid-way (manifest still ``running``), stopped (``interrupted``), failed (``failed``), or one
holding fewer rollouts than it planned, or one whose manifest records no status or no config (edited,
or written by another tool) is incomplete, however clean its written rollouts are.
Pure: a manifest and the rollouts in, a :class:`RunState` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verbatim.datamodel import Rollout

FINISHED = "completed"
RECORDED = ("status", "config")
"""The manifest fields the verdict reads: a manifest without one cannot say the run is whole."""


@dataclass(frozen=True)
class RunState:
    status: str
    planned: int | None
    """Rollouts the run's config plans (None when the manifest does not say)."""
    written: int
    errors: int
    first_error: str | None = None
    interrupted: int = 0
    truncated: int = 0
    truncated_without_reward: int = 0
    missing: tuple[str, ...] = ()
    """Fields of :data:`RECORDED` that the manifest file lacks."""

    @property
    def complete(self) -> bool:
        return self.why_incomplete() is None

    def why_incomplete(self) -> str | None:
        if self.missing:
            return f"the manifest records no {' and no '.join(self.missing)}: how the run ended or what it planned " \
                   "is unknown"
        if self.status == "running":
            return "the manifest still says running: the run was killed, or is being written now"
        if self.status != FINISHED:
            return f"the run ended {self.status}"
        if self.interrupted:
            return f"{self.interrupted} rollouts were interrupted (a resume plays them again)"
        if self.planned is not None and self.written < self.planned:
            return f"{self.planned - self.written} of {self.planned} planned rollouts were never written"
        return None

    def line(self) -> str:
        planned = "?" if self.planned is None else str(self.planned)
        text = (f"run {self.status}, {self.written}/{planned} planned rollouts written, {self.errors} ended in error"
                + (f", {self.interrupted} interrupted" if self.interrupted else "")
                + (f", {self.truncated} truncated ({self.truncated_without_reward} without a reward)"
                   if self.truncated else ""))
        why = self.why_incomplete()
        return text + (f" — incomplete: {why}" if why else "")

    def as_json(self) -> dict[str, Any]:
        return {"kind": "run", "status": self.status, "planned": self.planned, "written": self.written,
                "errors": self.errors, "first_error": self.first_error, "interrupted": self.interrupted,
                "truncated": self.truncated, "truncated_without_reward": self.truncated_without_reward,
                "complete": self.complete,
                "missing": list(self.missing), "why_incomplete": self.why_incomplete()}


def run_state(manifest: Any, rollouts: list[Rollout]) -> RunState:
    errored = [r for r in rollouts if r.status == "error"]
    first = errored[0].error if errored else None
    truncated = [r for r in rollouts if r.status == "truncated"]
    return RunState(status=str(manifest.status), planned=planned_rollouts(manifest.config or {}),
                    written=len({r.rollout_id for r in rollouts}), errors=len(errored),
                    first_error=None if first is None else str(first)[:200],
                    interrupted=sum(r.status == "interrupted" for r in rollouts), truncated=len(truncated),
                    truncated_without_reward=sum(r.reward is None for r in truncated),
                    missing=tuple(name for name in RECORDED if name not in manifest.model_fields_set))


def planned_rollouts(config: dict[str, Any]) -> int | None:
    """``groups × group_size`` of a ``verbatim run`` plan; ``steps × groups × group_size`` of a training run."""
    train = config.get("train")
    if isinstance(train, dict):
        plan = train.get("plan") if isinstance(train.get("plan"), dict) else {}
        return _product(plan, ("steps", "groups", "group_size"))
    plan = config.get("plan")
    return _product(plan, ("groups", "group_size")) if isinstance(plan, dict) else None


def _product(plan: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    values = [plan.get(k) for k in keys]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    total = 1
    for v in values:
        total *= v
    return total
