"""MLflow: a run in the experiment ``MLFLOW_EXPERIMENT_NAME`` (``verbatim`` by default) of the store at
``MLFLOW_TRACKING_URI``, else of a local store in ``RUN_DIR/mlruns``; parameters from the config, a metric per
number and step, each step's rollout table as the artifact ``rollout_table/step-NNNNNN.json``. Through
``MlflowClient``: no process-wide active run is left behind.

The local store is MLflow's file store, which MLflow 3 keeps in maintenance mode and refuses unless
``MLFLOW_ALLOW_FILE_STORE`` is set (set here for that store only); give ``MLFLOW_TRACKING_URI`` a database or
a server to use one."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from verbatim.trackers.records import ROLLOUT_COLUMNS, TABLE, flat_config

PARAM_CHARS = 6000
"""MLflow's limit on a parameter's value (a longer one is cut)."""
BATCH = 1000
"""Metrics per ``log_batch`` call (MLflow's limit)."""


def local_store(run_dir: Path) -> str:
    return (run_dir / "mlruns").resolve().as_uri()


class MlflowRun:
    name = "mlflow"

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log(self, step: int, metrics: dict[str, float], rollouts: list[list[Any]]) -> None:
        stamp = int(time.time() * 1000)
        entries = [Metric(name, value, stamp, step) for name, value in metrics.items()]
        for start in range(0, len(entries), BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start:start + BATCH])
        if rollouts:
            table = [dict(zip(ROLLOUT_COLUMNS, row, strict=True)) for row in rollouts]
            self.client.log_dict(self.run_id, table, f"{TABLE}/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_run(run_dir: Path, config: dict[str, Any]) -> MlflowRun:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = local_store(run_dir)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "verbatim")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=run_dir.name)
    params = [Param(key, value[:PARAM_CHARS]) for key, value in flat_config(config).items()]
    for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
        client.log_batch(run.info.run_id, params=params[start:start + 100])
    return MlflowRun(client, run.info.run_id)
