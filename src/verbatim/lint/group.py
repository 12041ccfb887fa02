"""Opt-in group check of ``verbatim lint trace --groups``: was a group's shared prompt prefilled once?

The rollouts of a group start from the same task, so their first prompts share
a prefix (usually all of it). The harness sends one first request and holds the
others until it is answered; from then on the shared prefix is in the prefix
cache, and every other member's first turn should find it there. A member
*misses* when its first turn's cached tokens fall short of what it could reuse
of another member's first prompt (:func:`verbatim.prefix_cache.group_reusable`:
the longest shared prefix, capped at its prompt − 1, in whole blocks). One miss
per group is expected (the first request); more than one is a problem of the
group, with its cause named by :func:`verbatim.lint.findings.miss_cause`.

It is opt-in because a resumed run restarts the engine (an empty cache), and a
harness that starts a group's requests together legitimately misses more than
once; neither is a defect of the trace itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from verbatim.datamodel import Rollout
from verbatim.lint.findings import CacheSettings, Problem, RolloutVerdict, miss_cause, sampled_version, turn_replicas
from verbatim.prefix_cache import GROUP_PREFILLS, group_prefilled_once
from verbatim.prefix_cache import group_reusable as reusable_of_prompts


def first_prompt(rollout: Rollout) -> np.ndarray:
    return rollout.tokens.token_id[: rollout.turns[0].prompt_end]


def group_reusable(member: Rollout, others: Sequence[Rollout], block_size: int) -> int:
    """First-turn prompt tokens ``member`` could have found cached after another member's first request."""
    return reusable_of_prompts(first_prompt(member), [first_prompt(o) for o in others], block_size)


def check_groups(rollouts: Sequence[Rollout], settings: CacheSettings) -> list[RolloutVerdict]:
    """One verdict (rollout_id None) per group whose shared prompt was prefilled more than once."""
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        if r.turns:
            groups.setdefault(r.group_id, []).append(r)
    verdicts = []
    for group_id, members in groups.items():
        problem = check_group(members, settings)
        if problem is not None:
            verdicts.append(RolloutVerdict(None, group_id, (problem,), turns=0))
    return verdicts


def check_group(members: Sequence[Rollout], settings: CacheSettings) -> Problem | None:
    misses = []
    for member in members:
        others = [o for o in members if o is not member]
        reusable = group_reusable(member, others, settings.block_size)
        if member.turns[0].cached_tokens < reusable:
            misses.append(f"{member.rollout_id} ({member.turns[0].cached_tokens}/{reusable})")
    if group_prefilled_once(len(misses)):
        return None
    return Problem("group_prefill", 0,
                   f"{len(misses)} of {len(members)} rollouts prefilled the group's shared prompt again, "
                   f"expected at most {GROUP_PREFILLS} (cached/reusable: {', '.join(misses)})",
                   group_cause(members, settings))


def group_cause(members: Sequence[Rollout], settings: CacheSettings) -> str:
    """Why the members' first requests did not share the prompt's blocks (see ``miss_cause``)."""
    replicas = [turn_replicas(m) for m in members]
    firsts = [r[0] for r in replicas] if all(r is not None for r in replicas) else None
    return miss_cause(firsts, [m.turns[0].cache_salt for m in members],
                      [sampled_version(m, m.turns[0], last=False) for m in members], settings)
