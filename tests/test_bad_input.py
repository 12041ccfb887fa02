"""Bad input through the CLI: exit code 2, one line naming what to fix, nothing written.

Extends tests/test_run_cli.py (unknown env, cache policy, model path, missing --url, a
task line that is not JSON), tests/test_export.py and tests/test_trace_lint.py (a folder
that is not a run) and tests/test_renderers_drift.py (a template that raises).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import SCHEMA_VERSION, Message
from verbatim.engine.server import free_port
from verbatim.envs.base import Reset
from verbatim.errors import InputError
from verbatim.harness.preflight import preflight
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest

runner = CliRunner()


def one_error_line(result, needle: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    return lines[0]


@pytest.mark.parametrize("flag,value,needle", [
    ("--env", "gues", "unknown env 'gues' (did you mean 'guess'?"),
    ("--model", "smollm2-135m", "unknown model 'smollm2-135m' (did you mean 'smollm2-135m-instruct'?"),
    ("--renderer", "qwen-3", "unknown renderer 'qwen-3' (did you mean"),
])
def test_unknown_names_suggest_the_closest_and_write_nothing(tmp_path, default_model_dir, flag, value, needle):
    out = tmp_path / "never"
    args = ["run", "--env", "guess", flag, value, "--out", str(out)]
    one_error_line(runner.invoke(app, args), needle)
    assert not out.exists()


def test_a_task_line_that_is_not_an_object_is_named(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"target": 3}\n\n[1, 2]\n')
    out = tmp_path / "never"
    one_error_line(runner.invoke(app, ["run", "--env", "guess", "--tasks", str(tasks), "--out", str(out)]),
                   "tasks.jsonl line 3: a task must be a JSON object, got list")
    assert not out.exists()


@pytest.fixture
def newer_run(tmp_path) -> Path:
    run = tmp_path / "newer"
    run.mkdir()
    manifest = {"schema_version": SCHEMA_VERSION + 1, "run_id": "future", "some_new_field": 1}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.mark.parametrize("command", [["lint", "trace"], ["export", "--format", "verl"], ["mismatch"]])
def test_a_run_from_a_newer_schema_is_refused_untouched(newer_run, command):
    before = sorted(p.name for p in newer_run.iterdir())
    one_error_line(runner.invoke(app, [*command, str(newer_run)]), f"uses trace schema {SCHEMA_VERSION + 1}, newer")
    assert sorted(p.name for p in newer_run.iterdir()) == before


def test_resuming_a_run_from_a_newer_schema_is_refused_untouched(newer_run, default_model_dir):
    text = (newer_run / "manifest.json").read_text()
    result = runner.invoke(app, ["run", "--env", "guess", "--out", str(newer_run), "--resume"])
    one_error_line(result, "newer than this verbatim reads")
    assert (newer_run / "manifest.json").read_text() == text and len(list(newer_run.iterdir())) == 1


def test_resume_where_there_is_no_run_is_refused(tmp_path, default_model_dir):
    out = tmp_path / "typo"
    result = runner.invoke(app, ["run", "--env", "guess", "--out", str(out), "--resume"])
    one_error_line(result, f"--resume: {out} holds no run to resume")
    assert not out.exists()


@pytest.mark.parametrize("command", [["lint", "trace"], ["mismatch"]])
def test_a_folder_that_is_not_a_trace_is_refused(tmp_path, command):
    (tmp_path / "notes.txt").write_text("hello")
    one_error_line(runner.invoke(app, [*command, str(tmp_path)]), "is not a verbatim run (no manifest.json)")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


NOT_VLLM = {  # name -> (status, content type, body) that a URL answers to GET /v1/models
    "404": (404, "text/html", b"<html>no such page</html>"),
    "html": (200, "text/html", b"<html><body>Welcome to nginx!</body></html>"),
    "no-models": (200, "application/json", json.dumps({"data": [], "object": "list"}).encode()),
    "not-a-list": (200, "application/json", json.dumps({"status": "ok"}).encode()),
}
NEEDLES = {
    "404": "(GET /v1/models answered 404 Not Found: <html>no such page</html>)",
    "html": "(GET /v1/models answered 200 with a body that is not JSON (text/html, 43 bytes))",
    "no-models": "(GET /v1/models answered 200 with JSON that lists no model ids)",
    "not-a-list": "(GET /v1/models answered 200 with JSON that lists no model ids)",
    "refused": "(GET /v1/models cannot connect",
}


def _answering(status: int, kind: str, body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    class NotVllm(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return NotVllm


@pytest.mark.parametrize("answer", [*NOT_VLLM, "refused"])
def test_a_url_that_is_not_a_vllm_server_is_refused_before_anything_is_written(tmp_path, default_model_dir,
                                                                                answer):
    """One GET /v1/models, no retries: exit 2, one line, no run folder and no progress bar."""
    out = tmp_path / "never"
    server = None
    if answer == "refused":
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _answering(*NOT_VLLM[answer]))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}"
    started = time.monotonic()
    try:
        result = runner.invoke(app, ["run", "--env", "guess", "--engine", "http", "--url", url, "--out", str(out)])
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    line = one_error_line(result, NEEDLES[answer])
    assert line.startswith(f"error: {url} is not a vLLM server (GET /v1/models ") and line.endswith("(check --url)")
    assert not out.exists() and result.stdout.strip() == ""
    assert time.monotonic() - started < 15  # no retries with backoff


def test_a_renderer_whose_ids_the_model_does_not_have_is_refused_before_the_engine(tmp_path, default_model_dir):
    """Llama 3's template ids (128000+) on SmolLM2 (49,152 tokens): every request would fail."""
    out = tmp_path / "never"
    result = runner.invoke(app, ["run", "--env", "guess", "--renderer", "llama3", "--out", str(out)])
    one_error_line(result, "the opening prompt of task 0 has token id 128")
    assert "outside the vocabulary of smollm2-135m-instruct (49152 tokens) with the llama3 renderer" in result.stderr
    assert not out.exists() and result.stdout.strip() == ""


def test_an_opening_prompt_longer_than_the_context_is_refused_before_the_engine(tmp_path, default_model_dir):
    out = tmp_path / "never"
    result = runner.invoke(app, ["run", "--env", "longdoc", "--max-model-len", "256", "--max-tokens", "32",
                                 "--out", str(out)])
    line = one_error_line(result, "the opening prompt of task 0 is ")
    assert "tokens; with --max-tokens 32 it does not fit --max-model-len 256 (raise --max-model-len" in line
    assert not out.exists() and result.stdout.strip() == ""


def test_a_task_the_env_calls_bad_is_named_by_its_index_before_the_engine(tmp_path, default_model_dir):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"target": 3}\n{"target": 99}\n')
    out = tmp_path / "never"
    result = runner.invoke(app, ["run", "--env", "guess", "--tasks", str(tasks), "--out", str(out)])
    one_error_line(result, "task 1: guess task")
    assert "target 99 is outside 1..50" in result.stderr and not out.exists()


class _Renderer:
    def render(self, messages, *, tools=None, add_generation_prompt):
        return SimpleNamespace(token_ids=[5] * sum(len(m.content) for m in messages))


class _Env:
    name = "odd"

    def reset(self, task, seed):
        if task["odd"] == "raise":
            raise RuntimeError("the sandbox is down")
        if task["odd"] == "hang":
            time.sleep(3)
        return Reset(messages=(Message(role="user", content="x" * task["chars"]),))


def _preflight(tasks, timeout_s=5.0):
    factory = SimpleNamespace(name="odd", make=_Env, tasks=None)
    run = Run(RunPlan(run_id="p", groups=len(tasks), group_size=2), LoopConfig(), object(), _Renderer(), factory,
              tasks, Path("never-written"), RunManifest(run_id="p", model="m", renderer="r"))
    preflight(run, vocab_size=10, max_model_len=300, max_tokens=50, timeout_s=timeout_s)


def test_preflight_leaves_env_failures_and_hangs_to_the_rollouts_and_checks_the_rest():
    ok = {"odd": None, "chars": 250}
    _preflight([{"odd": "raise", "chars": 999}, ok])  # a reset that raises: the rollout records it
    started = time.monotonic()
    _preflight([{"odd": "hang", "chars": 999}, ok], timeout_s=0.5)  # a reset that hangs: the run starts
    assert time.monotonic() - started < 2
    with pytest.raises(InputError, match="opening prompt of task 1 is 251 tokens; with --max-tokens 50"):
        _preflight([{"odd": "raise", "chars": 999}, {"odd": None, "chars": 251}])


# -- paths the system refuses, inputs too long to repeat, --debug anywhere -------------------------

LONG = "x" * 300  # one path component longer than any file system allows (255 bytes)


@pytest.mark.parametrize("args", [
    ["lint", "template", "--template", f"/tmp/{LONG}/t.jinja"],
    ["lint", "trace", f"/tmp/{LONG}/run"],
    ["export", f"/tmp/{LONG}/run", "--format", "verl"],
    ["run", "--env", "guess", "--out", f"/tmp/{LONG}/run"],
    ["run", "--env", "guess", "--model", f"/tmp/{LONG}/model"],
    ["train", "--env", "guess", "--out", f"/tmp/{LONG}/run"],
])
def test_a_path_too_long_for_the_file_system_is_one_short_line(args, default_model_dir):
    line = one_error_line(runner.invoke(app, args), "")
    assert "too long" in line.lower() and len(line) < 400, line


def test_a_100_kb_url_is_one_short_line(tmp_path, default_model_dir):
    url = "http://" + "a" * 100_000
    result = runner.invoke(app, ["run", "--env", "guess", "--engine", "http", "--url", url,
                                 "--out", str(tmp_path / "o")])
    line = one_error_line(result, "--url is 100,007 characters long")
    assert len(line) < 400 and not (tmp_path / "o").exists()


def test_an_error_never_repeats_a_huge_input_whole(tmp_path):
    result = runner.invoke(app, ["run", "--env", "g" * 50_000, "--out", str(tmp_path / "o")])
    line = one_error_line(result, "unknown env")
    assert len(line) < 600 and "characters)" in line, line


def test_debug_after_the_subcommand_shows_our_traceback_not_a_usage_error(tmp_path):
    result = runner.invoke(app, ["lint", "trace", str(tmp_path / "none"), "--debug"])
    assert result.exit_code != 0
    assert "No such option" not in result.output
    assert type(result.exception).__name__ == "TraceFormatError", repr(result.exception)


# -- output paths are checked before any work -------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (["run", "--env", "guess", "--summary-json", "{nodir}/s.json"], "--summary-json {nodir}/s.json: the folder"),
    (["train", "--env", "guess", "--summary-json", "{nodir}/s.json"], "--summary-json {nodir}/s.json: the folder"),
    (["run", "--env", "guess", "--summary-json", "{tmp}"], "is a folder"),
    (["mismatch", "{tmp}/run", "--plot", "{nodir}/x.png"], "--plot {nodir}/x.png: the folder"),
    (["plot", "{tmp}/run", "--out", "{nodir}/c.png"], "--out {nodir}/c.png: the folder"),
    (["export", "{tmp}/run", "--format", "verl", "--out", "{nodir}/x.parquet"], "--out {nodir}/x.parquet: the folder"),
    (["view", "{tmp}/run", "--static", "{nodir}/x.html"], "--static {nodir}/x.html: the folder"),
    (["run", "--env", "guess", "--out", "{file}"], "is a file, not a folder"),
    (["train", "--env", "guess", "--out", "{file}/run"], "is a file, not a folder"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, args, needle):
    (tmp_path / "notes.txt").write_text("mine")
    names = {"nodir": str(tmp_path / "nodir"), "tmp": str(tmp_path), "file": str(tmp_path / "notes.txt")}
    started = time.perf_counter()
    result = runner.invoke(app, [a.format(**names) for a in args])
    one_error_line(result, needle.format(**names))
    assert time.perf_counter() - started < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("args", [
    ["export", "{run}", "--format", "verl", "--out", "{run}/x.parquet"],
    ["view", "{run}", "--static", "{run}/x.html"],
    ["view", "{run}", "--static", "{run}/manifest.json"],
    ["mismatch", "{run}", "--plot", "{run}/ratios.png"],
])
def test_an_output_among_a_runs_files_is_refused(tmp_path, args):
    """export, view --static and mismatch --plot share one rule: RUN_DIR/exports/ is the one place inside a run
    they may write."""
    from verbatim.harness.store import TraceWriter

    run = tmp_path / "run"
    TraceWriter(run, RunManifest(run_id="r", engine={"block_size": 16}))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    one_error_line(runner.invoke(app, [a.format(run=run) for a in args]), f"is inside the run directory {run}")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("args", [
    ["run", "--env", "guess", "--out", "{tmp}/new", "--summary-json", "{file}"],
    ["train", "--env", "guess", "--out", "{tmp}/new", "--summary-json", "{file}"],
    ["view", "{run}", "--static", "{file}"],
    ["mismatch", "{run}", "--plot", "{file}"],
    ["plot", "{run}", "--out", "{file}"],
    ["export", "{run}", "--format", "verl", "--out", "{file}"],
])
def test_an_existing_output_file_is_refused_unless_forced(tmp_path, args):
    """Every flag that writes a file outside a run folder keeps a file already there: one line naming --force."""
    from verbatim.harness.store import TraceWriter

    run, notes = tmp_path / "run", tmp_path / "notes.txt"
    TraceWriter(run, RunManifest(run_id="r", engine={"block_size": 16}))
    notes.write_text("mine")
    line = one_error_line(runner.invoke(app, [a.format(tmp=tmp_path, run=run, file=notes) for a in args]),
                          f"{notes} already exists")
    assert "--force" in line
    assert notes.read_text() == "mine" and not (tmp_path / "new").exists()


def test_view_static_with_force_replaces_the_file(tmp_path):
    from verbatim.harness.store import TraceWriter

    run, page = tmp_path / "run", tmp_path / "page.html"
    TraceWriter(run, RunManifest(run_id="r", engine={"block_size": 16}))
    page.write_text("old")
    result = runner.invoke(app, ["view", str(run), "--static", str(page), "--force"])
    assert result.exit_code == 0, result.output
    assert page.read_text().lstrip().lower().startswith("<!doctype html")


def test_a_summary_beside_the_run_directory_the_command_creates_is_accepted(tmp_path):
    """`make demo`: --out runs/demo --summary-json runs/demo.summary.json on a clone with no runs/ yet."""
    from verbatim.paths import check_output_file

    runs = tmp_path / "runs"
    assert check_output_file(runs / "demo.summary.json", "--summary-json", created=runs / "demo") \
        == runs / "demo.summary.json"
    assert not runs.exists()  # checked, nothing created
    with pytest.raises(InputError, match="the folder .*elsewhere does not exist"):
        check_output_file(tmp_path / "elsewhere" / "s.json", "--summary-json", created=runs / "demo")
