"""Opt-in group check of ``verbatim lint trace --groups``: was a group's shared prompt prefilled once?

The rollouts of a group start from the same task, so their first prompts share
a prefix (usually all of it). The harness sends one first request and holds the
others until it is answered; from then on the shared prefix is in the prefix
cache, and every other member's first turn should find it there. A member
*misses* when its first turn's cached tokens fall short of the longest prefix
it shares with another member's first prompt (capped at its prompt − 1, rounded
down to whole blocks). One miss per group is expected (the first request); more
than one is a problem of the group.

It is opt-in because a resumed run restarts the engine (an empty cache), and a
harness that starts a group's requests together legitimately misses more than
once; neither is a defect of the trace itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from verbatim.datamodel import Rollout, shared_prefix
from verbatim.lint.trace import CacheSettings, Problem, RolloutVerdict, turn_replicas


def first_prompt(rollout: Rollout) -> np.ndarray:
    return rollout.tokens.token_id[: rollout.turns[0].prompt_end]


def group_reusable(member: Rollout, others: Sequence[Rollout], block_size: int) -> int:
    """First-turn prompt tokens ``member`` could have found cached after another member's first request."""
    prompt = first_prompt(member)
    longest = max((shared_prefix(prompt, first_prompt(o)) for o in others), default=0)
    return max(min(longest, len(prompt) - 1), 0) // block_size * block_size


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
    if len(misses) <= 1:
        return None
    return Problem("group_prefill", 0,
                   f"{len(misses)} of {len(members)} rollouts prefilled the group's shared prompt again, "
                   f"expected at most 1 (cached/reusable: {', '.join(misses)})", group_cause(members, settings))


def group_cause(members: Sequence[Rollout], settings: CacheSettings) -> str:
    """Different replicas, different salts, a flush between first requests, else eviction (or a joint start)."""
    replicas = [turn_replicas(m) for m in members]
    if all(r is not None for r in replicas) and len({repr(r[0]) for r in replicas}) > 1:
        return "replica"
    if len({m.turns[0].cache_salt for m in members}) > 1:
        return "salt"
    if settings.cache_policy == "flush":
        firsts = {int(m.tokens.policy_version[m.turns[0].prompt_end]) for m in members if m.turns[0].completion_tokens}
        if len(firsts) > 1:
            return "flush"
    return "eviction"
