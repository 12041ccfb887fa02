"""Which rank trains which groups of a step: pure arithmetic, the same on every rank.

A group stays on one rank whole, so PrefixFlow still runs its shared prompt once. Groups go to ranks
longest first, each to the rank holding the fewest tokens so far (the lowest rank on a tie): the
classic longest-processing-time rule, whose busiest rank holds at most 4/3 of the best split's (Graham,
1969) and never more than the lightest rank plus one group.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.errors import TrainerError


def assign_groups(tokens: Sequence[int], ranks: int) -> list[list[int]]:
    """The groups (indices into ``tokens``, each group's token count) of each of ``ranks`` ranks, in order."""
    if ranks < 1:
        raise TrainerError(f"a step needs at least one rank, got {ranks}")
    if any(t < 0 for t in tokens):
        raise TrainerError(f"a group's token count cannot be negative: {list(tokens)}")
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for group in sorted(range(len(tokens)), key=lambda g: (-tokens[g], g)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owned[rank].append(group)
        load[rank] += tokens[group]
    return [sorted(groups) for groups in owned]


def rows_of(groups: Sequence[Sequence[int]], tokens: Sequence[int], ranks: int, rank: int) -> list[int]:
    """The rows rank ``rank`` trains: those of its groups (``tokens``: each row's length)."""
    if not 0 <= rank < ranks:
        raise TrainerError(f"rank {rank} is not one of the {ranks} ranks")
    per_group = [sum(tokens[r] for r in group) for group in groups]
    return sorted(r for g in assign_groups(per_group, ranks)[rank] for r in groups[g])
