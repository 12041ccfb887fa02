"""Trainer-ready files from a run directory: ``verbatim export``.

One row per rollout in every format. ``parquet`` and ``jsonl`` are the native
trace in one file (every rollout, every column, lossless). ``verl``, ``trl`` and
``prime`` split each rollout into a prompt (the tokens before its first
completion) and a response/completion (everything from the first completion to
the end of the last one: model tokens, and the env tokens between turns, masked
out). They keep ``ok`` and ``truncated`` rollouts and leave out rollouts with
status ``error`` or ``interrupted`` and rollouts without a sampled token; the
result says how many were left out and why. Masked positions carry logprob 0.0
and version -1 (a NaN would survive multiplication by a zero mask). Rows are
ordered group by group; ``group_id`` and ``group_size`` make the groups explicit.
See docs/traces.md for every column.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verbatim.datamodel import Rollout, Source
from verbatim.durable import write_atomic
from verbatim.errors import InputError, TraceError
from verbatim.harness.store import read_run
from verbatim.harness.tracefile import to_json_line, to_table

FORMATS = ("parquet", "jsonl", "verl", "trl", "prime")
TRAINABLE_STATUSES = ("ok", "truncated")
MASKED_LOGPROB = 0.0
MASKED_VERSION = -1


@dataclass(frozen=True)
class ExportResult:
    """Where an export went, how many rows it holds, and what it left out (reason → count)."""

    path: Path
    format: str
    rows: int
    left_out: dict[str, int] = field(default_factory=dict)


def parse_format(fmt: str) -> str:
    name = fmt.strip().lower()
    if name not in FORMATS:
        raise InputError(f"unknown export format {fmt!r}", hint=f"use one of: {', '.join(FORMATS)}")
    return name


def default_out(run_dir: str | os.PathLike[str], fmt: str) -> Path:
    """``RUN_DIR/exports/<format>.parquet`` (``.jsonl`` for the jsonl format)."""
    suffix = "jsonl" if fmt == "jsonl" else "parquet"
    return Path(run_dir) / "exports" / f"{fmt}.{suffix}"


def export_run(run_dir: str | os.PathLike[str], fmt: str, out: str | os.PathLike[str] | None = None, *,
               force: bool = False) -> Path:
    """Export every intact rollout of a run directory; returns the written file."""
    fmt = parse_format(fmt)
    return export_rollouts(read_run(run_dir).rollouts, fmt, out or default_out(run_dir, fmt), force=force).path


def export_path(fmt: str, out: str | os.PathLike[str], *, force: bool = False) -> Path:
    """The file an export to ``out`` writes (a file, or an existing folder to put ``<fmt>.*`` in), refused
    where it would damage data: among a run directory's own files (its ``exports/`` folder is the one
    place inside a run an export may go), or over an existing file unless ``force``."""
    path = Path(out)
    if path.is_dir():
        path = path / default_out(path, fmt).name
    run = _enclosing_run(path)
    if run is not None and not path.resolve().is_relative_to(run / "exports"):
        raise InputError(f"--out {out} is inside the run directory {run}: an export never writes among a run's files",
                         hint="pass a path outside the run, or leave --out out (RUN_DIR/exports/)")
    if path.exists() and not force:
        raise InputError(f"{path} already exists", hint="pass --force to replace it, or another --out")
    return path


def _enclosing_run(path: Path) -> Path | None:
    """The nearest folder above ``path`` that is a run directory (holds a manifest.json), if any."""
    for folder in path.resolve().parents:
        if (folder / "manifest.json").is_file():
            return folder
    return None


def export_rollouts(rollouts: Sequence[Rollout], fmt: str, out: str | os.PathLike[str], *,
                    force: bool = False) -> ExportResult:
    """Write ``rollouts`` in ``fmt`` to ``out`` (see :func:`export_path` for where it may write)."""
    fmt = parse_format(fmt)
    path = export_path(fmt, out, force=force)
    ordered = group_ordered(rollouts)
    if fmt == "jsonl":
        text = "".join(to_json_line(r) + "\n" for r in ordered)
        _write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))
        return ExportResult(path, fmt, len(ordered))
    if fmt == "parquet":
        table = to_table(ordered)
        left_out: dict[str, int] = {}
    else:
        kept, left_out = trainable(ordered)
        table = TABLE_BUILDERS[fmt](kept)
    _write_atomic(path, lambda p: pq.write_table(table, p, compression="zstd"))
    return ExportResult(path, fmt, table.num_rows, left_out)


# ---------------------------------------------------------------------------
# Selection and order
# ---------------------------------------------------------------------------


def group_ordered(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """Rollouts with each group's members together, groups in order of first appearance."""
    first_seen: dict[str, int] = {}
    for r in rollouts:
        first_seen.setdefault(r.group_id, len(first_seen))
    return sorted(rollouts, key=lambda r: first_seen[r.group_id])  # stable: members keep their order


def trainable(rollouts: Sequence[Rollout]) -> tuple[list[Rollout], dict[str, int]]:
    """The rollouts a trainer can use, and why the others were left out."""
    kept, left_out = [], Counter()
    for r in rollouts:
        if r.status not in TRAINABLE_STATUSES:
            left_out[f"status {r.status}"] += 1
        elif not r.turns or not r.tokens.loss_mask.any():
            left_out["no sampled token"] += 1
        else:
            kept.append(r)
    return kept, dict(left_out)


# ---------------------------------------------------------------------------
# Prompt / response split (pure)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """One rollout as prompt + response columns, as the trainer formats need them."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    response_logprobs: np.ndarray
    response_versions: np.ndarray
    response_turns: np.ndarray
    token_rewards: np.ndarray


def split_rollout(rollout: Rollout) -> Split:
    """Prompt = tokens before the first completion; response = first completion … end of the last one.

    Env tokens after the last completion carry no loss and are not part of the response.
    """
    start, end = rollout.turns[0].prompt_end, rollout.turns[-1].completion_end
    tokens = rollout.tokens
    model = tokens.source[start:end] == Source.MODEL
    logprobs = np.where(model, tokens.logprob[start:end], np.float32(MASKED_LOGPROB)).astype(np.float32)
    versions = np.where(model, tokens.policy_version[start:end], MASKED_VERSION).astype(np.int32)
    rewards = np.zeros(end - start, dtype=np.float32)
    sampled = np.flatnonzero(model)
    if rollout.reward is not None and len(sampled):
        rewards[sampled[-1]] = rollout.reward
    return Split(
        prompt_ids=tokens.token_id[:start],
        response_ids=tokens.token_id[start:end],
        response_mask=model.astype(np.int8),
        response_logprobs=logprobs,
        response_versions=versions,
        response_turns=tokens.turn[start:end],
        token_rewards=rewards,
    )


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _lists(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    """NumPy arrays → one Arrow list column (values copied exactly, NaN stays NaN)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    dtype = value_type.to_pandas_dtype()
    flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def _identity(rollouts: list[Rollout]) -> dict[str, pa.Array]:
    sizes = Counter(r.group_id for r in rollouts)
    return {
        "run_id": pa.array([r.run_id for r in rollouts], pa.string()),
        "group_id": pa.array([r.group_id for r in rollouts], pa.string()),
        "group_size": pa.array([sizes[r.group_id] for r in rollouts], pa.int32()),
        "rollout_id": pa.array([r.rollout_id for r in rollouts], pa.string()),
        "status": pa.array([r.status for r in rollouts], pa.string()),
        "reward": pa.array([r.reward for r in rollouts], pa.float64()),
        "num_turns": pa.array([len(r.turns) for r in rollouts], pa.int32()),
        "task": pa.array([json.dumps(r.task, sort_keys=True) for r in rollouts], pa.string()),
    }


def _split_columns(rollouts: list[Rollout], names: dict[str, str]) -> dict[str, pa.Array]:
    """Split columns renamed per format: ``names`` maps a :class:`Split` field to a column name."""
    splits = [split_rollout(r) for r in rollouts]
    types = {"prompt_ids": pa.int32(), "response_ids": pa.int32(), "response_mask": pa.int8(),
             "response_logprobs": pa.float32(), "response_versions": pa.int32(),
             "response_turns": pa.int16(), "token_rewards": pa.float32()}
    return {column: _lists([getattr(s, part) for s in splits], types[part]) for part, column in names.items()}


def verl_table(rollouts: list[Rollout]) -> pa.Table:
    """verl: ``uid`` (= group id, GRPO grouping), prompt/response ids, response mask, logprobs, versions."""
    identity = _identity(rollouts)
    columns = {"uid": identity["group_id"], **identity}
    columns.update(_split_columns(rollouts, {
        "prompt_ids": "prompt_ids", "response_ids": "response_ids", "response_mask": "response_mask",
        "response_logprobs": "rollout_log_probs", "response_versions": "rollout_policy_versions",
        "token_rewards": "token_level_rewards", "response_turns": "response_turns",
    }))
    return pa.table(columns)


def trl_table(rollouts: list[Rollout]) -> pa.Table:
    """TRL: prompt/completion ids, completion mask (env tokens 0), sampler logprobs, reward."""
    columns = _identity(rollouts)
    columns.update(_split_columns(rollouts, {
        "prompt_ids": "prompt_ids", "response_ids": "completion_ids", "response_mask": "completion_mask",
        "response_logprobs": "logprobs", "response_versions": "policy_versions",
        "response_turns": "completion_turns",
    }))
    return pa.table(columns)


def prime_table(rollouts: list[Rollout]) -> pa.Table:
    """prime-rl style: example id, prompt ids + (all-zero) prompt mask, completion ids/mask/logprobs; no advantage."""
    identity = _identity(rollouts)
    examples = [str(r.task["id"]) if "id" in r.task else r.group_id for r in rollouts]
    columns = {"example_id": pa.array(examples, pa.string()), **identity}
    columns.update(_split_columns(rollouts, {
        "prompt_ids": "prompt_ids", "response_ids": "completion_ids", "response_mask": "completion_mask",
        "response_logprobs": "completion_logprobs", "response_versions": "completion_policy_versions",
        "response_turns": "completion_turns",
    }))
    columns["prompt_mask"] = _lists([np.zeros(r.turns[0].prompt_end, np.int8) for r in rollouts], pa.int8())
    return pa.table(columns)


TABLE_BUILDERS: dict[str, Callable[[list[Rollout]], pa.Table]] = {
    "verl": verl_table, "trl": trl_table, "prime": prime_table,
}


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write to a temporary name beside ``path`` and rename it into place."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceError(f"cannot create {path.parent}: {exc.strerror}", hint="pass a writable --out") from exc
    try:
        write_atomic(path, write)
    except OSError as exc:
        raise TraceError(f"cannot write {path}: {exc.strerror or exc}", hint="pass a writable --out") from exc
