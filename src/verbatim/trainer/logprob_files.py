"""The trainer's per-token log π of traced rollouts, in Parquet files beside a run's trace.

Two writers, one format: ``verbatim mismatch RUN_DIR --save`` writes
``RUN_DIR/trainer_logprobs.parquet``, and ``verbatim train`` writes one file per step,
``RUN_DIR/trainer_logprobs/step-000NNN.parquet``, from the log π the learner computed before
its update (π_old). Each file has one row per rollout:

* ``rollout_id`` (string);
* ``logprob`` (list of float32, one per token of the rollout): log π of each model token,
  NaN for every other token;
* ``keep`` (list of bool, one per token): the correction kept the model token (no rule
  dropped it); false for every other token;
* ``routing_flips`` (list of int8, one per token, or empty): where the trace recorded routed experts and the
  writer replayed them (``verbatim mismatch`` on a MoE), in how many MoE layers the model's own router chose other
  experts for the token (files written before the column have none).

The file's key/value metadata ``verbatim`` holds JSON: ``writer`` (``mismatch`` or
``train``), ``model``, ``trainer_version``, ``step`` (training only) and ``correction`` (its
config). Files are written atomically (:func:`verbatim.durable.write_atomic`); the trace
files are never touched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from verbatim.durable import strict_json, write_atomic
from verbatim.errors import TraceFormatError

MISMATCH_FILE = "trainer_logprobs.parquet"
STEP_DIR = "trainer_logprobs"
META_KEY = b"verbatim"
SCHEMA = pa.schema([("rollout_id", pa.string()), ("logprob", pa.list_(pa.float32())), ("keep", pa.list_(pa.bool_())),
                    ("routing_flips", pa.list_(pa.int8()))])


@dataclass(frozen=True, eq=False)
class RolloutLogprobs:
    """One rollout's row: log π per token (NaN off the model's tokens), the correction's keep mask, and where
    known each token's count of MoE layers whose router chose other experts than the engine recorded."""

    rollout_id: str
    logprob: np.ndarray
    keep: np.ndarray
    flips: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.logprob) != len(self.keep):
            raise ValueError(f"{self.rollout_id}: {len(self.logprob)} logprobs but {len(self.keep)} keep flags")
        if self.flips is not None and len(self.flips) != len(self.keep):
            raise ValueError(f"{self.rollout_id}: {len(self.flips)} routing flips for {len(self.keep)} tokens")


def step_file(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / STEP_DIR / f"step-{step:06d}.parquet"


def mismatch_file(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / MISMATCH_FILE


def logprob_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The run's files: the training steps' in step order, then ``verbatim mismatch --save``'s."""
    run_dir = Path(run_dir)
    steps = sorted((run_dir / STEP_DIR).glob("step-*.parquet")) if (run_dir / STEP_DIR).is_dir() else []
    saved = mismatch_file(run_dir)
    return steps + ([saved] if saved.is_file() else [])


def write_logprobs(path: str | os.PathLike[str], rows: Sequence[RolloutLogprobs], meta: dict[str, Any]) -> Path:
    """Write ``rows`` to ``path`` atomically, with ``meta`` as the file's ``verbatim`` metadata."""
    path = Path(path)
    table = pa.Table.from_arrays([
        pa.array([r.rollout_id for r in rows], pa.string()),
        _lists([np.asarray(r.logprob, dtype=np.float32) for r in rows], pa.float32()),
        _lists([np.asarray(r.keep, dtype=bool) for r in rows], pa.bool_()),
        _lists([np.empty(0, np.int8) if r.flips is None else np.minimum(r.flips, 127).astype(np.int8)
                for r in rows], pa.int8()),
    ], schema=SCHEMA.with_metadata({META_KEY: strict_json(meta, sort_keys=True).encode()}))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
    return path


def _lists(arrays: list[np.ndarray], kind: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.empty(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=kind))


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's ``verbatim`` metadata (empty when it has none); TraceFormatError when it is no Parquet file."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(META_KEY)
        return json.loads(raw) if raw else {}
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceFormatError(f"{Path(path).name}: not a trainer logprob file ({exc})") from exc


def read_ids(path: str | os.PathLike[str]) -> list[str]:
    """The rollout ids a file holds (one column read)."""
    try:
        with pq.ParquetFile(path) as parquet:
            return parquet.read(columns=["rollout_id"]).column("rollout_id").to_pylist()
    except (pa.ArrowException, OSError, KeyError, ValueError) as exc:
        raise TraceFormatError(f"{Path(path).name}: not a trainer logprob file ({exc})") from exc


def read_logprobs(path: str | os.PathLike[str], rollout_ids: Sequence[str] | None = None) -> dict[str, RolloutLogprobs]:
    """The rows of a file by rollout id (only ``rollout_ids``, when given)."""
    try:
        with pq.ParquetFile(path) as parquet:
            table = parquet.read()
        if rollout_ids is not None:
            table = table.filter(pc.is_in(table.column("rollout_id"), pa.array(list(rollout_ids))))
        ids = table.column("rollout_id").to_pylist()
        logprobs = table.column("logprob").to_pylist()
        keeps = table.column("keep").to_pylist()
        flips = table.column("routing_flips").to_pylist() if "routing_flips" in table.column_names else \
            [None] * len(ids)
        return {rid: RolloutLogprobs(rid, np.asarray(lp, dtype=np.float32), np.asarray(keep, dtype=bool),
                                     np.asarray(flip, dtype=np.int8) if flip else None)
                for rid, lp, keep, flip in zip(ids, logprobs, keeps, flips)}
    except (pa.ArrowException, OSError, KeyError, ValueError, TypeError) as exc:
        raise TraceFormatError(f"{Path(path).name}: not a trainer logprob file ({exc})") from exc
