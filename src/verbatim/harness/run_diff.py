"""Two runs compared: are they the same run, and where do they first part? (``verbatim diff``)

One command run twice on one machine repeats its traces bit for bit (docs/engine.md, reproducible
sampling); this says whether two runs did, and if not, where they first part, so a rerun can be checked,
a regression bisected, and a change's effect found where it starts. Compared, in this order:

* the rollouts, matched by id: each one's token columns (ids, who wrote each token, the sampler
  logprobs μ bit for bit, policy versions, turn of each token) and its outcome (reward, status). A
  rollout is counted under the first column in which it parts, at its earliest token;
* a training run's ``metrics.jsonl``, step by step, less wall times and memory (names ending in ``_s``
  or ``_mib``: no two runs share those);
* the trainer's π files (``trainer_logprobs/``), step by step, byte for byte;
* the newest checkpoint both runs hold: weights tensor by tensor, optimizer and RNG states byte for byte.

The settings the two manifests differ in come first: they often say why the runs part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import Frozen, Rollout, Source
from verbatim.harness.config_changes import config_differences
from verbatim.harness.metrics_log import metrics_path, read_metrics
from verbatim.harness.store import read_run

VARYING = ("_s", "_mib")
"""Metric names ending so are wall times and memory: two runs of one command differ in them."""
PLACES = ("out", "summary_json")
"""Settings that name where a run writes: two runs always differ in them, so they are left out."""
CONTEXT = 12
"""Token ids before a rollout's first difference kept with it, for reading it as text."""
COLUMNS = ("token_id", "source", "logprob", "policy_version", "turn")
"""A rollout's token columns, in the order a first difference is looked for."""
_COLUMN_NAMES = {"token_id": "token ids", "source": "token sources", "logprob": "sampler logprobs μ",
                 "policy_version": "policy versions", "turn": "turn of each token"}


class Divergence(Frozen):
    """The first place two runs part in one thing compared: where, and what each run holds there."""

    where: str
    a: str
    b: str
    before: tuple[int, ...] = ()
    """In a rollout: the token ids just before the place (up to ``CONTEXT``), which both runs share."""
    ids: tuple[int, int] | None = None
    """In a rollout whose token ids part: the id each run holds there."""


class Comparison(Frozen):
    """One thing compared: how many of its items differ, out of how many, and the first that does."""

    name: str
    items: int
    differ: int = 0
    first: Divergence | None = None
    note: str = ""

    @property
    def same(self) -> bool:
        return self.differ == 0


class RunDiff(Frozen):
    settings: tuple[str, ...] = ()
    """``key: a -> b`` for each setting the two manifests' configs differ in (but where they write)."""
    comparisons: tuple[Comparison, ...] = ()
    problems: tuple[str, ...] = ()
    """What reading either run found wrong (damaged or unfinished files), prefixed ``A:`` or ``B:``."""

    @property
    def same(self) -> bool:
        return all(c.same for c in self.comparisons)


def diff_runs(a: Path, b: Path) -> RunDiff:
    """Read both run directories and compare everything they both hold."""
    first, second = read_run(a), read_run(b)
    comparisons = [*compare_rollouts(first.rollouts, second.rollouts)]
    metrics = [read_metrics(d) if metrics_path(d).is_file() else None for d in (a, b)]
    if metrics[0] is not None and metrics[1] is not None:
        comparisons.append(compare_metrics(metrics[0], metrics[1]))
    comparisons += [c for c in (_trainer_logprobs(a, b), _checkpoint(a, b)) if c is not None]
    settings = [line for line in config_differences(first.manifest.config, second.manifest.config)
                if line.split(":", 1)[0].rsplit(".", 1)[-1] not in PLACES]
    problems = [f"{side}: {problem}" for side, trace in (("A", first), ("B", second)) for problem in trace.problems]
    return RunDiff(settings=tuple(settings), comparisons=tuple(comparisons), problems=tuple(problems))


def compare_rollouts(a: Sequence[Rollout], b: Sequence[Rollout]) -> list[Comparison]:
    """The rollouts both runs hold, column by column, then their outcomes; and those only one holds."""
    mine, theirs = {r.rollout_id: r for r in a}, {r.rollout_id: r for r in b}
    shared = sorted(mine.keys() & theirs.keys())
    only = len(mine.keys() - theirs.keys()), len(theirs.keys() - mine.keys())
    found: dict[str, list[Divergence]] = {name: [] for name in (*COLUMNS, "outcome")}
    for rollout_id in shared:
        column, part = first_part(mine[rollout_id], theirs[rollout_id])
        if column is not None:
            found[column].append(part)
    out = [Comparison(name="rollout ids", items=len(mine.keys() | theirs.keys()), differ=sum(only),
                      first=_only_part(mine, theirs), note=f"{len(shared)} in both, {only[0]} only in A, "
                                                           f"{only[1]} only in B")]
    for column, parts in found.items():
        out.append(Comparison(name=_COLUMN_NAMES.get(column, "rewards and statuses"), items=len(shared),
                              differ=len(parts), first=parts[0] if parts else None))
    return out


def first_part(a: Rollout, b: Rollout) -> tuple[str | None, Divergence | None]:
    """The column in which two rollouts of one id first part (at their earliest token), and where; the
    outcome when every token agrees; ``(None, None)`` when they are the same."""
    ta, tb = a.tokens, b.tokens
    common = min(len(ta), len(tb))
    earliest: tuple[int, str] | None = None
    for column in COLUMNS:
        x, y = getattr(ta, column)[:common], getattr(tb, column)[:common]
        unequal = ~((x == y) | (np.isnan(x) & np.isnan(y))) if x.dtype.kind == "f" else x != y
        hits = np.flatnonzero(unequal)
        if hits.size and (earliest is None or hits[0] < earliest[0]):
            earliest = (int(hits[0]), column)
    if earliest is not None:
        index, column = earliest
        ids = (int(ta.token_id[index]), int(tb.token_id[index])) if column == "token_id" else None
        return column, Divergence(where=f"rollout {a.rollout_id}, {_token_place(a, index)}",
                                  a=_value(ta, column, index), b=_value(tb, column, index),
                                  before=_before(ta, index), ids=ids)
    if len(ta) != len(tb):
        return "token_id", Divergence(where=f"rollout {a.rollout_id}, after its {common} shared tokens",
                                      a=f"{len(ta)} tokens", b=f"{len(tb)} tokens")
    if (a.reward, a.status) != (b.reward, b.status):
        return "outcome", Divergence(where=f"rollout {a.rollout_id}", a=f"reward {a.reward}, {a.status}",
                                     b=f"reward {b.reward}, {b.status}")
    return None, None


def _before(tokens: Any, index: int) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens.token_id[max(0, index - CONTEXT):index])


def _token_place(rollout: Rollout, index: int) -> str:
    source = Source(int(rollout.tokens.source[index])).name.lower()
    return f"token {index} (turn {int(rollout.tokens.turn[index])}, {source})"


def _value(tokens: Any, column: str, index: int) -> str:
    value = getattr(tokens, column)[index]
    if column == "logprob":
        return f"{float(value)!r}"
    if column == "source":
        return Source(int(value)).name.lower()
    return str(int(value))


def _only_part(mine: Mapping[str, Rollout], theirs: Mapping[str, Rollout]) -> Divergence | None:
    missing = sorted(mine.keys() ^ theirs.keys())
    if not missing:
        return None
    return _presence(f"rollout {missing[0]}", missing[0] in mine, missing[0] in theirs)


def steady(record: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics record less its wall times and memory, at every depth."""
    return {k: steady(v) if isinstance(v, Mapping) else v for k, v in record.items() if not k.endswith(VARYING)}


def compare_metrics(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> Comparison:
    """Step by step, the metrics of every step either run logged, less wall times and memory; a step only
    one run logged differs."""
    mine, theirs = {r["step"]: r for r in a}, {r["step"]: r for r in b}
    parted: list[Divergence] = []
    for step in sorted(mine.keys() | theirs.keys()):
        if step not in mine or step not in theirs:
            parted.append(_presence(f"step {step}", step in mine, step in theirs))
            continue
        lines = config_differences(steady(mine[step]), steady(theirs[step]))
        if lines:
            key, _, change = lines[0].partition(": ")
            before, _, after = change.partition(" -> ")
            more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
            parted.append(Divergence(where=f"step {step}, {key}{more}", a=before, b=after))
    shared = len(mine.keys() & theirs.keys())
    only = len(mine.keys() ^ theirs.keys())
    return Comparison(name="metrics", items=shared + only, differ=len(parted), first=parted[0] if parted else None,
                      note=f"{shared} steps in both" + (f", {only} in one only" if only else ""))


def _trainer_logprobs(a: Path, b: Path) -> Comparison | None:
    """Each step's π file, byte for byte; a step only one run wrote differs."""
    files = [{p.name: p for p in (d / "trainer_logprobs").glob("step-*.parquet")} for d in (a, b)]
    names = sorted(files[0].keys() | files[1].keys())
    if not names:
        return None
    parted = [d for n in names if (d := _file(f"trainer_logprobs/{n}", a / "trainer_logprobs" / n,
                                              b / "trainer_logprobs" / n))]
    shared = len(files[0].keys() & files[1].keys())
    return Comparison(name="trainer π files", items=len(names), differ=len(parted),
                      first=parted[0] if parted else None, note=f"{shared} steps in both")


def _checkpoint(a: Path, b: Path) -> Comparison | None:
    """The newest checkpoint both runs hold: its weights tensor by tensor (file by file, where there are several),
    its other state files byte for byte."""
    held = [{p.name for p in (d / "checkpoints").glob("step-*") if _weight_files(p)} for d in (a, b)]
    shared = sorted(held[0] & held[1])
    if not shared:
        return None
    name = shared[-1]
    one, other = a / "checkpoints" / name, b / "checkpoints" / name
    files = sorted(_weight_files(one) | _weight_files(other))
    parts: list[Divergence] = []
    for file in files:  # a weight file in both tensor by tensor; the index, or a file one run lacks, as a file
        if file.endswith(".safetensors") and (one / file).is_file() and (other / file).is_file():
            parts += _weights(one / file, other / file)
        elif d := _file(f"checkpoints/{name}/{file}", one / file, other / file):
            parts.append(d)
    states = sorted({p.name for p in one.glob("*.pt")} | {p.name for p in other.glob("*.pt")})
    parts += [d for state in states if (d := _file(f"checkpoints/{name}/{state}", one / state, other / state))]
    return Comparison(name="newest shared checkpoint", items=1, differ=min(1, len(parts)),
                      first=parts[0] if parts else None, note=f"{name}: weights, {', '.join(states) or 'no state'}")


def _weight_files(checkpoint: Path) -> set[str]:
    """The names of a checkpoint's weight files: ``model.safetensors``, or numbered files and their index."""
    return {p.name for p in checkpoint.glob("model*.safetensors*")}


def _presence(where: str, in_a: bool, in_b: bool) -> Divergence:
    return Divergence(where=where, a="present" if in_a else "absent", b="present" if in_b else "absent")


def _file(where: str, a: Path, b: Path) -> Divergence | None:
    """Two files byte for byte: None when both exist and agree."""
    if a.is_file() != b.is_file():
        return _presence(where, a.is_file(), b.is_file())
    return None if a.read_bytes() == b.read_bytes() else Divergence(where=where, a="these bytes", b="other bytes")


def _weights(a: Path, b: Path) -> list[Divergence]:
    """The first tensor two safetensors files differ in (by its bytes, whatever its dtype), or their metadata;
    none when they hold the same, even laid out in another order (a resumed run's file may be)."""
    raw_a, raw_b = a.read_bytes(), b.read_bytes()  # each file read once: a checkpoint is hundreds of MB
    if raw_a == raw_b:
        return []
    (left, left_data, left_meta), (right, right_data, right_meta) = _tensors(raw_a), _tensors(raw_b)
    for name in sorted(left.keys() | right.keys()):
        if name not in left or name not in right:
            return [_presence(f"tensor {name}", name in left, name in right)]
        x, y = _tensor_bytes(left[name], left_data), _tensor_bytes(right[name], right_data)
        if (left[name]["dtype"], left[name]["shape"]) != (right[name]["dtype"], right[name]["shape"]) or x != y:
            return [Divergence(where=f"tensor {name}", a=_tensor_text(left[name], x, y),
                               b=_tensor_text(right[name], y, x))]
    if left_meta != right_meta:
        return [Divergence(where=f"{a.name} (metadata)", a=json.dumps(left_meta), b=json.dumps(right_meta))]
    return []


def _tensors(raw: bytes) -> tuple[dict[str, dict[str, Any]], bytes, dict[str, Any]]:
    """A safetensors file's tensor entries (dtype, shape, data offsets), its data bytes and its metadata."""
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    metadata = header.pop("__metadata__", None) or {}
    return header, raw[8 + size:], metadata


def _tensor_bytes(entry: Mapping[str, Any], data: bytes) -> bytes:
    start, end = entry["data_offsets"]
    return data[start:end]


_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def _tensor_text(entry: Mapping[str, Any], mine: bytes, other: bytes) -> str:
    """``dtype shape``, and for float tensors of one shape the largest difference."""
    text = f"{entry['dtype']} {tuple(entry['shape'])}"
    values = [_floats(entry["dtype"], raw) for raw in (mine, other)]
    if values[0] is None or values[1] is None or values[0].shape != values[1].shape:
        return text
    return f"{text}, max |Δ| {float(np.max(np.abs(values[0] - values[1]), initial=0.0)):.3g}"


def _floats(dtype: str, raw: bytes) -> np.ndarray | None:
    if dtype == "BF16":  # the upper half of a float32
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kind = _FLOATS.get(dtype)
    return None if kind is None else np.frombuffer(raw, kind).astype(np.float64)
