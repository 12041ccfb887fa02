"""Weights & Biases: ``wandb.init`` in the run directory (``RUN_DIR/wandb``), one ``log`` per step with a
``wandb.Table`` of rollouts. ``WANDB_MODE=offline`` writes the run there without an account; ``WANDB_PROJECT``
names the project (``verbatim`` by default)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import wandb

from verbatim.errors import InputError
from verbatim.trackers.records import ROLLOUT_COLUMNS, TABLE


class WandbRun:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, metrics: dict[str, float], rollouts: list[list[Any]]) -> None:
        data: dict[str, Any] = dict(metrics)
        if rollouts:
            data[TABLE] = wandb.Table(columns=list(ROLLOUT_COLUMNS), data=rollouts)
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def open_run(run_dir: Path, config: dict[str, Any]) -> WandbRun:
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "verbatim"), name=run_dir.name,
                         dir=str(run_dir), config=config)
    except Exception as exc:  # no API key and no offline mode, a refused login: what to set is the fix
        raise InputError(f"--log wandb could not start a run: {type(exc).__name__}: {exc}",
                         hint="log in (wandb login), or set WANDB_MODE=offline to write the run locally") from None
    return WandbRun(run)
