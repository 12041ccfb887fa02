"""The trainer's logprobs of a run's rollouts, from the files ``verbatim mismatch --save`` and ``verbatim train``
write beside the trace (:mod:`verbatim.trainer.logprob_files`).

Nothing is read when the run opens: the files are listed, and a file's rollout ids are read the
first time a rollout is looked up (once per file and (size, mtime)). A rollout a training step
trained takes that step's log π (the π_old its update used); otherwise ``mismatch --save``'s.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout
from verbatim.errors import TraceFormatError
from verbatim.trainer.logprob_files import RolloutLogprobs, logprob_files, read_ids, read_logprobs, read_meta


class TrainerLogprobs:
    """Which file holds each rollout's trainer logprobs, and the rows themselves on request (thread-safe)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._lock = threading.Lock()
        self._files: list[tuple[Path, tuple[int, int]]] = []
        self._ids: dict[tuple[Path, tuple[int, int]], set[str]] = {}
        self.problems: list[str] = []

    def refresh(self) -> None:
        files = []
        for path in logprob_files(self.run_dir):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((path, (stat.st_size, stat.st_mtime_ns)))
        with self._lock:
            self._files = files
            self._ids = {key: ids for key, ids in self._ids.items() if key in files}

    def sources(self) -> list[str]:
        """The files found, relative to the run directory."""
        with self._lock:
            return [str(path.relative_to(self.run_dir)) for path, _ in self._files]

    def find(self, rollout_id: str, length: int) -> dict[str, Any] | None:
        """``{"logprob", "keep", "source", "meta"}`` of a rollout, or None when no file holds it (or not whole)."""
        with self._lock:
            files = list(self._files)
        for key in files:
            if rollout_id not in self._holds(key):
                continue
            path = key[0]
            try:
                row: RolloutLogprobs | None = read_logprobs(path, [rollout_id]).get(rollout_id)
                meta = read_meta(path)
            except TraceFormatError as exc:
                self._note(exc.one_line())
                continue
            if row is None or len(row.logprob) != length:
                self._note(f"{path.name}: {rollout_id} has {0 if row is None else len(row.logprob)} trainer "
                           f"logprobs for {length} tokens; ignored")
                continue
            return {"logprob": row.logprob, "keep": row.keep, "flips": row.flips,
                    "source": str(path.relative_to(self.run_dir)), "meta": meta}
        return None

    def find_rollout(self, rollout: Rollout) -> dict[str, Any] | None:
        """:meth:`find` for a whole rollout: a rollout of several segments is trained as one row per segment
        (``r``, ``r#1``, …), joined here in token order; None unless every segment's row is there."""
        pieces = rollout.segments()
        found = [self.find(piece.row_id, len(piece.tokens)) for piece in pieces]
        if len(found) == 1 or any(f is None for f in found):
            return found[0] if len(found) == 1 else None
        flips = None if any(f["flips"] is None for f in found) else np.concatenate([f["flips"] for f in found])
        return {**found[0], "logprob": np.concatenate([f["logprob"] for f in found]),
                "keep": np.concatenate([f["keep"] for f in found]), "flips": flips}

    def _holds(self, key: tuple[Path, tuple[int, int]]) -> set[str]:
        with self._lock:
            if key in self._ids:
                return self._ids[key]
        try:
            ids = set(read_ids(key[0]))
        except TraceFormatError as exc:
            self._note(exc.one_line())
            ids = set()
        with self._lock:
            self._ids[key] = ids
        return ids

    def _note(self, problem: str) -> None:
        with self._lock:
            if problem not in self.problems:
                self.problems.append(problem)
