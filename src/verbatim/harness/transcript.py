"""A rollout as a reader follows it: its tokens cut where the writer changes (prompt, env, model).

Each model part carries the turn it was sampled in (finish reason, cached tokens, reward), its
sampler logprobs in summary and the policy versions that sampled it; :func:`ending` says how the
rollout ended. Pure: ``verbatim show`` (:mod:`verbatim.cli.show`) decodes and prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout, Source, Turn


@dataclass(frozen=True)
class Part:
    """A run of tokens written by one source: ``token_ids[start:end]`` of the rollout."""

    source: Source | None
    """None for a source value the schema does not know (``verbatim lint trace`` names it)."""
    start: int
    end: int
    token_ids: tuple[int, ...]
    turn: Turn | None = None
    """The turn a model part was sampled in (None for prompt and env parts)."""
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    """The distinct policy versions that sampled a model part, in order."""

    @property
    def label(self) -> str:
        return {Source.PROMPT: "prompt", Source.ENV: "env", Source.MODEL: "model"}.get(self.source, "?")

    def logprob_summary(self) -> str | None:
        """``sum -3.21 · mean -0.27 · min -2.10`` over the finite sampler logprobs, None if there are none."""
        finite = [lp for lp in self.logprobs if math.isfinite(lp)]
        if not finite:
            return None
        return f"logprob sum {sum(finite):.2f} · mean {sum(finite) / len(finite):.2f} · min {min(finite):.2f}"


def parts(rollout: Rollout) -> list[Part]:
    """The rollout's tokens cut at every change of source, model parts matched to their turns."""
    tokens = rollout.tokens
    sources = tokens.source
    if not len(sources):
        return []
    cuts = [0, *(np.flatnonzero(np.diff(sources)) + 1).tolist(), len(sources)]
    turns = {turn.prompt_end: turn for turn in rollout.turns}
    out = []
    for start, end in zip(cuts, cuts[1:]):
        source = Source(int(sources[start])) if int(sources[start]) in Source._value2member_map_ else None
        ids = tuple(int(t) for t in tokens.token_id[start:end])
        if source is not Source.MODEL:
            out.append(Part(source=source, start=start, end=end, token_ids=ids))
            continue
        versions = tuple(dict.fromkeys(int(v) for v in tokens.policy_version[start:end]))
        out.append(Part(source=source, start=start, end=end, token_ids=ids, turn=turns.get(start),
                        logprobs=tuple(float(lp) for lp in tokens.logprob[start:end]), versions=versions))
    return out


def solved(rollout: Rollout) -> bool | None:
    """What the env last said in ``info["solved"]``; None where it never says."""
    said = rollout.info.get("env")
    value = said.get("solved") if isinstance(said, dict) else None
    return value if isinstance(value, bool) else None


def ending(rollout: Rollout) -> dict[str, Any]:
    """Why and how the rollout ended: status, error, stop reason, reward, solved, turns, versions."""
    model = rollout.tokens.source == Source.MODEL
    versions = sorted({int(v) for v in rollout.tokens.policy_version[model]})
    last = rollout.turns[-1].finish_reason if rollout.turns else None
    return {"status": rollout.status, "error": rollout.error, "stop_reason": rollout.info.get("stop_reason"),
            "last_finish_reason": last, "reward": rollout.reward, "solved": solved(rollout),
            "turns": len(rollout.turns), "tokens": len(rollout.tokens), "versions": versions}
