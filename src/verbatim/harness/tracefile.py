"""Rollouts ⇄ Arrow tables and JSON lines (pure conversion, no file handling).

Token columns become Arrow list columns with their exact dtypes; turns become a
list of structs; task and info are JSON text so that any env's data fits.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa

from verbatim.datamodel import COLUMN_DTYPES, EXPERT_DTYPE, Rollout, TokenColumns, Turn
from verbatim.errors import TraceFormatError

_TURN_TYPE = pa.struct([
    ("index", pa.int32()),
    ("prompt_start", pa.int64()),
    ("prompt_end", pa.int64()),
    ("completion_end", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("cache_salt", pa.string()),
    ("finish_reason", pa.string()),
    ("kv_versions", pa.list_(pa.int32())),
    ("queue_s", pa.float64()),
    ("first_token_s", pa.float64()),
    ("total_s", pa.float64()),
    ("reward", pa.float64()),
    ("replica", pa.string()),
    ("admission_wait_s", pa.float64()),
    ("sampling", pa.struct([("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()),
                            ("regex", pa.string()), ("logprobs", pa.string())])),
])

ROLLOUT_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("run_id", pa.string()),
        ("group_id", pa.string()),
        ("rollout_id", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("reward", pa.float64()),
        ("task", pa.string()),
        ("info", pa.string()),
        ("turns", pa.list_(_TURN_TYPE)),
    ]
    + [(name, pa.list_(pa.from_numpy_dtype(dtype))) for name, dtype in COLUMN_DTYPES.items()]
    + [("routed_experts", pa.list_(pa.int16())), ("experts_shape", pa.list_(pa.int16())),
       ("experts_version", pa.list_(pa.int32()))]
)
"""A rollout's routed experts are one flat list (``tokens × layers × k`` in C order), its ``[layers, k]`` and each
token's version, all empty where none were recorded (tables written before them have none of the columns)."""

_META_FIELDS = ("schema_version", "run_id", "group_id", "rollout_id", "status", "error", "reward")


def _list_column(arrays: list[np.ndarray], dtype: np.dtype) -> pa.Array:
    """Many NumPy arrays → one Arrow list column, without per-element Python objects."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.empty(0, dtype)
    values = pa.array(flat.astype(dtype, copy=False), type=pa.from_numpy_dtype(dtype))
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def to_table(rollouts: list[Rollout]) -> pa.Table:
    columns: dict[str, Any] = {name: [getattr(r, name) for r in rollouts] for name in _META_FIELDS}
    columns["task"] = [json.dumps(r.task, sort_keys=True) for r in rollouts]
    columns["info"] = [json.dumps(r.info, sort_keys=True) for r in rollouts]
    columns["turns"] = [[t.model_dump() for t in r.turns] for r in rollouts]
    arrays = [pa.array(columns[f.name], type=f.type) for f in ROLLOUT_SCHEMA if f.name in columns]
    arrays += [_list_column([getattr(r.tokens, n) for r in rollouts], d) for n, d in COLUMN_DTYPES.items()]
    experts = [r.tokens.routed_experts for r in rollouts]
    arrays.append(_list_column([np.empty(0, EXPERT_DTYPE) if e is None else e.reshape(-1) for e in experts],
                               EXPERT_DTYPE))
    arrays.append(_list_column([np.array([] if e is None else e.shape[1:], EXPERT_DTYPE) for e in experts],
                               EXPERT_DTYPE))
    arrays.append(_list_column([np.empty(0, np.int32) if r.tokens.experts_version is None
                                else r.tokens.experts_version for r in rollouts], np.dtype(np.int32)))
    return pa.Table.from_arrays(arrays, schema=ROLLOUT_SCHEMA)


DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError,
                 pa.ArrowException)
"""What decoding damaged or foreign data can raise (a number too large for its column, JSON nested too
deep, a missing field, a wrong type); the readers turn each into a :class:`TraceFormatError`."""


def from_table(table: pa.Table) -> list[Rollout]:
    """The rollouts of one batch table; anything that is not one raises :class:`TraceFormatError`."""
    try:
        return _rollouts_of(table)
    except DECODE_ERRORS as exc:
        raise TraceFormatError(f"not a verbatim rollout table: {type(exc).__name__}: {brief(exc)}") from exc


def _rows(column: pa.ChunkedArray, dtype: np.dtype) -> list[np.ndarray]:
    """A list column's rows as read-only ``dtype`` arrays, views of the column's buffers. Read from the buffers
    because every pyarrow conversion to numpy imports pandas (0.5 s of each process that reads a run); a column
    of another type, or with nulls, which verbatim never writes, goes through that conversion."""
    lists = column.combine_chunks()
    if not (pa.types.is_list(lists.type) and lists.type.value_type == pa.from_numpy_dtype(dtype)
            and lists.null_count == 0 and lists.values.null_count == 0) or len(lists) == 0:
        return [lists[i].values.to_numpy(zero_copy_only=False).astype(dtype, copy=False) for i in range(len(lists))]
    offsets = np.frombuffer(lists.buffers()[1], np.int32, count=len(lists) + 1, offset=4 * lists.offset)
    values = lists.values
    flat = np.frombuffer(values.buffers()[1], dtype, count=values.offset + len(values))[values.offset:]
    return [flat[start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


def _rollouts_of(table: pa.Table) -> list[Rollout]:
    meta = {name: table.column(name).to_pylist() for name in _META_FIELDS}
    tasks = table.column("task").to_pylist()
    infos = table.column("info").to_pylist()
    turns = table.column("turns").to_pylist()
    token_columns = {name: _rows(table.column(name), dtype) for name, dtype in COLUMN_DTYPES.items()}
    experts = _experts_rows(table)
    rollouts = []
    for i in range(table.num_rows):
        tokens = TokenColumns(**{name: rows[i] for name, rows in token_columns.items()}, routed_experts=experts[i][0],
                              experts_version=experts[i][1])
        rollouts.append(Rollout(
            **{name: meta[name][i] for name in _META_FIELDS},
            task=json.loads(tasks[i]),
            info=json.loads(infos[i]),
            turns=tuple(Turn(**t) for t in turns[i]),
            tokens=tokens,
        ))
    return rollouts


def _experts_rows(table: pa.Table) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """Each row's routed experts and their versions (``None`` where it has none, or the table predates them)."""
    if "routed_experts" not in table.column_names:
        return [(None, None)] * table.num_rows
    flat, shapes = _rows(table.column("routed_experts"), EXPERT_DTYPE), _rows(table.column("experts_shape"),
                                                                                EXPERT_DTYPE)
    versions = _rows(table.column("experts_version"), np.dtype(np.int32))
    return [(flat[i].reshape(-1, *shapes[i]), versions[i]) if len(shapes[i]) else (None, None)
            for i in range(table.num_rows)]


def to_json_line(rollout: Rollout) -> str:
    """The rollout as one JSON line with the Parquet row's columns: the token columns at the top level
    (``logprob`` null where Parquet has NaN: JSON has no NaN); ``task`` and ``info`` as objects, not the JSON
    strings Parquet holds."""
    record = rollout.model_dump(mode="json", exclude={"tokens"})
    for name, column in rollout.tokens.as_dict().items():
        record[name] = column.tolist()
    record["logprob"] = [None if math.isnan(x) else x for x in record["logprob"]]
    experts = rollout.tokens.routed_experts
    record["routed_experts"] = [] if experts is None else experts.reshape(-1).tolist()
    record["experts_shape"] = [] if experts is None else list(experts.shape[1:])
    record["experts_version"] = [] if experts is None else rollout.tokens.experts_version.tolist()
    return json.dumps(record, allow_nan=False, separators=(",", ":"))


def from_json_line(line: str | bytes) -> Rollout:
    """One rollout from its JSON line; anything that is not one raises :class:`TraceFormatError`."""
    try:
        return _rollout_of(json.loads(line))
    except DECODE_ERRORS as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TraceFormatError(f"not a verbatim rollout line: {type(exc).__name__}: {brief(exc)}") from exc


def brief(exc: BaseException) -> str:
    """An exception's message on one line, at most 120 characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _rollout_of(record: Any) -> Rollout:
    # lines written before the columns moved to the top level nest them under "tokens"; both are read
    tokens = record.pop("tokens") if "tokens" in record else {name: record.pop(name) for name in COLUMN_DTYPES}
    tokens["logprob"] = [math.nan if x is None else x for x in tokens["logprob"]]
    experts, shape = record.pop("routed_experts", None), record.pop("experts_shape", None)
    versions = record.pop("experts_version", None)
    record["tokens"] = TokenColumns(**{name: np.asarray(tokens[name], dtype=dtype)
                                       for name, dtype in COLUMN_DTYPES.items()},
                                    routed_experts=np.asarray(experts, EXPERT_DTYPE).reshape(-1, *shape)
                                    if shape else None,
                                    experts_version=np.asarray(versions, np.int32) if shape else None)
    record["turns"] = tuple(Turn(**t) for t in record.get("turns", ()))
    return Rollout(**record)
