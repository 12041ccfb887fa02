"""A run directory as the page sees it, read again whenever its files change.

:class:`RunData` reads the manifest, every intact rollout, ``lint trace``'s problems of
each, and, for a training run, ``metrics.jsonl``. A run still being written (status
``running``, unfinished writes, damaged files) is shown as far as it goes and is marked
``partial``; the page polls the summary and picks up new batches as they land.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from verbatim.datamodel import Rollout
from verbatim.errors import InputError, TraceError, TraceFormatError
from verbatim.harness.metrics_log import METRICS_FILE, read_metrics
from verbatim.harness.store import RunTrace, read_manifest, read_run
from verbatim.harness.summary import summarize
from verbatim.lint.findings import CacheSettings, Problem
from verbatim.lint.trace import check_extension, check_sampling, check_spans, check_version_order, lint_rollout
from verbatim.view import detail
from verbatim.view.tokens import TokenText

COMPLETE = "completed"


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory, or the one-line error (exit 2) for a path that is not one."""
    read_manifest(run_dir)
    return Path(run_dir)


class RunData:
    """The run's data, reloaded when any of its files changes (thread-safe)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = check_run_dir(run_dir)
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._tokens: TokenText | None = None
        self.generation = 0

    # -- loading --------------------------------------------------------------

    def _files_signature(self) -> tuple:
        entries = []
        for entry in os.scandir(self.run_dir):
            if entry.is_file():
                stat = entry.stat()
                entries.append((entry.name, stat.st_size, stat.st_mtime_ns))
        return tuple(sorted(entries))

    def refresh(self) -> None:
        with self._lock:
            signature = self._files_signature()
            if signature == self._signature:
                return
            self._load()
            self._signature = signature
            self.generation += 1

    def _load(self) -> None:
        trace: RunTrace = read_run(self.run_dir)
        self.manifest = trace.manifest
        self.rollouts: dict[str, Rollout] = {}
        for rollout in trace.rollouts:
            self.rollouts.setdefault(rollout.rollout_id, rollout)
        self.load_problems = list(trace.problems)
        self.settings = self._cache_settings()
        self.lint = {rid: self._lint(r) for rid, r in self.rollouts.items()}
        self.rows = [detail.rollout_row(r, self.lint[rid]) for rid, r in self.rollouts.items()]
        self.groups: dict[str, list[str]] = {}
        for rid, rollout in self.rollouts.items():
            self.groups.setdefault(rollout.group_id, []).append(rid)
        self.metrics = self._metrics()
        if self._tokens is None:
            self._tokens = TokenText.for_manifest(self.manifest)

    def _cache_settings(self) -> CacheSettings | None:
        try:
            return CacheSettings.from_manifest(self.manifest, self.run_dir)
        except TraceFormatError as exc:
            self.load_problems.append(f"{exc.one_line()}: cache hits are not judged")
            return None

    def _lint(self, rollout: Rollout) -> list[Problem]:
        if self.settings is not None:
            return lint_rollout(rollout, self.settings)
        problems = check_extension(rollout)
        if not problems:
            problems += check_spans(rollout)
        return problems + check_sampling(rollout) + check_version_order(rollout)

    def _metrics(self) -> list[dict[str, Any]] | None:
        if not (self.run_dir / METRICS_FILE).is_file():
            return None
        try:
            return read_metrics(self.run_dir)
        except (InputError, TraceError) as exc:
            self.load_problems.append(exc.one_line())
            return []

    # -- what the endpoints answer ------------------------------------------------

    def summary(self) -> dict[str, Any]:
        self.refresh()
        manifest = self.manifest
        totals = None
        if self.settings is not None:
            totals = summarize(list(self.rollouts.values()), block_size=self.settings.block_size)
            totals = totals.model_dump() | {"cache_hit_rate": totals.cache_hit_rate}
        problems = list(self.load_problems)
        if self._tokens is not None and self._tokens.problem:
            problems.append(self._tokens.problem)
        return {
            "run_id": manifest.run_id, "status": manifest.status, "created_at": manifest.created_at,
            "model": manifest.model, "renderer": manifest.renderer, "format": manifest.format,
            "partial": manifest.status != COMPLETE or bool(self.load_problems),
            "training": self.metrics is not None, "metrics": self.metrics or [],
            "totals": totals, "problems": problems, "generation": self.generation,
            "rollouts": len(self.rollouts), "groups": len(self.groups),
            "lint_problems": sum(len(p) for p in self.lint.values()),
        }

    def rollout_list(self) -> dict[str, Any]:
        self.refresh()
        return {"rows": self.rows, "generation": self.generation}

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        self.refresh()
        rollout = self._find(self.rollouts, rollout_id, "rollout")
        texts, specials = self._texts(rollout)
        correction = (self.manifest.config or {}).get("correction") or {}
        return detail.rollout_detail(
            rollout, self.lint[rollout_id], texts, specials,
            block_size=self.settings.block_size if self.settings else None,
            hybrid_window=int(correction.get("hybrid_window") or detail.DEFAULT_HYBRID_WINDOW),
            band=tuple(correction.get("token_mask_band") or detail.DEFAULT_MASK_BAND))

    def group(self, group_id: str) -> dict[str, Any]:
        self.refresh()
        ids = self._find(self.groups, group_id, "group")
        members = [self.rollouts[rid] for rid in ids]
        rows = [detail.rollout_row(m, self.lint[m.rollout_id]) for m in members]
        return detail.group_detail(group_id, members, [self._texts(m) for m in members], rows)

    def _texts(self, rollout: Rollout) -> tuple[list[str], list[bool]]:
        assert self._tokens is not None
        return self._tokens.texts(rollout.tokens.token_id.tolist())

    @staticmethod
    def _find(table: dict[str, Any], key: str, what: str) -> Any:
        if key not in table:
            raise InputError(f"no {what} {key!r} in this run")
        return table[key]


def everything(data: RunData) -> dict[str, Any]:
    """Every answer the page can ask for, keyed by its request path (for ``--static``)."""
    from urllib.parse import quote

    answers: dict[str, Any] = {"summary": data.summary(), "rollouts": data.rollout_list()}
    for rid in data.rollouts:
        answers[f"rollout?id={quote(rid, safe='')}"] = data.rollout(rid)
    for gid in data.groups:
        answers[f"group?id={quote(gid, safe='')}"] = data.group(gid)
    return answers

