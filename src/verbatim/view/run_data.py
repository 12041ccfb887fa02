"""A run directory as the page sees it, read again whenever its files change.

Opening is cheap: the rollout list and the run's totals come from a few columns of each
batch file (:mod:`verbatim.view.run_index`), indexed once per file and (size, mtime). What
needs every token runs in one background thread once the page has its list: the
tokenizer is loaded, then each batch is read whole and ``lint trace`` checks its rollouts;
the list's problem counts and the run's minimum prefill appear when that pass is done (the
page polls, and redraws when ``generation`` moves). A rollout the page opens is read and
linted on its own at once. A run still being written (status ``running``, unfinished
writes, damaged files) is shown as far as it goes and is marked ``partial``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from verbatim.datamodel import Rollout
from verbatim.errors import InputError, TraceError, TraceFormatError
from verbatim.harness.metrics_log import METRICS_FILE, read_metrics
from verbatim.harness.store import _TMP_PREFIX, batch_files, read_manifest
from verbatim.harness.tracefile import brief
from verbatim.lint.findings import CacheSettings, Problem
from verbatim.lint.trace import check_extension, check_sampling, check_spans, check_version_order, lint_rollout
from verbatim.prefix_cache import min_prefill
from verbatim.view import detail
from verbatim.view.run_index import BatchIndex, index_batches, read_batch, signature
from verbatim.view.sidecar import TrainerLogprobs
from verbatim.view.tokens import TokenText

COMPLETE = "completed"


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory, or the one-line error (exit 2) for a path that is not one."""
    read_manifest(run_dir)
    return Path(run_dir)


class RunData:
    """The run's data, re-indexed when any of its files changes (thread-safe)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = check_run_dir(run_dir)
        self._lock = threading.RLock()
        self._signature: tuple | None = None
        self._batches: dict[str, BatchIndex] = {}
        self._opened: dict[tuple[str, tuple[int, int]], list[Problem]] = {}
        self._tokens: TokenText | None = None
        self._tokens_lock = threading.Lock()
        self._min_prefill: tuple[tuple, int] | None = None
        self._wake = threading.Event()
        self._settled = threading.Event()
        self._worker: threading.Thread | None = None
        self.trainer = TrainerLogprobs(self.run_dir)
        self.generation = 0

    # -- indexing -------------------------------------------------------------------

    def _files_signature(self) -> tuple:
        entries = []
        for entry in os.scandir(self.run_dir):
            if entry.is_file():
                stat = entry.stat()
                entries.append((entry.name, stat.st_size, stat.st_mtime_ns))
        return tuple(sorted(entries))

    def refresh(self) -> None:
        with self._lock:
            files = self._files_signature()
            if files == self._signature:
                return
            self._index()
            self._signature = files
            self.generation += 1
            self._settled.clear()
            self._wake.set()

    def _index(self) -> None:
        self.manifest = read_manifest(self.run_dir)
        batches: dict[str, BatchIndex | None] = {}
        for _, path in batch_files(self.run_dir):
            known = self._batches.get(path.name)
            try:
                batches[path.name] = known if known is not None and known.signature == signature(path) else None
            except OSError:
                continue
        stale = [self.run_dir / name for name, known in batches.items() if known is None]
        fresh = {b.path.name: b for b in index_batches(stale)}
        batches = {name: known or fresh[name] for name, known in batches.items()}
        self._batches = batches
        self.where: dict[str, BatchIndex] = {}
        self.groups: dict[str, list[str]] = {}
        for batch in batches.values():
            for row in batch.rows:
                if row["id"] not in self.where:
                    self.where[row["id"]] = batch
                    self.groups.setdefault(row["group"], []).append(row["id"])
        self.load_problems = [f"{p.name}: an unfinished write (interrupted run); ignored"
                              for p in sorted(self.run_dir.glob(f"{_TMP_PREFIX}*"))]
        self.load_problems += [b.problem for b in batches.values() if b.problem]
        self.settings = self._cache_settings()
        self.metrics = self._metrics()
        self.trainer.refresh()

    def _cache_settings(self) -> CacheSettings | None:
        try:
            return CacheSettings.from_manifest(self.manifest, self.run_dir)
        except TraceFormatError as exc:
            self.load_problems.append(f"{exc.one_line()}: cache hits are not judged")
            return None

    def _metrics(self) -> list[dict[str, Any]] | None:
        if not (self.run_dir / METRICS_FILE).is_file():
            return None
        try:
            return read_metrics(self.run_dir)
        except (InputError, TraceError) as exc:
            self.load_problems.append(exc.one_line())
            return []

    # -- the background pass: tokenizer, lint, minimum prefill ---------------------------------

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="verbatim-view-lint", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        self.token_text()
        while True:
            self._wake.wait()
            self._wake.clear()
            while (batch := self._next_unlinted()) is not None:
                self._lint_batch(batch)
            self._finish_min_prefill()
            with self._lock:
                if not self._wake.is_set():
                    self._settled.set()

    def _next_unlinted(self) -> BatchIndex | None:
        with self._lock:
            return next((b for b in self._batches.values() if b.lint is None and not b.problem), None)

    def _lint_batch(self, batch: BatchIndex) -> None:
        try:
            rollouts = read_batch(batch)
            lint = {r.rollout_id: self._lint(r) for r in rollouts}
        except TraceFormatError as exc:
            batch.problem = batch.problem or exc.one_line()
            return
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the pass (the page would wait forever)
            batch.problem = f"{batch.path.name}: not linted ({type(exc).__name__}: {brief(exc)})"
            return
        requests = [(r.tokens.token_id[t.prompt_start:t.prompt_end], r.tokens.token_id[t.prompt_end:t.completion_end])
                    for r in rollouts for t in r.turns]
        with self._lock:
            batch.requests, batch.lint = requests, lint

    def _finish_min_prefill(self) -> None:
        with self._lock:
            batches = list(self._batches.values())
            key = tuple((b.path.name, b.signature) for b in batches)
            if self._min_prefill and self._min_prefill[0] == key:
                return
            if any(b.lint is None and not b.problem for b in batches):
                return
        value = min_prefill(pair for b in batches for pair in (b.requests or ()))
        with self._lock:
            self._min_prefill = (key, value)
            self.generation += 1

    def wait_for_lint(self, timeout_s: float | None = None) -> bool:
        """Start the background pass if need be and wait for it; False if it is still running after ``timeout_s``."""
        self.refresh()
        self._start_worker()
        return self._settled.wait(timeout_s)

    def _lint(self, rollout: Rollout) -> list[Problem]:
        if self.settings is not None:
            return lint_rollout(rollout, self.settings)
        problems = check_extension(rollout)
        if not problems:
            problems += check_spans(rollout)
        return problems + check_sampling(rollout) + check_version_order(rollout)

    def _problems_of(self, rollout: Rollout, batch: BatchIndex) -> list[Problem]:
        if batch.lint is not None and rollout.rollout_id in batch.lint:
            return batch.lint[rollout.rollout_id]
        key = (rollout.rollout_id, batch.signature)
        if key not in self._opened:
            self._opened[key] = self._lint(rollout)
        return self._opened[key]

    def token_text(self) -> TokenText:
        with self._tokens_lock:
            if self._tokens is None:
                self._tokens = TokenText.for_manifest(self.manifest)
            return self._tokens

    # -- what the endpoints answer ------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        self.refresh()
        with self._lock:
            manifest, batches = self.manifest, list(self._batches.values())
            rows = self._rows()
            linted = all(b.lint is not None for b in batches if not b.problem)
            problems = self.load_problems + [b.problem for b in batches if b.problem not in (None, *self.load_problems)]
            min_pre = self._min_prefill[1] if self._min_prefill and linted else None
        damaged = bool(problems)
        if self._tokens is not None and self._tokens.problem:
            problems.append(self._tokens.problem)
        problems += self.trainer.problems
        return {
            "run_id": manifest.run_id, "status": manifest.status, "created_at": manifest.created_at,
            "model": manifest.model, "renderer": manifest.renderer, "format": manifest.format,
            "partial": manifest.status != COMPLETE or damaged,
            "training": self.metrics is not None, "metrics": self.metrics or [],
            "totals": self._totals(batches, rows, min_pre), "problems": problems, "generation": self.generation,
            "rollouts": len(rows), "groups": len(self.groups), "trainer_logprobs": self.trainer.sources(),
            "lint_pending": not (linted and min_pre is not None),
            "lint_problems": sum(r["problems"] for r in rows) if linted else None,
        }

    def _totals(self, batches: list[BatchIndex], rows: list[dict[str, Any]], min_pre: int | None) -> dict | None:
        if self.settings is None:
            return None
        totals = {key: sum(b.turn_totals.get(key, 0) for b in batches)
                  for key in ("turns", "prompt_tokens", "cached_tokens", "generated_tokens")}
        statuses: dict[str, int] = {}
        for row in rows:
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        rewards = [r["reward"] for r in rows if r["reward"] is not None]
        prompt = totals["prompt_tokens"]
        return totals | {
            "rollouts": len(rows), "prefill_tokens": prompt - totals["cached_tokens"], "min_prefill_tokens": min_pre,
            "statuses": statuses, "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "block_size": self.settings.block_size,
            "cache_hit_rate": totals["cached_tokens"] / prompt if prompt else 0.0}

    def _rows(self) -> list[dict[str, Any]]:
        """The list rows, with lint counts where the background pass (or an opened rollout) has them."""
        rows = []
        for batch in self._batches.values():
            for row in batch.rows:
                if self.where.get(row["id"]) is not batch:
                    continue
                problems = (batch.lint or {}).get(row["id"])
                if problems is None:
                    problems = self._opened.get((row["id"], batch.signature))
                counts = ({"misses": sum(p.kind == detail.CACHE_MISS for p in problems), "problems": len(problems)}
                          if problems is not None else {"misses": None, "problems": None})
                rows.append(row | counts)
        return rows

    def rollout_list(self) -> dict[str, Any]:
        self.refresh()
        with self._lock:
            rows = self._rows()
        self._start_worker()
        return {"rows": rows, "generation": self.generation}

    def _read(self, ids: list[str]) -> list[tuple[Rollout, list[Problem]]]:
        """Whole rollouts and their problems, each batch file read once."""
        with self._lock:
            located = [(rid, self.where[rid]) for rid in ids]
        by_batch: dict[str, list[int]] = {}
        for rid, batch in located:
            by_batch.setdefault(batch.path.name, []).append(batch.position(rid))
        found: dict[str, Rollout] = {}
        for rid, batch in located:
            if rid not in found:
                for rollout in read_batch(batch, by_batch[batch.path.name]):
                    found[rollout.rollout_id] = rollout
        out = []
        for rid, batch in located:
            with self._lock:
                out.append((found[rid], self._problems_of(found[rid], batch)))
        return out

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        self.refresh()
        self._find(self.where, rollout_id, "rollout")
        self._start_worker()
        ((rollout, problems),) = self._read([rollout_id])
        texts, specials = self.token_text().texts(rollout.tokens.token_id.tolist())
        correction = (self.manifest.config or {}).get("correction") or {}
        return detail.rollout_detail(
            rollout, problems, texts, specials,
            block_size=self.settings.block_size if self.settings else None,
            hybrid_window=int(correction.get("hybrid_window") or detail.DEFAULT_HYBRID_WINDOW),
            trainer=self.trainer.find_rollout(rollout))

    def group(self, group_id: str) -> dict[str, Any]:
        self.refresh()
        ids = list(self._find(self.groups, group_id, "group"))
        self._start_worker()
        members = self._read(ids)
        tokens = self.token_text()
        rows = [detail.rollout_row(m, problems) for m, problems in members]
        return detail.group_detail(group_id, [m for m, _ in members],
                                   [tokens.texts(m.tokens.token_id.tolist()) for m, _ in members], rows)

    @staticmethod
    def _find(table: dict[str, Any], key: str, what: str) -> Any:
        if key not in table:
            raise InputError(f"no {what} {key!r} in this run")
        return table[key]


def everything(data: RunData) -> dict[str, Any]:
    """Every answer the page can ask for, keyed by its request path (for ``--static``: lint finished first)."""
    from urllib.parse import quote

    data.wait_for_lint()
    answers: dict[str, Any] = {"summary": data.summary(), "rollouts": data.rollout_list()}
    for rid in list(data.where):
        answers[f"rollout?id={quote(rid, safe='')}"] = data.rollout(rid)
    for gid in list(data.groups):
        answers[f"group?id={quote(gid, safe='')}"] = data.group(gid)
    return answers
