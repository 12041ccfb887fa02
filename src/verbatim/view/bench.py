"""``verbatim bench view``: how fast ``verbatim view`` opens a large run and one long rollout.

A synthetic run is written to a temporary folder with :class:`~verbatim.harness.store.TraceWriter`
in batches of 8 (``verbatim run``'s default): ``rollouts`` rollouts in groups of 8, each a prompt
shared by its group, then ``turns`` model completions with environment observations between
them (sizes drawn around :data:`SIZES`), the last of them 30,000 tokens long. The timings are what
the page waits for: *open*, a fresh server's first page (the summary and the rollout list, as
the JSON bytes it sends); *tokenizer*, the rest of its background load after that; *rollout*, the
long rollout's token view (its JSON); *lint*, from opening until the background lint of every
rollout has filled in the list's problem counts and the run's minimum prefill.

It lives beside the page it times (``bench/`` sits below ``view/``); ``verbatim bench view``
(:mod:`verbatim.cli.bench`) writes its section with :mod:`verbatim.bench.docsection`.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout, Source, TokenColumns, Turn

SECTION = "bench-view"
LIBRARIES = ("pyarrow", "tokenizers")
SIZES = {"prompt": 300, "completion": 150, "observation": 60}
"""Mean tokens of a group's prompt, of a completion and of an observation."""
BATCH = 8
GROUP = 8
LONG_ID = "long"
VOCAB = 49_152


def _rollout(rid: str, group: str, prompt: np.ndarray, pieces: list[tuple[int, int]], rng: np.random.Generator,
             block: int) -> Rollout:
    """A rollout of ``prompt`` then (completion, observation) lengths; turn k's cache covers its history's blocks."""
    ids, sources, turns_col, turns = [prompt], [np.full(len(prompt), Source.PROMPT)], [np.zeros(len(prompt))], []
    n = len(prompt)
    for k, (completion, observation) in enumerate(pieces):
        if k:
            ids.append(rng.integers(0, VOCAB, observation))
            sources.append(np.full(observation, Source.ENV))
            turns_col.append(np.full(observation, k))
            n += observation
        cached = (n - 1) // block * block if k else 0
        ids.append(rng.integers(0, VOCAB, completion))
        sources.append(np.full(completion, Source.MODEL))
        turns_col.append(np.full(completion, k))
        turns.append(Turn(index=k, prompt_end=n, completion_end=n + completion, cached_tokens=cached))
        n += completion
    source = np.concatenate(sources).astype(np.int8)
    logprob = np.where(source == Source.MODEL, -rng.exponential(0.5, n), np.nan).astype(np.float32)
    tokens = TokenColumns(token_id=np.concatenate(ids).astype(np.int32), source=source, logprob=logprob,
                          policy_version=np.where(source == Source.MODEL, 0, -1).astype(np.int32),
                          turn=np.concatenate(turns_col).astype(np.int16))
    return Rollout(run_id="bench-view", group_id=group, rollout_id=rid, tokens=tokens, turns=tuple(turns),
                   reward=float(rng.integers(0, 2)), info={"env": {"solved": bool(rng.integers(0, 2))}})


def _size(rng: np.random.Generator, mean: int) -> int:
    return max(1, int(rng.normal(mean, mean / 4)))


def write_synthetic_run(path: Path, rollouts: int, *, turns: int = 3, long_tokens: int = 30_000,
                        model: str = "", seed: int = 0, block: int = 16) -> Path:
    """A run directory of ``rollouts`` rollouts, the last of them ``long_tokens`` long (id :data:`LONG_ID`)."""
    from verbatim.harness.store import RunManifest, TraceWriter

    rng = np.random.default_rng(seed)
    manifest = RunManifest(run_id="bench-view", model=model, renderer="smollm2",
                           engine={"block_size": block, "cache_policy": "keep"})
    writer = TraceWriter(path, manifest)
    batch: list[Rollout] = []
    prompt = rng.integers(0, VOCAB, SIZES["prompt"])
    for i in range(rollouts - 1):
        if i % GROUP == 0:
            prompt = rng.integers(0, VOCAB, _size(rng, SIZES["prompt"]))
        pieces = [(_size(rng, SIZES["completion"]), _size(rng, SIZES["observation"])) for _ in range(turns)]
        batch.append(_rollout(f"r{i:06d}", f"g{i // GROUP:05d}", prompt, pieces, rng, block))
        if len(batch) == BATCH:
            writer.write_batch(batch)
            batch = []
    long_turns = max(1, long_tokens // 1_000)  # 800 sampled and 200 observed per turn, none before the first
    pieces = [(800, 200)] * long_turns
    batch.append(_rollout(LONG_ID, "long", rng.integers(0, VOCAB, max(1, long_tokens - 1_000 * long_turns + 200)),
                          pieces, rng, block))
    writer.write_batch(batch)
    writer.write_manifest(manifest.model_copy(update={"status": "completed"}))
    return path


def time_view(run_dir: Path, *, lint_timeout_s: float = 600.0) -> dict[str, Any]:
    """Seconds to the first page, to the long rollout's token view, and to the finished background lint."""
    from verbatim.view.run_data import RunData
    from verbatim.view.server import json_bytes

    began, cpu = time.perf_counter(), time.process_time()
    data = RunData(run_dir)
    first_page = len(json_bytes(data.summary())) + len(json_bytes(data.rollout_list()))
    opened, open_cpu = time.perf_counter() - began, time.process_time() - cpu
    load = os.getloadavg()[0]
    began = time.perf_counter()
    data.token_text()  # loaded in the background from the first page on; the page waits for it only if sooner
    tokenizer = time.perf_counter() - began
    began = time.perf_counter()
    detail = data.rollout(LONG_ID)
    long_bytes = len(json_bytes(detail))
    loaded = time.perf_counter() - began
    data.wait_for_lint(lint_timeout_s)
    linted = time.perf_counter() - began + opened + tokenizer
    return {"rollouts": data.summary()["rollouts"], "open_s": opened, "open_cpu_s": open_cpu,
            "load": load, "first_page_bytes": first_page,
            "rollout_s": loaded, "tokenizer_s": tokenizer,
            "rollout_tokens": len(detail["columns"]["id"]), "rollout_bytes": long_bytes,
            "lint_s": linted, "tokenizer": data.summary()["problems"] == []}


def run_bench(rollouts: int, *, turns: int = 3, long_tokens: int = 30_000, model: str = "") -> dict[str, Any]:
    """Write the synthetic run in a temporary folder, time it, remove it."""
    with tempfile.TemporaryDirectory(prefix="verbatim-bench-view-") as tmp:
        run = Path(tmp) / "run"
        began = time.perf_counter()
        write_synthetic_run(run, rollouts, turns=turns, long_tokens=long_tokens, model=model)
        written = time.perf_counter() - began
        files = len(list(run.glob("rollouts-*")))
        result = time_view(run)
    return result | {"write_s": written, "batch_files": files, "turns": turns}


def markdown(result: dict[str, Any], command: str) -> str:
    """The doc section: what was measured, and one table."""
    rows = [
        ("open: summary + rollout list (first page)", result["open_s"],
         f"{result['first_page_bytes'] / 1e6:.1f} MB JSON; {result['open_cpu_s']:.2f} s of CPU (all threads)"),
        ("the tokenizer, loaded in the background after the first page", result["tokenizer_s"],
         "a rollout opened sooner waits for it"),
        (f"one rollout of {result['rollout_tokens']:,} tokens (token view)", result["rollout_s"],
         f"{result['rollout_bytes'] / 1e6:.1f} MB JSON"),
        ("background lint of every rollout (counts in the list)", result["lint_s"],
         "from opening; the page updates when done"),
    ]
    table = "| what the page waits for | seconds | |\n|---|---:|---|\n" + "\n".join(
        f"| {what} | {seconds:.2f} | {note} |" for what, seconds, note in rows)
    words = "token texts from the SmolLM2 tokenizer" if result["tokenizer"] else "token ids (no tokenizer found)"
    return (f"`verbatim view` on a synthetic run of {result['rollouts']:,} rollouts ({result['turns']} turns each "
            "but the long one, "
            f"{result['batch_files']:,} batch files of {BATCH}, groups of {GROUP}), one of them "
            f"{result['rollout_tokens']:,} tokens long; {words}. Each time is one fresh server's answer as the JSON "
            f"it sends; wall-clock seconds, on a machine whose load average was {result['load']:.1f} when the "
            f"run opened (CPU seconds say what the page costs without the others). Measured "
            f"{dt.date.today().isoformat()} with `{command}`.\n\n{table}")

