"""Each tracker's output read back with the tracker's own reader: step → metrics, step → rollout table, config.

Used by tests/test_trackers.py against what ``--log`` wrote in a run directory (offline modes only).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

Steps = dict[int, dict[str, float]]


def tensorboard(run_dir: Path) -> tuple[Steps, dict[int, str], str]:
    """TensorBoard's EventAccumulator over ``RUN_DIR/tensorboard``: scalars, the rollouts text, the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    steps: Steps = {}
    for tag in events.Tags()["scalars"]:
        for point in events.Scalars(tag):
            steps.setdefault(point.step, {})[tag] = point.value
    text = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("rollout_table")}
    config = events.Tensors("config")[0].tensor_proto.string_val[0].decode()
    return steps, text, config


def mlflow(run_dir: Path) -> tuple[Steps, dict[int, list[dict[str, Any]]], dict[str, str]]:
    """MLflow's client on the run's local store: metric histories, the rollout artifacts, the parameters."""
    from mlflow import MlflowClient

    from verbatim.trackers.mlflow_run import local_store

    client = MlflowClient(tracking_uri=local_store(run_dir))
    experiment = client.get_experiment_by_name("verbatim")
    (run,) = client.search_runs([experiment.experiment_id])
    steps: Steps = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            steps.setdefault(point.step, {})[key] = point.value
    tables = {}
    for artifact in client.list_artifacts(run.info.run_id, "rollout_table"):
        local = client.download_artifacts(run.info.run_id, artifact.path, str(run_dir / "mlflow-read"))
        tables[int(Path(artifact.path).stem.removeprefix("step-"))] = json.loads(Path(local).read_text())
    return steps, tables, run.data.params


def wandb(run_dir: Path) -> tuple[Steps, dict[int, dict[str, Any]], dict[str, Any]]:
    """The offline run's transaction log through wandb's own DataStore and Record protos: history rows by
    ``_step`` (a table as the JSON file its row points to), the config."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (log,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    store = datastore.DataStore()
    store.open_for_scan(log)
    steps: Steps = {}
    tables: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "config":
            config |= {u.key: json.loads(u.value_json) for u in record.config.update}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(row.pop("_step"))
            if "rollout_table/path" in row:
                files = Path(log).parent / "files"
                tables[step] = json.loads((files / row["rollout_table/path"]).read_text())
            steps[step] = {k: float(v) for k, v in row.items()
                           if not k.startswith(("_", "rollout_table/")) and isinstance(v, (int, float))}
    return steps, tables, config


def trackio(project: str, run: str) -> tuple[Steps, dict[int, Any], dict[str, Any]]:
    """trackio's local SQLite storage (``TRACKIO_DIR``): logged rows by step, the run's config."""
    from trackio.sqlite_storage import SQLiteStorage

    steps: Steps = {}
    tables: dict[int, Any] = {}
    for row in SQLiteStorage.get_logs(project, run):
        step = int(row.pop("step"))
        if "rollout_table" in row:
            tables[step] = row.pop("rollout_table")
        steps[step] = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "timestamp"}
    return steps, tables, SQLiteStorage.get_run_config(project, run) or {}
