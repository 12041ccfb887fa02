"""Rollout Routing Replay on the real engine, with a small random Qwen3-MoE (`verbatim models tiny qwen3-moe`).

One two-step `verbatim train --routing-replay` (its own engine: the model family is the point): the experts the
engine recorded for every token of the first step's rollouts (sampled with the base weights) equal the router's
top-k recomputed with transformers on the same tokens, prompt tokens read from the prefix cache included (a
group's followers and the second turn read their history from it); the last token, never fed, has none; the
run trains with the replay (versions 0 → 2, μ = π_old, lint clean) and reports the flip rate and the mismatch
with and without it. Bad input (a dense model) is refused in one line before any engine starts.

That run is also the Qwen3 family's end-to-end training test (tests/test_train_families.py has the others): the
renderer is detected from the folder's template, and step 2's tokens have the logprobs of step 1's checkpoint, so
the push of Qwen3's attention (its q/k norms) and of the experts arrived. Qwen3's dense MLP is Llama's, which the
default model's tests push.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from subprocess_cli import cli
from trained_run import assert_sampled_with_previous_checkpoint, assert_two_steps

from verbatim.datamodel import NO_EXPERT, Source
from verbatim.harness.store import read_manifest, read_run
from verbatim.harness.tiny_models import write_tiny_model
from verbatim.trainer.reference import load_model
from verbatim.trainer.routing_replay import routers

AGREE = 0.99  # share of token-layers whose recorded experts are the recomputed ones (ties aside)


def router_choice(model, tokens: np.ndarray) -> np.ndarray:
    """(tokens, layers, k): the transformers router's top-k of each token, sorted."""
    seen = []
    hooks = [g.register_forward_hook(lambda _m, _i, out: seen.append(out[2].clone())) for g in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(tokens.astype(np.int64))[None], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return np.sort(torch.stack(seen, dim=1).numpy(), axis=-1)


@pytest.mark.engine
@pytest.mark.slow
def test_recorded_experts_are_the_engines_and_replay_trains(tmp_path):
    model_dir = write_tiny_model("qwen3-moe", tmp_path / "moe", seed=0)
    out = tmp_path / "run"
    done = cli("train", "--model", str(model_dir), "--env", "graded_env:TwoTurnGradedFactory", "--steps", "2",
               "--groups", "1", "--group-size", "3", "--max-turns", "2", "--max-tokens", "24", "--lr", "1e-2",
               "--seed", "4", "--max-model-len", "512", "--kv-cache-gib", "1", "--checkpoint-every", "1",
               "--routing-replay", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_manifest(out).renderer == "qwen3"  # detected from the folder's chat template
    lines = assert_two_steps(out, trainer_path="prefixflow", rows=3)
    assert_sampled_with_previous_checkpoint(out, model_dir)
    for record in lines:
        assert record["routing_flip_rate"] is not None and 0 <= record["routing_flip_rate"] < 0.05, record
        assert record["mismatch_replayed"] <= record["mismatch_unreplayed"] + 1e-6, record

    for rollout in read_run(out).rollouts:  # each step's KV (salted by version) computed by the weights before it
        last_model = int(np.flatnonzero(rollout.tokens.source == Source.MODEL)[-1])
        assert set(rollout.tokens.experts_version[:last_model].tolist()) == {rollout.info["step"] - 1}
    base = load_model(model_dir).eval()
    same = compared = cached = 0
    for rollout in (r for r in read_run(out).rollouts if r.info["step"] == 1):
        tokens, experts = rollout.tokens, rollout.tokens.routed_experts
        last_model = int(np.flatnonzero(tokens.source == Source.MODEL)[-1])
        assert (experts[:last_model] != NO_EXPERT).all(), rollout.rollout_id
        assert (experts[-1] == NO_EXPERT).all()  # the last token was never fed
        want = router_choice(base, tokens.token_id)[:last_model]
        agree = (np.sort(experts[:last_model], axis=-1) == want).all(axis=-1)
        same, compared = same + int(agree.sum()), compared + agree.size
        cached += sum(turn.cached_tokens for turn in rollout.turns if turn.index > 0)
    assert cached > 0, "no later turn read its history from the prefix cache: the check proves less than it says"
    assert same / compared >= AGREE, (same, compared)


def test_routing_flags_on_a_dense_model_are_refused_before_an_engine_starts(tmp_path):
    for flags in (["train", "--routing-replay"], ["run", "--record-routing"]):
        done = cli(*flags, "--env", "guess", "--out", str(tmp_path / flags[0]))
        assert done.returncode == 2, done.stdout + done.stderr
        message = done.stderr.strip().splitlines()
        assert len(message) == 1 and "is a dense model" in message[0], done.stderr
        assert not (tmp_path / flags[0] / "metrics.jsonl").exists()


def test_a_served_engine_is_started_with_the_extension_and_told_to_record_in_its_command():
    from verbatim.engine.expert_capture import RECORD_KEY
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import server_command
    from verbatim.engine.worker_extension import EXTENSION

    argv, _ = server_command(EngineConfig(record_experts=True))
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION and "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {RECORD_KEY: True}
    plain, _ = server_command(EngineConfig())  # the extension (a MoE's reload), not the capture
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION and "--additional-config" not in plain
    with pytest.raises(ValueError, match="needs an eager engine"):
        EngineConfig(record_experts=True, enforce_eager=False)


@pytest.mark.engine
@pytest.mark.slow
def test_a_served_moe_records_its_experts_and_a_server_not_started_to_record_is_refused(tmp_path, tiny_server):
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import ServerProcess

    refused = cli("run", "--engine", "http", "--url", tiny_server.url, "--model", tiny_server.config.model,
                  "--record-routing", "--env", "guess", "--groups", "1", "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot record the routed experts" in lines[0], refused.stderr

    model_dir = write_tiny_model("qwen3-moe", tmp_path / "moe", seed=1)
    config = EngineConfig(model=str(model_dir), kv_cache_gib=1, max_model_len=512, record_experts=True)
    out = tmp_path / "served"
    with ServerProcess(config, log_path=tmp_path / "serve.log") as server:
        done = cli("run", "--engine", "http", "--url", server.url, "--model", str(model_dir), "--record-routing",
                   "--env", "graded_env:TwoTurnGradedFactory", "--groups", "1", "--group-size", "2",
                   "--max-turns", "2", "--max-tokens", "24", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    base = load_model(model_dir).eval()
    for rollout in read_run(out).rollouts:
        tokens, experts = rollout.tokens, rollout.tokens.routed_experts
        last_model = int(np.flatnonzero(tokens.source == Source.MODEL)[-1])
        agree = (np.sort(experts[:last_model], axis=-1) == router_choice(base, tokens.token_id)[:last_model])
        assert agree.all(axis=-1).mean() >= AGREE, rollout.rollout_id
    lint = cli("lint", "trace", str(out))
    assert lint.returncode == 0, lint.stdout + lint.stderr
