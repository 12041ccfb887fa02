"""The rollout list of a run from a few columns of each batch file, and one rollout read on demand.

Opening a run must not decode every token: :func:`index_batch` reads only the columns the
list shows (ids, group, status, error, reward, turns, and the token count from the
``token_id`` list offsets; never ``info``, which may hold a whole conversation) with
pyarrow, without building :class:`~verbatim.datamodel.Rollout` objects, a few files at a
time. A batch is indexed once per (size, mtime); :func:`read_batch` reads a whole batch when
a rollout of it is opened or linted. JSON-lines runs have no columns to pick: their batches
are read whole once and kept.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from verbatim.datamodel import Rollout
from verbatim.errors import TraceFormatError
from verbatim.harness.store import _read_jsonl
from verbatim.harness.tracefile import DECODE_ERRORS, brief, from_table
from verbatim.lint.findings import Problem

READERS = 4
"""Batch files indexed at once: small files are dominated by per-file overhead, which threads overlap."""
LIST_COLUMNS = ["group_id", "rollout_id", "status", "error", "reward", "turns", "token_id"]


@dataclass
class BatchIndex:
    """One batch file as the list shows it; ``lint`` and ``requests`` are filled in by the background pass."""

    path: Path
    signature: tuple[int, int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    turn_totals: dict[str, int] = field(default_factory=dict)
    problem: str | None = None
    rollouts: list[Rollout] | None = None
    """Kept for JSON-lines batches only (Parquet batches are read again when needed)."""
    lint: dict[str, list[Problem]] | None = None
    requests: list[tuple[np.ndarray, np.ndarray]] | None = None
    """Each turn's (prompt, completion) token ids, in order, for the run's minimum prefill."""

    def position(self, rollout_id: str) -> int:
        return next(k for k, row in enumerate(self.rows) if row["id"] == rollout_id)


def index_batches(paths: list[Path]) -> list[BatchIndex]:
    """:func:`index_batch` of each path, a few files at a time (pyarrow decodes without the GIL)."""
    if len(paths) < 8:
        return [index_batch(p) for p in paths]
    with ThreadPoolExecutor(READERS) as pool:
        return list(pool.map(index_batch, paths))


def signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def index_batch(path: Path) -> BatchIndex:
    """The list rows of one batch file (damage is the index's ``problem``, never an exception)."""
    batch = BatchIndex(path=path, signature=signature(path))
    if path.suffix != ".parquet":
        rollouts, batch.problem = _read_jsonl(path)
        batch.rollouts = rollouts
        batch.rows = [rollout_row_of(r) for r in rollouts]
        batch.turn_totals = _totals([[(t.prompt_start, t.prompt_end, t.cached_tokens, t.completion_end)
                                      for t in r.turns] for r in rollouts])
        return batch
    try:
        table = pq.ParquetFile(path).read(columns=LIST_COLUMNS, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        batch.problem = f"{path.name}: truncated or corrupt Parquet ({brief(exc)}); its rollouts were skipped"
        return batch
    try:
        batch.rows, batch.turn_totals = _rows_of(table)
    except DECODE_ERRORS as exc:
        batch.problem = f"{path.name}: not a verbatim rollout table: {brief(exc)}; its rollouts were skipped"
    return batch


def _rows_of(table: pa.Table) -> tuple[list[dict[str, Any]], dict[str, int]]:
    meta = {name: table.column(name).to_pylist() for name in ("group_id", "rollout_id", "status", "error", "reward")}
    turns = table.column("turns").combine_chunks()
    counts = pc.list_value_length(turns).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(turns)
    names = {flat.type.field(k).name for k in range(flat.type.num_fields)}
    bounds = {name: pc.struct_field(flat, name).to_numpy(zero_copy_only=False).astype(np.int64)
              if name in names else np.zeros(len(flat), np.int64)  # prompt_start: trace schema 4 on
              for name in ("prompt_start", "prompt_end", "cached_tokens", "completion_end")}
    lengths = pc.list_value_length(table.column("token_id").combine_chunks()).to_numpy(zero_copy_only=False)
    rows = [{"id": meta["rollout_id"][i], "group": meta["group_id"][i], "status": meta["status"][i],
             "reward": meta["reward"][i], "turns": int(counts[i]), "tokens": int(lengths[i]),
             "error": meta["error"][i]} for i in range(table.num_rows)]
    start, prompt, cached, end = (bounds[k] for k in ("prompt_start", "prompt_end", "cached_tokens",
                                                        "completion_end"))
    totals = {"turns": int(len(prompt)), "prompt_tokens": int((prompt - start).sum()),
              "cached_tokens": int(cached.sum()), "generated_tokens": int((end - prompt).sum())}
    return rows, totals


def _totals(turns: list[list[tuple[int, int, int, int]]]) -> dict[str, int]:
    flat = [t for ts in turns for t in ts]
    return {"turns": len(flat), "prompt_tokens": sum(t[1] - t[0] for t in flat),
            "cached_tokens": sum(t[2] for t in flat), "generated_tokens": sum(t[3] - t[1] for t in flat)}


def rollout_row_of(rollout: Rollout) -> dict[str, Any]:
    """A list row from a whole rollout (JSON-lines batches); the same keys as :func:`index_batch`'s."""
    return {"id": rollout.rollout_id, "group": rollout.group_id, "status": rollout.status, "reward": rollout.reward,
            "turns": len(rollout.turns), "tokens": len(rollout.tokens), "error": rollout.error}


def read_batch(batch: BatchIndex, positions: list[int] | None = None) -> list[Rollout]:
    """The rollouts of a batch (only those at ``positions``, when given); raises TraceFormatError if damaged."""
    if batch.rollouts is not None:
        return batch.rollouts if positions is None else [batch.rollouts[k] for k in positions]
    try:
        with pq.ParquetFile(batch.path) as parquet:
            table = parquet.read()
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a column path that is not UTF-8
        raise TraceFormatError(f"{batch.path.name} changed or is damaged: {brief(exc)}",
                               hint="reload the page") from exc
    if positions is not None:
        table = table.take(pa.array(positions, type=pa.int64()))
    return from_table(table)
