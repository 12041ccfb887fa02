"""A benchmark never reports over failed work.

A table measured over errored rollouts or failed requests compares harnesses that did not do the
same work (a harness whose rollouts died in their first turn "prefills less"). Every benchmark
hands what it played to :func:`require_clean` before it makes a table; any failure is a
:class:`~verbatim.errors.BenchmarkError` that names how many failed, where, and the first errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from verbatim.errors import BenchmarkError

SHOWN = 3
"""Distinct error messages named in the one line."""


def require_clean(where: str, errors: Iterable[str | None], total: int | None = None) -> None:
    """Raise if any of ``errors`` (one entry per rollout or request; None where it succeeded) is set."""
    errors = list(errors)
    failed = [e for e in errors if e]
    if not failed:
        return
    counts = Counter(failed)
    named = "; ".join(f"{message} (×{n})" if n > 1 else message for message, n in counts.most_common(SHOWN))
    more = f"; and {len(counts) - SHOWN} other errors" if len(counts) > SHOWN else ""
    of = total if total is not None else len(errors)
    raise BenchmarkError(f"{where}: {len(failed)} of {of} failed, so no table: {named}{more}",
                         hint="fix the workload (the trace holds each rollout's error) and run the benchmark again")
