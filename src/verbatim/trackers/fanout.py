"""The trackers of one run: opened at its start, sent each step, closed at its end.

:func:`open_trackers` imports each library named (a missing one is bad input: exit 2, before the engine
starts) and opens a run in it; :class:`Trackers` collects each step's rollouts as they finish and sends
the step's record and table when its metrics are written.
"""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator

from verbatim.datamodel import Rollout
from verbatim.errors import InputError, install_hint
from verbatim.trackers.records import rollout_row, scalars, table_rows

TRACKERS = {"wandb": ("wandb_run", "wandb"), "tensorboard": ("tensorboard_events", "tensorboard"),
            "mlflow": ("mlflow_run", "mlflow"), "trackio": ("trackio_run", "trackio")}
"""``--log`` name → (our module, the Python package it needs)."""


class Tracker(Protocol):
    """One tracker's run: ``log`` a step's numbers and rollout table (rows in ROLLOUT_COLUMNS order)."""

    name: str

    def log(self, step: int, metrics: dict[str, float], rollouts: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


def tracker_names(names: Iterable[str]) -> tuple[str, ...]:
    """``--log`` values checked and deduplicated, in the order given; an unknown one is one line, exit 2."""
    chosen: list[str] = []
    for name in names:
        if name not in TRACKERS:
            raise InputError(f"--log {name}: no such tracker", hint=f"one of {', '.join(TRACKERS)}")
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


TrackerNames = Annotated[tuple[str, ...], AfterValidator(tracker_names)]
"""A settings field of ``--log`` values: checked when the settings are built, before anything starts."""


def open_trackers(names: Iterable[str], run_dir: Path, config: Mapping[str, Any]) -> Trackers:
    """A run in each tracker named, called after ``run_dir``, with ``config`` as its parameters."""
    opened: list[Tracker] = []
    try:
        for name in tracker_names(names):
            module_name, package = TRACKERS[name]
            try:
                importlib.import_module(package)
            except ImportError as exc:
                raise InputError(f"--log {name} needs the {package} package, which is not installed ({exc})",
                                 hint=install_hint(name)) from None
            module = importlib.import_module(f"verbatim.trackers.{module_name}")
            opened.append(module.open_run(Path(run_dir), dict(config)))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return Trackers(opened)


class Trackers:
    """Sends each step to every tracker; one that raises is dropped with a warning (``metrics.jsonl`` keeps
    the record)."""

    def __init__(self, members: list[Tracker], warn: Callable[[str], None] | None = None) -> None:
        self.members = members
        self.warn = warn or (lambda line: print(line, file=sys.stderr))
        self._rows: dict[int, list[dict[str, Any]]] = defaultdict(list)

    def rollout(self, rollout: Rollout) -> None:
        """Keep ``rollout``'s row for its step's table (``info["step"]``; 0 outside training)."""
        self._rows[int(rollout.info.get("step") or 0)].append(rollout_row(rollout))

    def step(self, record: Mapping[str, Any]) -> None:
        """Send a step's record (its ``step`` key; 0 for a run's summary) and its rollouts' table."""
        step = int(record.get("step") or 0)
        numbers = scalars({key: value for key, value in record.items() if key != "step"})  # the x axis
        rows = table_rows(self._rows.pop(step, []))
        for tracker in list(self.members):
            try:
                tracker.log(step, numbers, rows)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop the run
                self.members.remove(tracker)
                self.warn(f"warning: --log {tracker.name} failed at step {step} and is dropped for the rest of "
                          f"the run ({type(exc).__name__}: {exc}); metrics.jsonl has every step")

    def after(self, then: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
        """A step callback that sends the record to the trackers, then calls ``then`` (if any)."""
        def on_step(record: dict[str, Any]) -> None:
            self.step(record)
            if then is not None:
                then(record)
        return on_step

    def close(self) -> None:
        for tracker in self.members:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - closing one must not keep the others open
                self.warn(f"warning: --log {tracker.name} failed to close ({type(exc).__name__}: {exc})")
        self.members = []
