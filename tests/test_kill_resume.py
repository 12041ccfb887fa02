"""`verbatim run` as a real process against one real `vllm serve`, hit by kills and signals.

The session's one server (tests/conftest.py: vLLM's start-up is the expensive part); the CLI process
talks to it with ``--engine http`` and starts in seconds, so it can be killed many times:

- SIGKILL at 15 points spread over a run, each followed by ``--resume``;
- SIGTERM once (graceful) and SIGINT twice (at once), each with its exit code;
- a run whose ``--url`` carries credentials leaves them in no file and no output;
- the server killed mid-run: the run stops with one line (the next test that needs a server starts another).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.engine.server import ServerProcess, free_port
from verbatim.harness.store import batch_files, read_run

pytestmark = [pytest.mark.engine, pytest.mark.slow]

GROUPS, GROUP_SIZE, BATCH = 12, 2, 4  # the CLI writes max(group size, 4) rollouts per file
SHORT = ["--env", "guess", "--group-size", str(GROUP_SIZE), "--max-turns", "2", "--max-tokens", "6",
         "--max-model-len", "2048", "--concurrency", "8", "--seed", "3"]


WARM_START = """
import pathlib, sys, time
import pyarrow.parquet, verbatim.cli.app, verbatim.envs.registry, verbatim.cli.run, verbatim.jobs.run
from verbatim.engine.models import resolve
from verbatim.renderers.registry import get_renderer
get_renderer("smollm2", model_dir=resolve("default"))  # the tokenizer's imports are the slow part
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
sys.argv = ["verbatim", *sys.argv[2:], *go.read_text().split()]
verbatim.cli.app.main()
"""
"""A process that imports what ``verbatim run`` needs, waits for its turn, then runs the CLI's entry
point exactly as the ``verbatim`` console script does: the kill loop starts the next processes while
the current one runs, so Python's imports do not fill the test's time."""


class CliProcess:
    """``verbatim run …`` in its own session, output to files (no pipe can fill up and block it)."""

    def __init__(self, tmp: Path, args: list[str], name: str, *, warm: bool = False) -> None:
        self.stdout, self.stderr = tmp / f"{name}.out", tmp / f"{name}.err"
        self.go_file = tmp / f"{name}.go" if warm else None
        command = [sys.executable, "-c", WARM_START, str(self.go_file)] if warm else \
            [sys.executable, "-m", "verbatim.cli"]
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.proc = subprocess.Popen([*command, "run", *args], stdout=out, stderr=err, start_new_session=True)

    def go(self, *extra: str) -> CliProcess:
        """Let a warm process run, with ``extra`` arguments decided only now."""
        if self.go_file is not None:
            ready = self.go_file.with_suffix(".ready")
            ready.write_text(" ".join(extra))
            ready.rename(self.go_file)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"verbatim run did not exit within {timeout:.0f}s: {self.err()[-1500:]}") from None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")


def run_args(server: ServerProcess, out: Path, groups: int = GROUPS, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--engine", "http", "--url", server.url, "--groups", str(groups), *SHORT, "--out", str(out), *extra]


def written(out: Path) -> int:
    return len(batch_files(out)) if out.is_dir() else 0


def manifest_stamp(out: Path) -> int:
    path = out / "manifest.json"
    return path.stat().st_mtime_ns if path.exists() else 0


def wait_until(condition, proc: CliProcess, timeout: float = 120.0) -> bool:
    """Poll ``condition`` until true; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not proc.alive():
            return False
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the run made no progress")


def planned_ids(groups: int) -> set[str]:
    return {f"g{g:04d}-r{i:02d}" for g in range(groups) for i in range(GROUP_SIZE)}


def assert_whole(out: Path, groups: int, statuses: set[str]) -> None:
    """Every planned rollout once, every file readable, `verbatim lint trace` clean."""
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [], "leftover temporary files"
    json.loads((out / "manifest.json").read_text())
    for _, path in batch_files(out):
        pq.read_table(path)
    trace = read_run(out)
    assert trace.problems == []
    counts = Counter(r.rollout_id for r in trace.rollouts)
    assert set(counts) == planned_ids(groups) and set(counts.values()) == {1}, counts.most_common(3)
    assert {r.status for r in trace.rollouts} <= statuses
    lint = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert lint.exit_code == 0, lint.output[-3000:]


def test_sigkill_at_15_points_then_resume_keeps_every_rollout_exactly_once(vllm_server, tmp_path):
    out, rng = tmp_path / "run", random.Random(8)
    batches = GROUPS * GROUP_SIZE // BATCH
    targets = sorted(rng.randrange(batches - 2) for _ in range(12))  # kill once this many files exist…
    kills = [("startup", rng.uniform(0.2, 2.0)) for _ in range(3)] + [("files", t) for t in targets]
    resume = run_args(vllm_server, out)  # --resume is added at go time, once a manifest exists to resume

    def resuming() -> tuple[str, ...]:
        return ("--resume",) if (out / "manifest.json").exists() else ()

    waiting = [CliProcess(tmp_path, resume, f"kill{n}", warm=True) for n in range(2)]
    seen: dict[str, object] = {}
    mid_run = 0
    try:
        for number, (kind, value) in enumerate(kills):
            before = manifest_stamp(out)
            proc = waiting.pop(0).go(*resuming())
            if number + 2 <= len(kills):  # the final --resume included
                waiting.append(CliProcess(tmp_path, resume, f"kill{number + 2}", warm=True))
            if kind == "startup":
                time.sleep(value)
            else:  # …once this process has opened the run and the files exist, after a random moment
                wait_until(lambda t=value, b=before: manifest_stamp(out) != b and written(out) >= t, proc)
                time.sleep(rng.uniform(0.0, 0.6))
            assert proc.alive(), f"kill {number} came too late: {proc.err()[-1500:]}"
            proc.kill()
            mid_run += check_after_kill(out, seen)
        after_a_file = sum(t > 0 for t in targets)  # the others land before any rollout, as start-up kills do
        assert mid_run >= after_a_file - 2, f"only {mid_run} of the {after_a_file} kills after a file landed mid-run"

        final = waiting.pop(0).go(*resuming())
        assert final.wait(600) == 0, final.err()[-3000:]
    finally:
        for proc in waiting:
            proc.kill()
    assert_whole(out, GROUPS, {"ok", "truncated"})
    assert read_run(out).manifest.status == "completed"
    for rollout in read_run(out).rollouts:
        if rollout.rollout_id in seen:
            assert rollout.same_as(seen[rollout.rollout_id])


def check_after_kill(out: Path, seen: dict[str, object]) -> bool:
    """No rollout twice, none changed, nothing unreadable but an unfinished write; True if mid-run."""
    if not (out / "manifest.json").exists():
        return False
    trace = read_run(out)
    assert all("unfinished write" in p for p in trace.problems), trace.problems
    counts = Counter(r.rollout_id for r in trace.rollouts)
    assert not counts or max(counts.values()) == 1, "a rollout was written twice"
    for rollout in trace.rollouts:  # a written rollout never changes
        assert rollout.same_as(seen.setdefault(rollout.rollout_id, rollout))
    return 0 < len(trace.rollouts) < GROUPS * GROUP_SIZE and trace.manifest.status == "running"


def test_sigterm_lets_the_playing_rollouts_finish_then_exits_143_and_resume_completes(vllm_server, tmp_path):
    out = tmp_path / "run"
    proc = CliProcess(tmp_path, run_args(vllm_server, out, groups=8, extra=("--concurrency", "4")), "term")
    wait_until(lambda: written(out) >= 1, proc)
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 143, proc.err()[-2000:]
    assert "SIGTERM: no new rollouts" in proc.out()
    lines = [line for line in proc.err().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGTERM; the run stopped with"), lines
    trace = read_run(out)
    assert trace.manifest.status == "interrupted" and trace.problems == []
    assert 0 < len(trace.rollouts) < 16 and {r.status for r in trace.rollouts} <= {"ok", "truncated"}

    resumed = CliProcess(tmp_path, run_args(vllm_server, out, groups=8, extra=("--concurrency", "4", "--resume")),
                         "term-resume")
    assert resumed.wait(300) == 0, resumed.err()[-2000:]
    assert_whole(out, 8, {"ok", "truncated"})
    assert read_run(out).manifest.status == "completed"


def test_a_second_sigint_cuts_the_playing_rollouts_keeps_their_tokens_and_exits_130(vllm_server, tmp_path):
    out = tmp_path / "run"
    longer = ("--max-tokens", "48", "--max-turns", "3")  # turns long enough to be caught mid-way
    proc = CliProcess(tmp_path, run_args(vllm_server, out, groups=8, extra=longer), "int")
    wait_until(lambda: (out / "manifest.json").exists(), proc)
    time.sleep(2.0)  # every slot busy with a rollout by now
    proc.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert proc.wait(60) == 130, proc.err()[-2000:]
    assert time.monotonic() - started < 20
    assert "SIGINT again: stopping the playing rollouts now" in proc.out()
    trace = read_run(out)
    assert trace.manifest.status == "interrupted" and trace.problems == []
    cut = [r for r in trace.rollouts if r.status == "interrupted"]
    assert cut, "no rollout was in flight at the second SIGINT"
    for rollout in cut:
        assert rollout.error == "interrupted by SIGINT" and len(rollout.tokens) > 0
    assert f"({len(cut)} of them interrupted)" in proc.err()
    lint = CliRunner().invoke(app, ["lint", "trace", str(out), "--tokens-only"])
    assert lint.exit_code == 0, lint.output[-3000:]  # what was written is clean…
    whole = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert whole.exit_code == 1 and "incomplete: the run ended interrupted" in " ".join(whole.output.split())


def test_credentials_in_the_url_reach_no_file_and_no_output(vllm_server, tmp_path):
    secrets = ("s3cr3t-pass", "s3cr3t-key", "alice")
    url = vllm_server.url.replace("http://", "http://alice:s3cr3t-pass@") + "/?api_key=s3cr3t-key"
    out = tmp_path / "run"
    args = ["--engine", "http", "--url", url, "--groups", "1", *SHORT, "--out", str(out)]
    ok = CliProcess(tmp_path, args, "secret-ok")
    assert ok.wait(300) == 0, ok.err()[-2000:]
    dead = f"http://alice:s3cr3t-pass@127.0.0.1:{free_port()}/?token=s3cr3t-key"
    failed = CliProcess(tmp_path, ["--engine", "http", "--url", dead, "--groups", "1", *SHORT, "--out",
                                   str(tmp_path / "never")], "secret-dead")
    assert failed.wait(120) == 2  # nothing listens there: bad input, refused before anything is written
    assert "error: http://127.0.0.1:" in failed.err() and "is not a vLLM server" in failed.err()
    assert not (tmp_path / "never").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"]["urls"] == [f"http://***@127.0.0.1:{vllm_server.port}/?api_key=***"]
    texts = [ok.out(), ok.err(), failed.out(), failed.err()]
    texts += [p.read_bytes().decode("latin-1") for p in out.rglob("*") if p.is_file()]
    texts += [json.dumps([r.error, r.info, r.task]) for r in read_run(out).rollouts]  # Parquet is compressed
    for secret in secrets:
        assert not any(secret in text for text in texts), secret


@pytest.mark.kills_server  # run after every other user of the session's server (tests/conftest.py)
def test_an_engine_killed_mid_run_stops_the_run_with_one_line(vllm_server, tmp_path):
    """It kills the session's server (tests/conftest.py starts another for the next test that needs one)."""
    out = tmp_path / "run"
    proc = CliProcess(tmp_path, run_args(vllm_server, out, groups=12), "dead")
    wait_until(lambda: written(out) >= 1, proc)
    os.killpg(vllm_server.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(120) == 1, proc.err()[-2000:]
    assert time.monotonic() - killed < 60, "the run ground on against a dead engine"
    lines = [line for line in proc.err().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: the engine failed 5 requests in a row, the last with: http://127.0.0.1:")
    assert "cannot connect" in lines[0] and "--resume" in lines[0]
    trace = read_run(out)
    assert trace.manifest.status == "failed" and trace.problems == []
    assert 0 < len(trace.rollouts) < 24
    failed = [r for r in trace.rollouts if r.status == "error"]
    assert failed and all("cannot connect" in r.error or "broke off" in r.error for r in failed)
    lint = CliRunner().invoke(app, ["lint", "trace", str(out), "--tokens-only"])
    assert lint.exit_code == 0, lint.output[-3000:]  # what was written is clean…
    whole = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert whole.exit_code == 1 and "incomplete: the run ended failed" in " ".join(whole.output.split())
    vllm_server.proc.wait(30)
