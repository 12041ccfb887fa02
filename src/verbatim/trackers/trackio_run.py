"""trackio: a run in the project ``verbatim`` of trackio's local database (``TRACKIO_DIR``), its config, a
``log`` per step with a ``trackio.Table`` of rollouts. ``trackio show`` opens its dashboard. trackio prints
its progress on stdout; it goes to stderr here, with the rest of a run's chatter."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import trackio

from verbatim.trackers.records import ROLLOUT_COLUMNS, TABLE


class TrackioRun:
    name = "trackio"

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, metrics: dict[str, float], rollouts: list[list[Any]]) -> None:
        data: dict[str, Any] = dict(metrics)
        if rollouts:
            data[TABLE] = trackio.Table(columns=list(ROLLOUT_COLUMNS), data=rollouts)
        with contextlib.redirect_stdout(sys.stderr):
            self.run.log(data, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()


def open_run(run_dir: Path, config: dict[str, Any]) -> TrackioRun:
    with contextlib.redirect_stdout(sys.stderr):
        run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "verbatim"), name=run_dir.name,
                           config=config)
    return TrackioRun(run)
