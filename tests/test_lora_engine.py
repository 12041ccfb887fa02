"""LoRA on the real engine: the adapter the trainer pushes is what vLLM samples with, token for token.

On the session's LoRA engine (``lora_engine``: rank 8, the default model, fp32):

- ``verbatim train --lora-rank 8`` for 2 synchronous steps through the entry point: versions 0→2, step 2's sampled
  tokens' μ are the logprobs of the base model plus step 1's adapter (the checkpoint's PEFT folder, loaded with
  transformers + peft) and not the base model's, and the checkpoints load with ``PeftModel.from_pretrained``;
- an adapter pushed while a request runs: the request's tokens all belong to the adapter it was sent with, the
  next request names the new one.

On a ``vllm serve`` of the tiny SmolLM2 started for LoRA (its own: the session's servers are not), a run over
``--engine http`` as a real process, SIGKILLed once its first checkpoint is written and resumed: each step after
samples with the adapter of the checkpoint before it, loaded through the server's runtime LoRA endpoint.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from killable_train import Trainer, served
from trained_run import assert_sampled_with_previous_checkpoint
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Source
from verbatim.engine.protocol import Adapter, CachePolicy, Sampling
from verbatim.harness.store import read_run
from verbatim.jobs.config import TrainConfig
from verbatim.jobs.train import run_training
from verbatim.rl.plan import TrainPlan
from verbatim.trainer import lora
from verbatim.trainer.learner_config import LearnerConfig, LoraConfig
from verbatim.trainer.reference import load_model, reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

AGREEMENT = 1e-3  # fp32 engine vs transformers + peft, mean |Δ logprob| (the bound)


@pytest.fixture(scope="module")
def synchronous(lora_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    plan = TrainPlan(steps=2, groups=2, group_size=2, max_lag=0, cache_policy=CachePolicy.KEEP, keep_checkpoints=2,
                     checkpoint_every=1, seed=2)
    config = TrainConfig(play={"env": "guess", "env_args": {"high": 8, "max_guesses": 3}, "max_turns": 2},
                         sampling={"max_tokens": 12, "temperature": 1.0}, engine={"max_model_len": 2048},
                         output={"out": str(folder / "run")}, plan=plan,
                         learner=LearnerConfig(lr=2e-2, lora=LoraConfig(rank=8)))
    history = run_training(config, engine=lora_engine.engine)
    yield folder / "run", history
    shutil.rmtree(folder, ignore_errors=True)


def peft_model(base: torch.nn.Module, folder: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()


def test_every_token_is_sampled_by_the_adapter_of_its_version(synchronous, default_model_dir):
    out, history = synchronous
    assert [r["version"] for r in history] == [1, 2]
    assert all(r["weight_sync_form"] == "lora" and r["cache_policy_served"] == "salt" for r in history)
    base = load_model(default_model_dir).eval()
    models = {0: base, 1: peft_model(base, out / "checkpoints" / "step-000001")}
    moved = 0.0
    for rollout in read_run(out).rollouts:
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        version = rollout.info["step"] - 1  # synchronous: step n samples with version n - 1 alone
        assert set(tokens.policy_version[at].tolist()) == {version}
        with torch.no_grad():
            pi = reference_logprobs(models[version], tokens.token_id, at).numpy()
            plain = reference_logprobs(base, tokens.token_id, at).numpy()
        assert np.abs(pi - tokens.logprob[at]).mean() < AGREEMENT, rollout.rollout_id
        moved = max(moved, float(np.abs(plain - tokens.logprob[at]).mean())) if version else moved
    assert moved > 10 * AGREEMENT, "step 1's adapter did not move the policy: the check proves nothing"
    assert (out / "adapters").is_dir() and all(lora.is_adapter_folder(p) for p in (out / "adapters").iterdir())


def test_the_checkpoints_are_peft_folders_of_the_adapter_alone(synchronous, default_model_dir):
    out, _ = synchronous
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["step-000001", "step-000002"]
    for folder in folders:
        assert lora.is_adapter_folder(folder) and not (folder / "model.safetensors").exists()
        assert lora.read_adapter_config(folder)["base_model_name_or_path"] == str(default_model_dir)
    result = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert result.exit_code == 0, result.output[-2000:]


def random_adapter(base: torch.nn.Module, folder: Path, seed: int) -> Path:
    """A rank-8 adapter whose B is random: a policy clearly unlike the base model's."""
    model = lora.attach(copy.deepcopy(base), LoraConfig(rank=8), base="base")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return lora.write_adapter(folder, model)


def test_an_adapter_pushed_mid_request_leaves_the_request_with_the_one_it_was_sent_with(
        lora_engine, default_model_dir, default_tokenizer, tmp_path):
    engine = lora_engine.engine
    base = load_model(default_model_dir).eval()
    first, second = random_adapter(base, tmp_path / "a", 1), random_adapter(base, tmp_path / "b", 2)
    start = engine.version + 1
    prompt = default_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    long = Sampling(max_tokens=160, temperature=1.0, seed=5, ignore_eos=True)

    async def scenario():
        await engine.update_weights(Adapter(folder=str(first), rank=8), start, CachePolicy.KEEP)
        request = asyncio.ensure_future(engine.generate(prompt, long))
        while (await engine.stats()).running == 0:  # it is sampling
            await asyncio.sleep(0.01)
        await engine.update_weights(Adapter(folder=str(second), rank=8), start + 1, CachePolicy.KEEP)
        pushed_while_running = not request.done()
        after = await engine.generate(prompt, Sampling(max_tokens=16, temperature=1.0, seed=6))
        return await request, after, pushed_while_running

    got, after, pushed_while_running = lora_engine.run(scenario())
    assert pushed_while_running, "the request ended before the push: nothing was tested"
    assert set(got.versions.tolist()) == {start} and set(after.versions.tolist()) == {start + 1}
    for completion, own, other in ((got, first, second), (after, second, first)):
        ids = list(prompt) + completion.token_ids.tolist()
        at = range(len(prompt), len(ids))
        with torch.no_grad():
            want = reference_logprobs(peft_model(base, own), ids, at).numpy()
            unlike = reference_logprobs(peft_model(base, other), ids, at).numpy()
        assert np.abs(want - completion.logprobs).mean() < AGREEMENT
        assert np.abs(unlike - completion.logprobs).mean() > 10 * AGREEMENT


@pytest.fixture(scope="module")
def tiny_lora_server(tiny_smollm2_dir, tmp_path_factory):
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import ServerProcess

    config = EngineConfig(model=str(tiny_smollm2_dir), kv_cache_gib=1, max_model_len=1024, lora_rank=8)
    with ServerProcess(config, log_path=tmp_path_factory.mktemp("serve-lora") / "serve.log") as server:
        yield server


def test_a_served_lora_run_killed_after_its_first_checkpoint_resumes_with_that_adapter(tiny_lora_server, tmp_path):
    out = tmp_path / "run"
    args = ["--env", "graded_env:GradedFactory", "--steps", "3", "--groups", "2", "--group-size", "2",
            "--max-tokens", "6", "--lr", "1e-2", "--max-model-len", "1024", "--seed", "4", "--lora-rank", "8",
            *served(tiny_lora_server), "--out", str(out), "--checkpoint-every", "1", "--keep-checkpoints", "3"]
    first = Trainer(tmp_path, "1", args)
    first.kill_when(lambda: (out / "checkpoints" / "step-000001").is_dir())
    second = Trainer(tmp_path, "2", [*args, "--resume"])
    assert second.wait(300) == 0, second.err()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2, 3] and {x["weight_sync_form"] for x in lines} == {"lora"}
    model_dir = Path(tiny_lora_server.config.model)
    for step in (2, 3):
        assert_sampled_with_previous_checkpoint(out, model_dir, step=step)
    lint = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert lint.exit_code == 0, lint.output[-2000:]


def test_an_engine_that_serves_no_lora_is_pushed_the_weights_with_the_adapter_merged(engine_runner, default_model_dir,
                                                                                      tmp_path):
    """The session's engine was started without LoRA: a LoRA run on it pushes W + scale·B·A at every version and
    says so in each step's line; step 2 samples with step 1's adapter folded into the base."""
    from trained_run import checkpoint_model

    plan = TrainPlan(steps=2, groups=2, group_size=2, max_lag=0, checkpoint_every=1, keep_checkpoints=2, seed=3)
    config = TrainConfig(play={"env": "guess", "env_args": {"high": 8, "max_guesses": 3}, "max_turns": 1},
                         sampling={"max_tokens": 8, "temperature": 1.0}, engine={"max_model_len": 2048},
                         output={"out": str(tmp_path / "run")}, plan=plan,
                         learner=LearnerConfig(lr=2e-2, lora=LoraConfig(rank=8)))
    history = run_training(config, engine=engine_runner.engine)
    assert [r["weight_sync_form"] for r in history] == ["merged", "merged"]
    assert all(r["weight_sync_bytes"] > 100 * 2**20 for r in history)  # the whole model, not an adapter
    merged = load_model(default_model_dir)
    merged.load_state_dict(lora.merged_weights(checkpoint_model(tmp_path / "run" / "checkpoints" / "step-000001",
                                                                default_model_dir, 1)), strict=True)
    merged.eval()
    for rollout in (r for r in read_run(tmp_path / "run").rollouts if r.info["step"] == 2):
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        assert set(tokens.policy_version[at].tolist()) == {1}
        with torch.no_grad():
            pi = reference_logprobs(merged, tokens.token_id, at).numpy()
        assert np.abs(pi - tokens.logprob[at]).mean() < AGREEMENT, rollout.rollout_id
