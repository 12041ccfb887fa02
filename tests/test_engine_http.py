"""The HTTP backend against a real `vllm serve` started on 127.0.0.1 by the test, and its failure modes."""

from __future__ import annotations

import asyncio
import time

import pytest

from verbatim.bench.policies import scenario_prompts
from verbatim.engine.http import HttpEngine
from verbatim.engine.metrics import parse_prometheus
from verbatim.engine.protocol import Sampling
from verbatim.engine.runtime import EngineConfig
from verbatim.engine.server import check_bind, free_port
from verbatim.engine.server_url import redact
from verbatim.errors import EngineError, InputError


@pytest.mark.engine
@pytest.mark.slow
def test_multi_turn_reuse_over_http(vllm_server):
    async def scenario():
        async with HttpEngine(vllm_server.url) as engine:
            assert engine.logprobs_check == "processed"  # the probe: our servers report processed logprobs
            prompt, observation = scenario_prompts(seed=5, prompt_len=290, new_len=200)
            turn1 = await engine.generate(prompt, Sampling(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
            history = prompt + turn1.token_ids.tolist()
            turn2 = await engine.generate(history + observation, Sampling(max_tokens=4))
            salted = await engine.generate(prompt, Sampling(max_tokens=2), cache_salt="other")
            with pytest.raises(InputError, match="out of vocabulary"):
                await engine.generate([1, 10**6], Sampling(max_tokens=2))
            return turn1, history, turn2, salted, await engine.stats()

    turn1, history, turn2, salted, stats = asyncio.run(scenario())
    assert len(turn1.logprobs) == len(turn1.token_ids) == 20
    block = vllm_server.config.block_size  # what the session's server was started with
    assert turn2.cached_tokens >= len(history) // block * block
    assert salted.cached_tokens == 0
    assert turn2.kv_versions == (0,) and salted.kv_versions == ()  # turn 2 reused turn 1's KV, from version 0
    assert stats.prefix_cache_hits >= turn2.cached_tokens and stats.prefix_cache_queries > 0


@pytest.mark.engine
def test_an_http_engine_learns_the_block_size_the_server_was_started_with(vllm_server):
    """The session's server runs blocks of 64, not the default 32 (tests/conftest.py): the engine reads them from
    the server."""

    async def learned(url: str) -> tuple[int, int]:
        engine = HttpEngine(url)
        before = engine.block_size
        async with engine:
            return before, engine.block_size

    served = vllm_server.config.block_size
    assert served != EngineConfig().block_size
    assert asyncio.run(learned(vllm_server.url)) == (EngineConfig().block_size, served)


@pytest.mark.engine
def test_a_run_begins_a_served_tied_model_from_its_kept_untied_copy(vllm_server, default_model_dir, monkeypatch):
    """The default model ties its output layer, so the server reloads an untied copy (engine/untied.py). The copy
    a run begins from is the one kept for those weights (``serving_copy``), not another written (650 MB) and
    deleted by each run and each resume."""
    import verbatim.engine.http as http
    from verbatim.engine.untied import serving_copy

    def written_again(folder):
        raise AssertionError(f"an untied copy of {folder} written again")

    monkeypatch.setattr(http, "untied_folder", written_again)

    async def begin_twice() -> int:
        async with HttpEngine(vllm_server.url) as engine:
            for version in (3, 0):
                await engine.begin(str(default_model_dir), version)
            return engine.version

    assert asyncio.run(begin_twice()) == 0
    assert (serving_copy(default_model_dir) / "verbatim-untied.json").is_file()


def test_unreachable_server_fails_fast_with_one_error():
    async def call():
        engine = HttpEngine(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05, connect_timeout_s=1.0)
        try:
            await engine.generate([1, 2, 3])
        finally:
            await engine.aclose()

    started = time.monotonic()
    with pytest.raises(EngineError, match="failed after 3 attempts"):
        asyncio.run(call())
    assert time.monotonic() - started < 10


def test_secrets_in_urls_are_redacted_and_remote_binds_need_a_flag():
    assert redact("http://user:secret@host:8000/v1") == "http://***@host:8000/v1"
    assert check_bind("127.0.0.1", allow_remote=False) is None
    with pytest.raises(InputError) as info:
        check_bind("0.0.0.0", allow_remote=False)
    assert "pass --allow-remote" in info.value.one_line()
    assert "warning" in check_bind("0.0.0.0", allow_remote=True)


def test_prometheus_totals_sum_over_labels():
    text = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0"} 12.0\nvllm:prefix_cache_hits_total{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.25\n')
    assert parse_prometheus(text) == {"vllm:prefix_cache_hits_total": 15.0, "vllm:kv_cache_usage_perc": 0.25}
