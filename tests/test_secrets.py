"""Servers bind to loopback unless told otherwise; credentials never reach an output, a log or a trace.

Extends ``test_secrets_in_urls_are_redacted_and_remote_binds_need_a_flag`` in tests/test_engine_http.py.
The end-to-end checks (a real run with credentials in ``--url``; errors of a faulty server) are in
tests/test_kill_resume.py and tests/test_engine_faults.py.
"""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.engine.runtime import EngineConfig
from verbatim.engine.server import LOOPBACK, check_bind, server_command
from verbatim.engine.server_url import redact, redact_text
from verbatim.errors import InputError

runner = CliRunner()


@pytest.mark.parametrize("url,shown", [
    ("http://user:pw-123@10.0.0.5:8000/v1", "http://***@10.0.0.5:8000/v1"),
    ("http://:pw-123@10.0.0.5", "http://***@10.0.0.5"),
    ("https://pw-123@host.example/", "https://***@host.example/"),
    ("http://h:1/?api_key=pw-123&model=m", "http://h:1/?api_key=***&model=m"),
    ("http://h:1/x?token=pw-123", "http://h:1/x?token=***"),
    ("http://h:1/?access_token=pw-123&X-Amz-Signature=pw-123&Password=pw-123",
     "http://h:1/?access_token=***&X-Amz-Signature=***&Password=***"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://[::1]:99999/?key=pw-123", "***"),  # not a URL urllib can take apart: shown as nothing
])
def test_redact_removes_every_credential_and_keeps_the_rest(url, shown):
    assert redact(url) == shown
    assert "pw-123" not in redact(url)


def test_redact_text_finds_urls_and_tokens_inside_messages():
    text = ("POST http://bob:pw-123@10.1.2.3:8000/v1/completions?api_key=pw-456 failed; "
            "headers {'authorization': 'Bearer sk-abcdefgh1234'} and Basic Ym9iOnB3LTEyMw==; api key tok-789")
    clean = redact_text(text, secrets=["tok-789"])
    for secret in ("pw-123", "pw-456", "sk-abcdefgh1234", "Ym9iOnB3LTEyMw==", "tok-789", "bob"):
        assert secret not in clean, (secret, clean)
    assert "http://***@10.1.2.3:8000/v1/completions?api_key=***" in clean
    assert "Basic auth" in redact_text("Basic auth is not used"), "ordinary words stay"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_need_no_flag(host):
    assert check_bind(host, allow_remote=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "my-host.example"])
def test_every_other_bind_is_refused_without_the_flag_and_warned_with_it(host):
    with pytest.raises(InputError) as refused:
        check_bind(host, allow_remote=False)
    assert f"refusing to bind to {host}" in refused.value.one_line() and "pass --allow-remote" in \
        refused.value.one_line()
    assert check_bind(host, allow_remote=True).startswith(f"warning: binding to {host};")


def test_servers_default_to_loopback(default_model_dir):
    argv, _ = server_command(EngineConfig(model=str(default_model_dir)))
    assert argv[argv.index("--host") + 1] == LOOPBACK == "127.0.0.1"


@pytest.fixture
def exec_calls(monkeypatch):
    """``verbatim serve`` ends by exec'ing vLLM; record the call instead (no engine starts, so the suite's count of
    engine starts, which ``serve`` adds to before it execs, is not told of one)."""
    from verbatim.engine.start_log import STARTS_ENV

    calls = []
    monkeypatch.setattr(os, "execvpe", lambda path, argv, env: calls.append(argv))
    monkeypatch.delenv(STARTS_ENV, raising=False)
    return calls


def test_serve_binds_to_loopback_by_default(exec_calls, default_model_dir):
    result = runner.invoke(app, ["serve", "--model", str(default_model_dir)])
    assert result.exit_code == 0, result.output
    (argv,) = exec_calls
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "warning" not in result.stderr


@pytest.mark.parametrize("command", [["serve"], ["fleet", "up", "--replicas", "1"]])
def test_a_remote_bind_without_the_flag_is_refused_before_anything_starts(exec_calls, monkeypatch, command):
    import verbatim.engine.fleet as fleet

    monkeypatch.setattr(fleet, "fleet_up", lambda *a, **k: pytest.fail("a server was started"))
    result = runner.invoke(app, [*command, "--host", "0.0.0.0"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing to bind to 0.0.0.0" in lines[0] and "--allow-remote" in lines[0]
    assert exec_calls == []


def test_a_remote_bind_with_the_flag_warns_then_binds_there(exec_calls, default_model_dir):
    result = runner.invoke(app, ["serve", "--model", str(default_model_dir), "--host", "0.0.0.0",
                                 "--allow-remote"])
    assert result.exit_code == 0, result.output
    assert "warning: binding to 0.0.0.0" in result.stderr
    (argv,) = exec_calls
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_a_run_manifest_holds_only_redacted_urls(tmp_path, default_model_dir):
    from verbatim.jobs.run import RunOptions, prepare_run

    urls = ("http://alice:pw-123@127.0.0.1:9/?api_key=pw-456", "http://127.0.0.1:10/?token=pw-789")
    run, engine = prepare_run(RunOptions(play={"env": "guess"}, engine={"kind": "http", "urls": urls},
                                         output={"out": str(tmp_path / "run")}))
    text = run.manifest.model_dump_json()
    for secret in ("pw-123", "pw-456", "pw-789", "alice"):
        assert secret not in text
    assert run.manifest.engine["urls"] == ["http://***@127.0.0.1:9/?api_key=***", "http://127.0.0.1:10/?token=***"]
    engine.close()
