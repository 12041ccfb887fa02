"""One block size, the engine's: a run's manifest records it, and lint, the summary and the simulator read it there."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from fakes import STOP, CharRenderer

from verbatim.datamodel import Completion, Message, Rollout
from verbatim.engine.http import HttpEngine
from verbatim.engine.protocol import Sampling
from verbatim.engine.runtime import EngineConfig
from verbatim.envs.base import Reset, StepResult
from verbatim.errors import TraceFormatError
from verbatim.harness.ledger import Ledger
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, TraceWriter, read_manifest
from verbatim.lint.trace import lint_run
from verbatim.sim.replay import replay_check


class ForgetfulEngine:
    """Answers "ok" + stop and never reports a cache hit; its blocks are 32 tokens."""

    block_size = 32
    version = 0

    async def generate(self, prompt_ids, sampling=None, *, session_id=None, group_id=None, cache_salt=None):
        ids = CharRenderer.encode("ok") + [STOP]
        return Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.5), versions=np.zeros(len(ids)),
                          finish_reason="stop", prompt_tokens=len(prompt_ids), cached_tokens=0, total_s=0.1)


class TwoTurns:
    def reset(self, task, seed):
        self.done = False
        return Reset(messages=(Message(role="user", content="x" * 40),))

    def step(self, message):
        done, self.done = self.done, True
        return StepResult(messages=(Message(role="user", content="more"),), reward=1.0, done=done)


class Factory:
    def make(self):
        return TwoTurns()


def test_a_run_records_the_engine_block_size_and_lint_judges_with_it(tmp_path: Path):
    """The manifest given to the run says nothing of blocks: the run writes the engine's 32 there, so turn 1
    (57 + 3 − 1 = 59 tokens computed, an 81-token prompt) should have found 32 tokens cached, where 128-token
    blocks would have held none."""
    plan = RunPlan(run_id="b", groups=1, group_size=1)
    run = Run(plan, LoopConfig(max_turns=2, sampling=Sampling(max_tokens=4)), ForgetfulEngine(), CharRenderer(),
              Factory(), [{"n": 0}], tmp_path / "run", RunManifest(run_id="b", config={"plan": plan.model_dump()}))
    summary = asyncio.run(run.play())
    assert read_manifest(tmp_path / "run").engine["block_size"] == 32 and summary.block_size == 32
    (verdict,) = lint_run(tmp_path / "run").verdicts
    assert [(p.kind, p.turn) for p in verdict.problems] == [("cache_shortfall", 1)]
    assert "0 of 32 reusable" in verdict.problems[0].detail and "block size 32" in verdict.problems[0].detail


def one_turn(rollout_id: str, prompt: int) -> Rollout:
    ledger = Ledger()
    ledger.append_prompt(np.arange(prompt))
    ledger.append_completion(Completion(token_ids=np.arange(3), logprobs=np.full(3, -0.5), versions=np.zeros(3),
                                        finish_reason="stop", prompt_tokens=prompt, cached_tokens=0,
                                        first_token_s=0.01 * prompt, total_s=0.01 * prompt + 0.1))
    return ledger.to_rollout(run_id="r", group_id="g", rollout_id=rollout_id)


def test_replaying_a_run_without_the_engine_block_size_is_refused(tmp_path: Path):
    rollouts = [one_turn(f"a{i}", 40 + 10 * i) for i in range(3)]
    TraceWriter(tmp_path / "run", RunManifest(run_id="r", engine={"block_size": 16})).write_batch(rollouts)
    assert replay_check(tmp_path / "run").turns == 3
    TraceWriter(tmp_path / "bare", RunManifest(run_id="r")).write_batch(rollouts)
    with pytest.raises(TraceFormatError, match=r"does not record the engine's block size \(engine.block_size\)"):
        replay_check(tmp_path / "bare")


# ---------------------------------------------------------------------------
# An HTTP engine asks its server
# ---------------------------------------------------------------------------


def serve(metrics: str | None) -> http.server.ThreadingHTTPServer:
    """A server that lists one model, answers /metrics with ``metrics`` (None: 404) and completions with one
    token (no top logprobs: the logprob mode stays unchecked)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.startswith("/v1/models"):
                status, body = 200, json.dumps({"data": [{"id": "m"}]}).encode()
            elif self.path.startswith("/metrics") and metrics is not None:
                status, body = 200, metrics.encode()
            else:
                status, body = 404, b"not found"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 - the start's logprob probe: an answer without top logprobs
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


CACHE_INFO = ('# TYPE vllm:cache_config_info gauge\n'
              'vllm:cache_config_info{block_size="64",enable_prefix_caching="True",num_gpu_blocks="900"} 1.0\n')


@pytest.mark.parametrize("metrics,configured,expected", [
    (CACHE_INFO, None, 64),                      # the server says
    (CACHE_INFO, 16, 64),                        # the server's word wins over a setting
    (None, None, EngineConfig().block_size),     # no metrics: the engine's default, never 128
    ("vllm:num_requests_running 0.0\n", 16, 16),  # metrics without the cache config: the setting
])
def test_an_http_engine_learns_its_block_size_from_the_server(metrics, configured, expected):
    server = serve(metrics)
    url = f"http://127.0.0.1:{server.server_port}"

    async def start() -> int:
        engine = HttpEngine(url) if configured is None else HttpEngine(url, block_size=configured)
        async with engine:
            return engine.block_size

    try:
        assert asyncio.run(start()) == expected
    finally:
        server.shutdown()
        server.server_close()
