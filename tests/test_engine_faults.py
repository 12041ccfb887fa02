"""Engine faults: the HTTP client against a scripted server, and a run whose engine fails.

No real vLLM answers 503, cuts a body in half or stops answering on demand, so the client is
tested against a small scripted HTTP server on 127.0.0.1: each request takes the next step of
the server's script (the last step repeats). A real engine process that dies mid-run is tested
in tests/test_kill_resume.py; the in-process engine's request timeout at the end of this file.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import STOP, CharRenderer

from verbatim.datamodel import Message
from verbatim.engine.http import HttpEngine
from verbatim.engine.protocol import Sampling
from verbatim.engine.server import free_port
from verbatim.envs.base import Reset, StepResult
from verbatim.errors import EngineError, InputError
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run
from verbatim.lint.trace import lint_run


def completion_body(prompt_len: int = 3) -> bytes:
    """A vLLM-shaped /v1/completions answer: the text "ok" (one token per character) and a stop token."""
    ids = [ord("o") + 10, ord("k") + 10, STOP]
    return json.dumps({
        "choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5, -0.25, -0.125]},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_len, "prompt_tokens_details": {"cached_tokens": 0}},
    }).encode()


MODELS = json.dumps({"data": [{"id": "scripted"}]}).encode()


class ScriptedServer:
    """HTTP/1.1 on 127.0.0.1 that plays one scripted step per request, then closes the connection.

    Steps: ``ok``, ``503``, ``400``, ``bad_json`` (a 200 whose body is not JSON), ``cut`` (headers promise
    more body than is sent, then the connection closes), ``close`` (closed without an answer), ``hang``
    (never answers), ``trickle`` (one body byte every 0.2 s, never done), ``shape`` (valid JSON, no tokens),
    ``echo`` (a 400 whose body repeats the request's headers), ``slow`` (answers after 1.5 s), ``busy``
    (metrics of a server with requests running and waiting).
    ``/health`` follows the script too, unless ``healthy`` is set: then it is answered at once (True:
    200) or never (False), outside the script.
    """

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.requests: list[dict] = []
        self.healthy: bool | None = None
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = _read_request(conn)
            if request is None:
                return
            if request["path"] == "/health" and self.healthy is not None:
                if self.healthy:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                else:
                    self.release.wait(30)
                return
            step = self.script[min(len(self.requests), len(self.script) - 1)]
            self.requests.append(request | {"step": step})
            try:
                self._play(conn, step, request)
            except OSError:
                pass

    def _play(self, conn: socket.socket, step: str, request: dict) -> None:
        if step == "close":
            return
        if step == "hang":
            self.release.wait(30)
            return
        if step == "slow" and self.release.wait(1.5):
            return
        if step == "trickle":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            while not self.release.wait(0.2):
                conn.sendall(b" ")
            return
        body = MODELS if request["path"].startswith("/v1/models") else completion_body()
        status = "200 OK"
        if step == "503":
            status, body = "503 Service Unavailable", b'{"error": {"message": "engine overloaded"}}'
        elif step == "400":
            status, body = "400 Bad Request", b'{"error": {"message": "prompt too long"}}'
        elif step == "bad_json":
            body = body[: len(body) // 2]
        elif step == "echo":
            status, body = "400 Bad Request", f"bad request; headers were {request['headers']}".encode()
        elif step == "shape":
            body = b'{"choices": [{"text": "no token ids here"}]}'
        elif step == "busy":
            body = b'vllm:num_requests_running{model_name="m"} 2.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
        length = len(body) * (3 if step == "cut" else 1)
        if step == "cut":
            body = body[: len(body) // 2]
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)


def _read_request(conn: socket.socket) -> dict | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    while len(body) < int(headers.get("content-length", 0)):
        body += conn.recv(65536)
    method, target, _ = lines[0].split(" ", 2)
    path, _, query = target.partition("?")
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body}


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(*script: str) -> ScriptedServer:
        servers.append(ScriptedServer(list(script)))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def generate(url: str, health_every_s: float | None = None, **client: float) -> tuple[object, float]:
    """One generate call through a fresh client; returns (completion or the exception, seconds)."""
    async def call():
        engine = HttpEngine(url, model="scripted", **client)
        if health_every_s is not None:
            engine.health_every_s = health_every_s
        try:
            return await engine.generate([5, 6, 7], Sampling(max_tokens=4))
        finally:
            await engine.aclose()

    started = time.monotonic()
    try:
        result = asyncio.run(call())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        result = exc
    return result, time.monotonic() - started


FAST = {"retries": 3, "backoff_s": 0.05, "timeout_s": 0.6, "connect_timeout_s": 0.5, "budget_s": 10.0}
FAULTS = ["503", "bad_json", "cut", "close", "hang", "trickle"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_retried_with_backoff_and_the_answer_after_it_is_used(scripted, fault):
    server = scripted(fault, fault, "ok")
    completion, seconds = generate(server.url, **FAST)
    assert not isinstance(completion, Exception), completion
    assert completion.token_ids.tolist() == [ord("o") + 10, ord("k") + 10, STOP]
    assert [r["step"] for r in server.requests] == [fault, fault, "ok"]
    assert seconds >= 0.05 + 0.1  # two backoffs: 0.05 s, then 0.1 s


@pytest.mark.parametrize("fault,reason", [
    ("503", "503 Service Unavailable: engine overloaded"),
    ("bad_json", "malformed JSON"),
    ("cut", "the server broke off the answer"),
    ("close", "the server broke off the answer"),
    ("hang", "timed out waiting for an answer"),
    ("trickle", "timed out waiting for an answer"),
])
def test_a_lasting_fault_fails_after_the_retries_with_one_line_naming_the_cause(scripted, fault, reason):
    server = scripted(fault)
    error, seconds = generate(server.url, **FAST)
    assert isinstance(error, EngineError) and not isinstance(error, InputError), error
    line = error.one_line()
    assert "\n" not in line and "failed after 4 attempts" in line and reason in line, line
    assert len(server.requests) == 4
    assert seconds < 4 * 0.6 + 0.35 + 1.5, f"{seconds:.1f}s: a wait without a bound"


def test_an_unreachable_server_names_the_connection_failure():
    error, seconds = generate(f"http://127.0.0.1:{free_port()}", **FAST)
    assert isinstance(error, EngineError) and "cannot connect" in error.one_line()
    assert seconds < 3


def test_the_budget_bounds_a_call_whatever_the_retries_and_timeouts(scripted):
    server = scripted("hang")
    error, seconds = generate(server.url, retries=50, backoff_s=0.05, timeout_s=30, budget_s=1.0)
    assert isinstance(error, EngineError) and "budget 1s" in error.one_line(), error
    assert 0.9 < seconds < 2.5


def watched(url: str) -> tuple[object, float]:
    """A generate with minutes of timeout but a quick /health watch (0.25 s apart, 3 failures)."""
    return generate(url, health_every_s=0.25, timeout_s=120, budget_s=240)


def test_a_hung_server_is_declared_dead_in_seconds_not_after_its_timeout(scripted):
    server = scripted("hang")
    server.healthy = False  # accepts connections, answers nothing: a stopped or wedged server
    error, seconds = watched(server.url)
    assert isinstance(error, EngineError), error
    line = error.one_line()
    assert "the server stopped answering (/health failed 3 times in a row" in line and "--resume" in line, line
    assert seconds < 5, f"{seconds:.1f}s"
    assert len(server.requests) == 1  # declared dead, not retried


def test_a_slow_answer_from_a_live_server_is_waited_for(scripted):
    server = scripted("slow")
    server.healthy = True
    completion, seconds = watched(server.url)
    assert not isinstance(completion, Exception), completion
    assert seconds >= 1.5


@pytest.mark.parametrize("fault,kind,needle", [
    ("400", InputError, "refused the request (400): prompt too long"),
    ("shape", EngineError, "malformed completion"),
])
def test_a_refusal_or_a_wrong_answer_is_not_retried(scripted, fault, kind, needle):
    server = scripted(fault)
    error, _ = generate(server.url, **{**FAST, "timeout_s": 5.0})  # the answer is prompt: no timeout under load
    assert isinstance(error, kind) and needle in error.one_line(), error
    assert len(server.requests) == 1


def test_credentials_are_sent_but_no_error_shows_them(scripted):
    server = scripted("503")
    url = server.url.replace("http://", "http://alice:pa55word@") + "/?api_key=k3y-value&team=blue"
    error, _ = generate(url, **FAST | {"retries": 1}, api_key="t0ken-value")
    line = error.one_line()
    for secret in ("pa55word", "k3y-value", "t0ken-value", "alice:"):
        assert secret not in line, line
    assert line.startswith("http://127.0.0.1:") and "/v1/completions?api_key=***&team=blue " in line, line
    request = server.requests[0]
    assert "api_key=k3y-value" in request["query"] and request["path"] == "/v1/completions"
    assert request["headers"]["authorization"] == "Bearer t0ken-value"


def test_an_answer_that_echoes_a_secret_is_scrubbed(scripted):
    """A proxy that echoes the request, Authorization header included, into its error page."""
    server = scripted("echo")
    error, _ = generate(server.url, **FAST, api_key="t0ken-value")
    assert isinstance(error, InputError)
    line = error.one_line()
    assert "refused the request (400)" in line and "t0ken-value" not in line and "Bearer ***" in line, line


# ---------------------------------------------------------------------------
# a run whose engine fails: single failures are data, a dead engine stops the run
# ---------------------------------------------------------------------------


class TwoTurnEnv:
    def reset(self, task, seed):
        self.turns = 0
        return Reset(messages=(Message(role="user", content=f"task {task['n']}"),))

    def step(self, message):
        self.turns += 1
        return StepResult(messages=(Message(role="user", content="again"),), reward=1.0, done=self.turns == 2)


class Factory:
    def make(self):
        return TwoTurnEnv()


def play(tmp_path: Path, url: str, groups: int, concurrency: int = 4) -> tuple[Run, object]:
    plan = RunPlan(run_id="faults", groups=groups, group_size=2, concurrency=concurrency, batch_size=4)
    loop = LoopConfig(max_turns=3, context_budget=4096, sampling=Sampling(max_tokens=8))
    manifest = RunManifest(run_id="faults", format="jsonl", config={"plan": plan.model_dump()})

    async def go():
        engine = HttpEngine(url, model="scripted", retries=1, backoff_s=0.02, timeout_s=2.0)
        run = Run(plan, loop, engine, CharRenderer(), Factory(), [{"n": i} for i in range(groups)],
                  tmp_path / "run", manifest)
        try:
            return run, await run.play()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return run, exc
        finally:
            await engine.aclose()

    return asyncio.run(go())


def test_a_failed_request_ends_its_rollout_as_an_error_and_the_run_goes_on(scripted, tmp_path):
    server = scripted(*["ok"] * 5, "503", "503", *["ok"] * 200)  # one request fails both attempts
    _, summary = play(tmp_path, server.url, groups=6, concurrency=1)
    assert not isinstance(summary, Exception), summary
    trace = read_run(tmp_path / "run")
    statuses = sorted(r.status for r in trace.rollouts)
    assert statuses == ["error"] + ["ok"] * 11 and trace.manifest.status == "completed"
    (failed,) = [r for r in trace.rollouts if r.status == "error"]
    assert "failed after 2 attempts" in failed.error and "503 Service Unavailable" in failed.error
    assert lint_run(tmp_path / "run").ok


def test_when_every_request_fails_the_run_stops_with_one_line_instead_of_grinding_on(scripted, tmp_path):
    server = scripted("503")
    started = time.monotonic()
    run, error = play(tmp_path, server.url, groups=50, concurrency=4)
    assert isinstance(error, EngineError), error
    line = error.one_line()
    assert "\n" not in line and "requests in a row" in line and "503 Service Unavailable" in line, line
    assert "--resume" in line
    trace = read_run(tmp_path / "run")
    assert trace.manifest.status == "failed" and trace.problems == []
    assert 5 <= len(trace.rollouts) <= 12, "the run kept starting rollouts on a dead engine"
    assert {r.status for r in trace.rollouts} <= {"error", "interrupted"}
    assert all("503" in r.error or "stopped" in r.error for r in trace.rollouts)
    assert len(server.requests) <= 2 * 12
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------------------
# the in-process engine: a request has a timeout too
# ---------------------------------------------------------------------------


@pytest.mark.engine
def test_an_inproc_request_past_its_timeout_is_aborted_and_the_engine_still_serves(engine_runner):
    engine = engine_runner.engine
    saved = engine.request_timeout_s
    long = Sampling(max_tokens=2000, ignore_eos=True, temperature=1.0, seed=3)
    engine.request_timeout_s = 0.3
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match="did not finish within 0.3s; aborted"):
            engine_runner.run(engine.generate([1, 2, 3, 4], long, session_id="timeout"))
        assert time.monotonic() - started < 5
    finally:
        engine.request_timeout_s = saved
    after = engine_runner.run(engine.generate([1, 2, 3, 4], Sampling(max_tokens=3, ignore_eos=True)))
    assert len(after.token_ids) == 3 and np.isfinite(after.logprobs).all()


def test_a_run_does_not_begin_on_a_server_busy_with_another_clients_requests(scripted, tmp_path):
    """Beginning loads the run's weights, which would change them under the other client: refused, nothing sent
    but the metrics read."""
    server = scripted("busy")

    async def begin() -> None:
        engine = HttpEngine(server.url, model="scripted", **FAST)
        engine.idle_wait_s = 1.0
        try:
            await engine.begin(str(tmp_path), 0)
        finally:
            await engine.aclose()

    with pytest.raises(InputError, match=r"2 running and 1 waiting requests of another client \(still, after 1 s\)"):
        asyncio.run(begin())
    assert {r["path"] for r in server.requests} == {"/metrics"} and len(server.requests) >= 2  # asked again
