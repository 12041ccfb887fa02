"""Trainer-ready files from a run directory: ``verbatim export``.

One row per rollout in every format (one per segment of a rollout whose agent rewrote its history, in the
trainer formats: ``rollout_id`` ``r#1``, ``r#2``, … for the later ones). ``parquet`` and ``jsonl`` are the native
trace in one file (every rollout, every column, lossless). ``verl``, ``trl`` and
``prime`` hold each rollout up to its last sampled token in the field
names and meanings of one trainer's own rollout record (``TRAINERS`` says which
release and which structure): verl's agent-loop output, the dict TRL's GRPO
``rollout_func`` returns, prime-rl's flat training sample. The model-token mask
(1 where the model sampled the token, 0 on prompt and env tokens) is the
trainer's own field (``response_mask``, ``env_mask``, ``mask``); nothing here
stands for padding, which each trainer adds itself. They keep ``ok`` and
``truncated`` rollouts and leave out rollouts with status ``error`` or
``interrupted`` and rollouts without a sampled token; the result says how many
were left out and why. Positions outside the mask carry logprob 0.0 and version -1
(a NaN would survive multiplication by a zero mask). Rows are ordered group by
group; ``group_id`` and ``group_size`` make the groups explicit. The Arrow
schema's ``verbatim.export`` metadata names the format, ``EXPORT_VERSION`` and
the trainer contract. See docs/traces.md for every column and how to feed each
trainer.
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

from verbatim.datamodel import TRAINED_STATUSES, Rollout, Source
from verbatim.durable import strict_json, write_atomic
from verbatim.errors import InputError, TraceError
from verbatim.harness.store import read_run
from verbatim.harness.tracefile import to_json_line, to_table
from verbatim.paths import RUN_OUTPUTS, check_output_file, check_outside_run, enclosing_run

FORMATS = ("parquet", "jsonl", "verl", "trl", "prime")
MASKED_LOGPROB = 0.0
MASKED_VERSION = -1
# 1: first release. 2: each split format follows one trainer's field names and meanings (TRAINERS).
EXPORT_VERSION = 2
METADATA_KEY = b"verbatim.export"
TRAINERS = {
    "verl": "verl 0.9.1 AgentLoopOutput (verl/experimental/agent_loop/agent_loop.py)",
    "trl": "trl 1.16.0 GRPOTrainer rollout_func output (trl/trainer/grpo_trainer.py)",
    "prime": "prime-rl TrainingSample, verifiers 0.4.0 era (src/prime_rl/transport/types.py)",
}


@dataclass(frozen=True)
class ExportResult:
    """Where an export went, how many rows it holds (one per rollout, or per segment of a rollout in the trainer
    formats) for how many rollouts, and what it left out (reason → count)."""

    path: Path
    format: str
    rows: int
    rollouts: int
    left_out: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        """``wrote 4 rows (2 rollouts) (verl) to PATH; left out 1 with status error``."""
        rollouts = "" if self.rows == self.rollouts else f" ({self.rollouts} rollouts)"
        left_out = ", ".join(f"{count} with {why}" for why, count in sorted(self.left_out.items()))
        return (f"wrote {self.rows} {'row' if self.rows == 1 else 'rows'}{rollouts} ({self.format}) to {self.path}"
                + (f"; left out {left_out}" if left_out else ""))


def parse_format(fmt: str) -> str:
    name = fmt.strip().lower()
    if name not in FORMATS:
        raise InputError(f"unknown export format {fmt!r}", hint=f"use one of: {', '.join(FORMATS)}")
    return name


def default_out(run_dir: str | os.PathLike[str], fmt: str) -> Path:
    """``RUN_DIR/exports/<format>.parquet`` (``.jsonl`` for the jsonl format)."""
    suffix = "jsonl" if fmt == "jsonl" else "parquet"
    return Path(run_dir) / RUN_OUTPUTS / f"{fmt}.{suffix}"


def export_run(run_dir: str | os.PathLike[str], fmt: str, out: str | os.PathLike[str] | None = None, *,
               force: bool = False) -> Path:
    """Export every intact rollout of a run directory; returns the written file."""
    fmt = parse_format(fmt)
    return export_rollouts(read_run(run_dir).rollouts, fmt, out or default_out(run_dir, fmt), force=force).path


def export_path(fmt: str, out: str | os.PathLike[str], *, force: bool = False) -> Path:
    """The file an export to ``out`` writes (a file, or an existing folder to put ``<fmt>.*`` in), refused
    where it would damage data: among a run directory's own files (its ``exports/`` folder is the one
    place inside a run an export may go), or over an existing file unless ``force``; and where it cannot
    be written (:func:`check_output_file`). A missing folder is refused, but for the ``exports/`` folder
    that the export of a run creates (a folder that is not a run is refused by the run's reader)."""
    path = Path(out)
    if path.is_dir():
        path = path / default_out(path, fmt).name
    check_outside_run(path, "--out", hint="pass a path outside the run, or leave --out out (RUN_DIR/exports/)")
    check_output_file(path, "--out", created=path.parent if path.parent.name == RUN_OUTPUTS else None,
                      existing_ok=force)
    return path


def export_rollouts(rollouts: Sequence[Rollout], fmt: str, out: str | os.PathLike[str], *,
                    force: bool = False) -> ExportResult:
    """Write ``rollouts`` in ``fmt`` to ``out`` (see :func:`export_path` for where it may write)."""
    fmt = parse_format(fmt)
    path = export_path(fmt, out, force=force)
    ordered = group_ordered(rollouts)
    if fmt == "jsonl":
        text = "".join(to_json_line(r) + "\n" for r in ordered)
        _write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))
        return ExportResult(path, fmt, len(ordered), len(ordered))
    if fmt == "parquet":
        table = to_table(ordered)
        left_out: dict[str, int] = {}
    else:
        kept, left_out = trainable(ordered)
        table = with_export_metadata(TABLE_BUILDERS[fmt](kept), fmt)
    _write_atomic(path, lambda p: pq.write_table(table, p, compression="zstd"))
    return ExportResult(path, fmt, table.num_rows, len(ordered) - sum(left_out.values()), left_out)


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
        if r.status not in TRAINED_STATUSES:
            left_out[f"status {r.status}"] += 1
        elif not r.turns or not r.tokens.loss_mask.any():
            left_out["no sampled token"] += 1
        else:  # a rewritten history: one row per segment, each a sequence the sampler saw (ids r#1, r#2, …)
            kept.extend(piece if piece is r else piece.model_copy(update={"rollout_id": piece.row_id})
                        for piece in r.segments() if piece.tokens.loss_mask.any())
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


def split_rollout(rollout: Rollout) -> Split:
    """Prompt = tokens before the first completion; response = first completion … the last sampled token.

    Tokens after the last sampled token (env tokens after the last completion, an empty last
    completion's context) carry no loss and are not part of the response, so it ends on a model token.
    """
    start = rollout.turns[0].prompt_end
    end = int(np.flatnonzero(rollout.tokens.source == Source.MODEL)[-1]) + 1  # trainable(): one exists
    tokens = rollout.tokens
    model = tokens.source[start:end] == Source.MODEL
    logprobs = np.where(model, tokens.logprob[start:end], np.float32(MASKED_LOGPROB)).astype(np.float32)
    versions = np.where(model, tokens.policy_version[start:end], MASKED_VERSION).astype(np.int32)
    return Split(
        prompt_ids=tokens.token_id[:start],
        response_ids=tokens.token_id[start:end],
        response_mask=model.astype(np.int8),
        response_logprobs=logprobs,
        response_versions=versions,
        response_turns=tokens.turn[start:end],
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
    sizes = Counter(group for group, _ in {(r.group_id, r.rollout_id.split("#")[0]) for r in rollouts})
    return {
        "run_id": pa.array([r.run_id for r in rollouts], pa.string()),
        "group_id": pa.array([r.group_id for r in rollouts], pa.string()),
        "group_size": pa.array([sizes[r.group_id] for r in rollouts], pa.int32()),
        "rollout_id": pa.array([r.rollout_id for r in rollouts], pa.string()),
        "status": pa.array([r.status for r in rollouts], pa.string()),
        "model_turns": pa.array([len(r.turns) for r in rollouts], pa.int32()),
        "task": pa.array([strict_json(r.task, sort_keys=True) for r in rollouts], pa.string()),
    }


def _routing(rollouts: list[Rollout]) -> dict[str, pa.Array]:
    """Where the trace recorded routed experts (a MoE run, ``--record-routing``): each exported token's (prompt and
    response: ``token_id[:last model token + 1]``), flat, and their ``[layers, k]``; no columns otherwise."""
    if all(r.tokens.routed_experts is None for r in rollouts):
        return {}
    ends = [int(np.flatnonzero(r.tokens.source == Source.MODEL)[-1]) + 1 for r in rollouts]
    experts = [r.tokens.routed_experts for r in rollouts]
    return {"routed_experts": _lists([np.empty(0, np.int16) if e is None else e[:end].reshape(-1)
                                      for e, end in zip(experts, ends)], pa.int16()),
            "experts_shape": _lists([np.array([] if e is None else e.shape[1:], np.int16) for e in experts],
                                    pa.int16())}


def _rewards(rollouts: list[Rollout]) -> pa.Array:
    return pa.array([r.reward for r in rollouts], pa.float64())


SPLIT_TYPES = {"prompt_ids": pa.int32(), "response_ids": pa.int32(), "response_mask": pa.int8(),
               "response_logprobs": pa.float32(), "response_versions": pa.int32(), "response_turns": pa.int16()}


def _split_columns(splits: list[Split], names: dict[str, str]) -> dict[str, pa.Array]:
    """Split columns renamed per format: ``names`` maps a :class:`Split` field to a column name."""
    return {column: _lists([getattr(s, part) for s in splits], SPLIT_TYPES[part]) for part, column in names.items()}


def verl_table(rollouts: list[Rollout]) -> pa.Table:
    """verl's ``AgentLoopOutput``: prompt/response ids, response mask and logprobs, reward score, num_turns."""
    splits = [split_rollout(r) for r in rollouts]
    columns = _split_columns(splits, {"prompt_ids": "prompt_ids", "response_ids": "response_ids",
                                      "response_mask": "response_mask", "response_logprobs": "response_logprobs"})
    columns["reward_score"] = _rewards(rollouts)
    # verl counts chat messages: the first prompt, every completion and every env reply between them.
    columns["num_turns"] = pa.array([2 * len(r.turns) for r in rollouts], pa.int32())
    columns.update(_identity(rollouts))
    columns.update(_split_columns(splits, {"response_versions": "response_policy_versions",
                                           "response_turns": "response_turns"}))
    columns.update(_routing(rollouts))
    return pa.table(columns)


def trl_table(rollouts: list[Rollout]) -> pa.Table:
    """TRL's ``rollout_func`` output: prompt/completion ids, sampler logprobs, ``env_mask``, reward."""
    splits = [split_rollout(r) for r in rollouts]
    columns = _split_columns(splits, {"prompt_ids": "prompt_ids", "response_ids": "completion_ids",
                                      "response_logprobs": "logprobs", "response_mask": "env_mask"})
    columns["reward"] = _rewards(rollouts)
    columns.update(_identity(rollouts))
    columns.update(_split_columns(splits, {"response_versions": "policy_versions",
                                           "response_turns": "completion_turns"}))
    columns.update(_routing(rollouts))
    return pa.table(columns)


def prime_table(rollouts: list[Rollout]) -> pa.Table:
    """prime-rl's flat ``TrainingSample``: token ids, model-token mask, logprobs, reward; no advantages."""
    splits = [split_rollout(r) for r in rollouts]

    def whole(part: str, prompt_value: int | float) -> list[np.ndarray]:
        return [np.concatenate([np.full(len(s.prompt_ids), prompt_value, getattr(s, part).dtype), getattr(s, part)])
                for s in splits]

    examples = [str(r.task["id"]) if "id" in r.task else r.group_id for r in rollouts]
    columns = {
        "token_ids": _lists([np.concatenate([s.prompt_ids, s.response_ids]) for s in splits], pa.int32()),
        "mask": _lists([m.astype(bool) for m in whole("response_mask", 0)], pa.bool_()),
        "logprobs": _lists(whole("response_logprobs", MASKED_LOGPROB), pa.float32()),
        "reward": _rewards(rollouts),
        "example_id": pa.array(examples, pa.string()),
        **_identity(rollouts),
        "policy_versions": _lists(whole("response_versions", MASKED_VERSION), pa.int32()),
        "token_turns": _lists(whole("response_turns", 0), pa.int16()),
        **_routing(rollouts),
    }
    return pa.table(columns)


def with_export_metadata(table: pa.Table, fmt: str) -> pa.Table:
    """``table`` with the ``verbatim.export`` schema metadata: format, export version, trainer contract."""
    note = {"format": fmt, "version": EXPORT_VERSION, "follows": TRAINERS[fmt]}
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(note).encode()})


TABLE_BUILDERS: dict[str, Callable[[list[Rollout]], pa.Table]] = {
    "verl": verl_table, "trl": trl_table, "prime": prime_table,
}


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write to a temporary name beside ``path`` and rename it into place; the one folder it may create
    is a run's ``exports/`` (any other missing folder is the one-line error of :func:`check_output_file`)."""
    run = enclosing_run(path)
    check_output_file(path, "--out", created=None if run is None else run / RUN_OUTPUTS, existing_ok=True)
    try:
        path.parent.mkdir(exist_ok=True)
    except OSError as exc:
        raise TraceError(f"cannot create {path.parent}: {exc.strerror}", hint="pass a writable --out") from exc
    try:
        write_atomic(path, write)
    except OSError as exc:
        raise TraceError(f"cannot write {path}: {exc.strerror or exc}", hint="pass a writable --out") from exc
