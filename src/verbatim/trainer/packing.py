"""How a step's rows are cut into microbatches: so many rows each, or up to a budget of tokens (pure).

A right-padded microbatch costs its row count × its longest row, whatever the shorter rows hold, so
counting rows pads a 200-token rollout to the 8,000-token one beside it. :class:`Microbatching` with a
token budget packs rows longest first: each microbatch opens on the longest row left and takes the
next ones while (rows × that longest row) stays within the budget, so rows of like length share a
microbatch. PrefixFlow's suffixes are packed the same way by their own lengths (the prefix they read
is held once, apart). A row longer than the budget goes alone (the run refuses a budget below its
context length before it starts, so that is for callers outside a run).

:func:`padding` counts the padded slots a split computes for nothing: the step's ``padding_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verbatim.errors import TrainerError


@dataclass(frozen=True)
class Microbatching:
    """``rows`` consecutive rows a microbatch, or (``tokens`` set) up to ``tokens`` padded tokens each."""

    rows: int = 4
    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise TrainerError(f"microbatch must be at least 1 row, got {self.rows}")
        if self.tokens is not None and self.tokens < 1:
            raise TrainerError(f"a microbatch's token budget must be at least 1, got {self.tokens}")

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices into ``lengths`` (each row's tokens), one list a microbatch, covering every row once."""
        if self.tokens is None:
            return microbatches(len(lengths), self.rows)
        return by_tokens(lengths, self.tokens)


def microbatches(count: int, size: int) -> list[list[int]]:
    """Rows 0..``count``-1 in order, ``size`` per microbatch."""
    return [list(range(i, min(i + size, count))) for i in range(0, count, size)]


def by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Longest first: each microbatch opens on the longest row left and holds as many of the next as keep
    rows × that row's length within ``budget`` (a tie in length keeps the rows' order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def padded(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """The tokens one right-padded microbatch computes: its rows × its longest row."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


def padding(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Padded slots over ``batches``: computed tokens that are no row's."""
    return sum(padded(lengths, batch) - sum(lengths[i] for i in batch) for batch in batches)
