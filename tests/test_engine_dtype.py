"""The engine's number format and the settings that follow its device (engine/precision.py).

Pure: ``--engine-dtype`` resolved on every kind of device, refused where the device cannot run it; a GPU engine
gets CUDA graphs and chunked prefill, a CPU engine neither, in vLLM's arguments and the server's command line
alike. Bad input: one line, exit 2, before any engine starts. Real engine: ``verbatim train`` on this CPU with a
bfloat16 engine where the processor has bfloat16 instructions (the test says which it ran): the weights each
push sends are cast to the engine's format and the engine samples with them.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.engine.precision import ENGINE_DTYPES, EngineDevice, engine_dtype, short_name, this_device
from verbatim.engine.runtime import EngineConfig
from verbatim.errors import InputError

runner = CliRunner()
DEVICES = [EngineDevice("cpu", bf16=True), EngineDevice("cpu", bf16=False, name="this x86_64 CPU"),
           EngineDevice("cuda", bf16=True, name="NVIDIA H100"), EngineDevice("cuda", bf16=False, name="Tesla T4")]


@pytest.mark.parametrize("device,asked", list(itertools.product(DEVICES, ENGINE_DTYPES)))
def test_every_asked_format_on_every_device_resolves_or_is_refused_naming_both(device, asked):
    if asked == "bf16" and not device.bf16:
        with pytest.raises(InputError, match=f"--engine-dtype bf16: {device.name} cannot run it") as refused:
            engine_dtype(asked, device)
        assert f"use --engine-dtype {'fp16' if device.gpu else 'fp32'}" in refused.value.hint
        return
    resolved = engine_dtype(asked, device)
    if asked != "auto":
        assert resolved == asked
    elif device.gpu:
        assert resolved == ("bf16" if device.bf16 else "fp16")  # vLLM's flash attention runs no float32
    else:
        assert resolved == "fp32"  # a CPU keeps logprobs close to the trainer's float32


def test_either_spelling_of_a_format_is_read_and_others_are_refused():
    assert [short_name(x) for x in ("bfloat16", "BF16", "float32", " fp16 ", "auto")] == \
        ["bf16", "bf16", "fp32", "fp16", "auto"]
    with pytest.raises(InputError, match="engine dtype 'fp64' must be one of auto, bf16, fp16, fp32"):
        short_name("fp64")
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="resolved before"):
        EngineConfig(dtype="auto")


def test_a_gpu_engine_gets_cuda_graphs_and_chunked_prefill_and_a_cpu_engine_neither(default_model_dir):
    from verbatim.engine.inproc import engine_args
    from verbatim.engine.server import server_command

    cpu = EngineConfig(model=str(default_model_dir), max_model_len=2048)
    gpu = EngineConfig(model=str(default_model_dir), device="cuda", dtype="bf16", max_model_len=2048)
    assert (cpu.eager, cpu.batched_tokens, cpu.chunked_prefill) == (True, 2048, False)
    assert (gpu.eager, gpu.batched_tokens, gpu.chunked_prefill) == (False, None, True)
    args = engine_args(gpu, default_model_dir)
    assert args["enforce_eager"] is False and args["enable_chunked_prefill"] is True
    assert args["max_num_batched_tokens"] is None and args["dtype"] == "bfloat16"  # vLLM's own step size
    argv = server_command(gpu)[0]
    assert "--enforce-eager" not in argv and "--no-enable-chunked-prefill" not in argv
    assert "--max-num-batched-tokens" not in argv and argv[argv.index("--dtype") + 1] == "bfloat16"
    plain = server_command(cpu)[0]
    assert "--enforce-eager" in plain and "--no-enable-chunked-prefill" in plain
    assert plain[plain.index("--max-num-batched-tokens") + 1] == "2048"
    asked = EngineConfig(model=str(default_model_dir), device="cuda", dtype="bf16", enforce_eager=True,
                         max_num_batched_tokens=4096)
    assert (asked.eager, asked.batched_tokens, asked.chunked_prefill) == (True, 4096, False)  # unless asked


@pytest.mark.parametrize("args,needle", [
    (["run", "--env", "guess", "--engine-dtype", "fp64"], "--engine-dtype"),
    (["run", "--env", "guess", "--engine", "http", "--url", "http://127.0.0.1:9", "--engine-dtype", "bf16"],
     "--engine-dtype sets the in-process engine"),
    (["train", "--env", "guess", "--engine", "http", "--url", "http://127.0.0.1:9", "--no-engine-eager"],
     "--engine-eager sets the in-process engine"),
    (["serve", "--dtype", "fp64"], "engine dtype 'fp64' must be one of"),
    (["fleet", "up", "--dtype", "double"], "engine dtype 'double' must be one of"),
])
def test_a_format_that_cannot_be_asked_is_one_line_exit_2(tmp_path, args, needle):
    result = runner.invoke(app, [*args, *(["--out", str(tmp_path / "run")] if args[0] in ("run", "train") else [])])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) <= 2, result.output
    assert not (tmp_path / "run").exists()


def test_bf16_on_a_cpu_without_its_instructions_is_refused_before_the_engine_starts(tmp_path, monkeypatch):
    import verbatim.engine.precision as precision

    monkeypatch.setattr(precision, "this_device", lambda: EngineDevice("cpu", False, "this x86_64 CPU"))
    result = runner.invoke(app, ["run", "--env", "guess", "--engine-dtype", "bf16", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--engine-dtype bf16: this x86_64 CPU cannot run it" in result.output
    assert not (tmp_path / "r").exists()


BF16_AGREEMENT = 0.02
"""max |Δ logprob| of a bfloat16 engine against transformers in bfloat16 on the same weights (other kernels, other
rounding); measured here: 0.0019 on the tiny SmolLM2, and 0.45 against the base weights after step 1."""


@pytest.mark.engine
@pytest.mark.slow
def test_a_bf16_engine_on_this_cpu_samples_with_the_pushed_weights_cast_to_bf16(tmp_path, tiny_smollm2_dir):
    """Two steps of ``verbatim train`` with ``--engine-dtype bf16`` where this processor runs bfloat16 (else fp32,
    and the run says so): the manifest records the format, μ differs from the trainer's float32 π_old by bfloat16
    rounding only, and step 2's tokens have the logprobs of step 1's checkpoint in that format, not the base
    model's: the cast push arrived."""
    import torch
    from subprocess_cli import cli

    from verbatim.datamodel import Source
    from verbatim.harness.store import read_manifest, read_run
    from verbatim.trainer.checkpoint import load_checkpoint
    from verbatim.trainer.reference import load_model, reference_logprobs

    dtype = "bf16" if this_device().bf16 else "fp32"
    print(f"\nthis CPU runs the engine in {dtype} ({this_device().name})")
    out = tmp_path / "run"
    done = cli("train", "--model", str(tiny_smollm2_dir), "--env", "graded_env:GradedFactory", "--engine-dtype",
               dtype, "--steps", "2", "--groups", "1", "--group-size", "3", "--max-turns", "1", "--max-tokens", "8",
               "--lr", "1e-2", "--seed", "4", "--max-model-len", "512", "--kv-cache-gib", "1",
               "--checkpoint-every", "1", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    assert read_manifest(out).engine["dtype"] == str(torch_dtype).removeprefix("torch.")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2] and all(m["grad_norm"] > 0 for m in metrics)
    if dtype == "bf16":  # μ from bfloat16 arithmetic, π_old from float32: apart by rounding, not by weights
        assert all(1e-5 < m["mismatch_mean_abs"] < BF16_AGREEMENT for m in metrics), metrics
    base, trained = load_model(tiny_smollm2_dir), load_model(tiny_smollm2_dir)
    load_checkpoint(out / "checkpoints" / "step-000001", trained, None)
    base, trained = base.to(torch_dtype).eval(), trained.to(torch_dtype).eval()
    near, moved = 0.0, 0.0
    for rollout in (r for r in read_run(out).rollouts if r.info["step"] == 2):
        tokens = rollout.tokens
        at = np.flatnonzero(tokens.source == Source.MODEL)
        assert set(tokens.policy_version[at].tolist()) == {1}
        with torch.no_grad():
            want = reference_logprobs(trained, tokens.token_id, at).float().numpy()
            before = reference_logprobs(base, tokens.token_id, at).float().numpy()
        near = max(near, float(np.abs(want - tokens.logprob[at]).max()))
        moved = max(moved, float(np.abs(before - tokens.logprob[at]).max()))
    print(f"step 2's μ against step 1's checkpoint in {dtype}: max |Δ| {near:.4f}; against the base: {moved:.4f}")
    assert near < BF16_AGREEMENT and moved > 5 * BF16_AGREEMENT, (near, moved)
