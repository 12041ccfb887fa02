"""Bad input through the CLI: exit code 2, one line naming what to fix, nothing written.

Extends tests/test_run_cli.py (unknown env, cache policy, model path, missing --url, a
task line that is not JSON), tests/test_export.py and tests/test_trace_lint.py (a folder
that is not a run) and tests/test_renderers_drift.py (a template that raises).
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner
from verbatim.cli import app
from verbatim.datamodel import SCHEMA_VERSION

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


@pytest.mark.parametrize("command", [["lint", "trace"], ["mismatch"]])
def test_a_folder_that_is_not_a_trace_is_refused(tmp_path, command):
    (tmp_path / "notes.txt").write_text("hello")
    one_error_line(runner.invoke(app, [*command, str(tmp_path)]), "is not a verbatim run (no manifest.json)")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


class _NotVllm(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<html>no such page</html>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_url_that_is_not_a_vllm_server_is_refused_before_anything_is_written(tmp_path, default_model_dir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "never"
    try:
        result = runner.invoke(app, ["run", "--env", "guess", "--engine", "http", "--url",
                                     f"http://127.0.0.1:{server.server_port}", "--out", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    one_error_line(result, "/v1/models refused the request (404)")
    assert not out.exists()
