"""What the trace and group lints find, and the one rule for why a request missed the prefix cache.

Both lints (:mod:`verbatim.lint.trace` for the turns of a rollout,
:mod:`verbatim.lint.group` for the first turns of a group) report
:class:`Problem` records in :class:`RolloutVerdict` s, judge cache hits with the
run's :class:`CacheSettings`, and name a shortfall's likely cause with
:func:`miss_cause`: the requests that should have shared cache blocks were served
by different replicas, used different cache salts, or straddled a weight update
under the ``flush`` policy; otherwise the blocks were evicted.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verbatim.datamodel import FAILED_STATUSES, Rollout, Turn

CAUSES = ("replica", "salt", "flush", "eviction")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a rollout; ``turn`` is None when it concerns the whole rollout or a file."""

    kind: str
    turn: int | None
    detail: str
    cause: str | None = None

    def as_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": self.kind, "turn": self.turn, "detail": self.detail}
        if self.cause is not None:
            record["cause"] = self.cause
        return record


@dataclass(frozen=True)
class RolloutVerdict:
    rollout_id: str | None
    group_id: str | None
    problems: tuple[Problem, ...] = ()
    """What is wrong with its tokens: a trainer cannot trust them."""
    status: str | None = None
    turns: int = 0
    findings: tuple[Problem, ...] = ()
    """How its episode ended short, its tokens sound: ``failed`` (an error or an interruption: no reward) or
    ``truncated`` (--max-turns or the context came first), with the recorded reason."""

    @property
    def ok(self) -> bool:
        """Its tokens passed every check (a failed or truncated episode's tokens can)."""
        return not self.problems

    @property
    def failed(self) -> bool:
        return any(f.kind == "failed" for f in self.findings)

    def as_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "group_id": self.group_id, "ok": self.ok, "status": self.status,
                "problems": [p.as_json() for p in self.problems],
                "findings": [f.as_json() for f in self.findings]}


def episode_findings(rollout: Rollout) -> tuple[Problem, ...]:
    """``failed`` for an error or interrupted rollout, ``truncated`` for a cut one, with the reason it records
    and whether it still ended with a reward."""
    if rollout.status in FAILED_STATUSES:
        return (Problem("failed", None, f"{rollout.status}: {rollout.error}; no reward"),)
    if rollout.status == "truncated":
        reward = "no reward" if rollout.reward is None else f"reward {rollout.reward:g}"
        return (Problem("truncated", None, f"{rollout.error}; {reward}"),)
    return ()


@dataclass
class TraceReport:
    """One verdict per rollout, plus one per damaged file or failed group check (rollout_id None)."""

    verdicts: list[RolloutVerdict] = field(default_factory=list)
    run: Any = None
    """The run's :class:`~verbatim.lint.completeness.RunState` when linted from a run directory."""

    @property
    def ok(self) -> bool:
        """Every written rollout's tokens (and file) passed; says nothing of rollouts never written (see ``run``)
        nor of episodes that failed (see ``failed``)."""
        return all(v.ok for v in self.verdicts)

    @property
    def failed(self) -> int:
        """Rollouts that failed (error or interrupted)."""
        return sum(v.failed for v in self.verdicts)

    def exit_code(self, tokens_only: bool = False) -> int:
        """1 if a check failed, a rollout failed or the run is incomplete (unless only the tokens are asked
        about); truncated rollouts are findings, not failures."""
        if tokens_only:
            return 0 if self.ok else 1
        incomplete = self.run is not None and not self.run.complete
        return 0 if self.ok and not incomplete and not self.failed else 1


@dataclass(frozen=True)
class CacheSettings:
    """What the engine's prefix cache could reuse: its block size and the weight-update cache policy."""

    block_size: int
    cache_policy: str | None = None
    routing: bool = False
    """Whether the engine recorded each token's routed experts (``--record-routing``, ``--routing-replay``)."""

    @classmethod
    def from_manifest(cls, manifest: Any, run_dir: str | os.PathLike[str]) -> CacheSettings:
        """The run's settings; a manifest without the engine's block size is a TraceFormatError."""
        engine, config = manifest.engine or {}, manifest.config or {}
        policy = engine.get("cache_policy") or config.get("cache_policy")
        return cls(block_size=manifest.block_size(run_dir), cache_policy=str(policy) if policy else None,
                   routing=recorded_routing(config))


def recorded_routing(config: dict[str, Any]) -> bool:
    """Whether a run's recorded config (``run``, ``eval`` or ``train`` section) had the engine record the routed
    experts."""
    for section in config.values():
        if isinstance(section, dict) and ((section.get("engine") or {}).get("record_routing")
                                          or (section.get("learner") or {}).get("routing_replay")):
            return True
    return False


def miss_cause(replicas: Sequence[Any] | None, salts: Sequence[str | None], versions: Sequence[int | None],
               settings: CacheSettings) -> str:
    """Why requests that should have shared cached blocks did not: the first rule that applies.

    ``replicas``, ``salts`` and ``versions`` hold one entry per request involved (None for
    ``replicas`` when the trace does not say where requests ran; a None version for a request
    that sampled nothing): ``replica`` when they ran on different replicas, ``salt`` when their
    cache salts differ, ``flush`` when the cache policy flushes on a weight update and they
    sampled under different versions, else ``eviction``.
    """
    if replicas is not None and _differ(replicas):
        return "replica"
    if _differ(salts):
        return "salt"
    if settings.cache_policy == "flush" and _differ([v for v in versions if v is not None]):
        return "flush"
    return "eviction"


def _differ(values: Sequence[Any]) -> bool:
    return any(v != values[0] for v in values[1:])


def turn_replicas(rollout: Rollout) -> list[Any] | None:
    """Per-turn replica ids: each turn's ``replica`` (written by the router), else ``info["replicas"]``."""
    if rollout.turns and all(t.replica is not None for t in rollout.turns):
        return [t.replica for t in rollout.turns]
    replicas = rollout.info.get("replicas")
    if isinstance(replicas, list) and len(replicas) >= len(rollout.turns):
        return replicas
    return None


def sampled_version(rollout: Rollout, turn: Turn, *, last: bool) -> int | None:
    """The policy version of a turn's last (or first) sampled token; None for an empty completion."""
    if not turn.completion_tokens:
        return None
    at = turn.completion_end - 1 if last else turn.prompt_end
    return int(rollout.tokens.policy_version[at])
