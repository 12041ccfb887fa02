"""The calls of one pass that every rank makes together: each rank's shape, and the one they agree on (pure).

FSDP2 gathers a decoder layer's weights when its forward starts and frees them after (per-layer
resharding), gathers them again for its backward and reduce-scatters its gradient at once: collectives
every rank must make in the same order. A rank's own work is uneven (its groups, whole), so before each
pass the ranks agree on a :class:`CallShape` and each fills what it lacks with idle calls: the same
forward (and backward) through every layer on one token, with a loss of zero.

A pass is made of PrefixFlow groups, then plain microbatches. A group is phase A (a forward), phase B's
suffix microbatches (a forward and a backward each), phase C (a backward); a plain microbatch is a
forward and a backward, or a forward alone in the passes without a gradient (π_old, the reference's
log π, the truncation count). A rank runs its groups with the most suffix microbatches first, so the
agreed shape (the maximum, slot by slot, of the ranks' sorted counts) pads the least.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verbatim.errors import TrainerError


@dataclass(frozen=True)
class CallShape:
    """One rank's calls in a pass: each PrefixFlow group's phase-B microbatches (most first), then plain ones."""

    flows: tuple[int, ...] = ()
    plain: int = 0

    def __post_init__(self) -> None:
        if self.plain < 0 or any(count < 1 for count in self.flows):
            raise TrainerError(f"a pass's calls cannot be negative, nor a group without a suffix microbatch: {self}")
        if list(self.flows) != sorted(self.flows, reverse=True):
            raise TrainerError(f"a pass's groups run with the most suffix microbatches first, got {list(self.flows)}")

    @property
    def calls(self) -> int:
        """Forward passes through the layers: phase A and each phase-B microbatch of a group, each plain one."""
        return sum(1 + count for count in self.flows) + self.plain


def agree(shapes: Sequence[CallShape]) -> CallShape:
    """The shape every rank runs: as many groups as the rank with the most, each with the most suffix
    microbatches any rank has in that slot, and the most plain microbatches."""
    if not shapes:
        raise TrainerError("no rank's shape to agree on")
    slots = max(len(shape.flows) for shape in shapes)
    flows = tuple(max((shape.flows[j] for shape in shapes if j < len(shape.flows)), default=0)
                  for j in range(slots))
    return CallShape(flows, max(shape.plain for shape in shapes))


def idle_calls(mine: CallShape, agreed: CallShape) -> int:
    """The forward passes this rank makes on one token for nothing (``agreed`` covers ``mine``)."""
    return agreed.calls - mine.calls


def as_numbers(shape: CallShape, slots: int) -> list[int]:
    """``shape`` as ``slots`` + 1 numbers (groups padded with 0, then the plain count): what the ranks'
    all-reduce of the maximum takes; :func:`from_numbers` reads it back."""
    if len(shape.flows) > slots:
        raise TrainerError(f"{len(shape.flows)} groups do not fit {slots} slots")
    return [*shape.flows, *[0] * (slots - len(shape.flows)), shape.plain]


def from_numbers(numbers: Sequence[int]) -> CallShape:
    return CallShape(tuple(int(n) for n in numbers[:-1] if n > 0), int(numbers[-1]))
