"""``verbatim serve`` (one vLLM OpenAI server configured as verbatim needs it) and ``verbatim fleet up|down``
(several local replicas for ``--engine http --url … --route``).

Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

import typer

from verbatim.cli.console import console, err_console
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN
from verbatim.errors import InputError

DTYPE_HELP = ("The engine's number format: auto, bf16, fp16 or fp32 (auto: fp32 on a CPU, which keeps logprobs "
              "close to the trainer's; bf16 on a GPU).")
EAGER_HELP = "Run eagerly, without CUDA graphs (default: eager on a CPU, CUDA graphs on a GPU)."
LORA_HELP = ("Serve LoRA adapters up to this rank, loaded at run time (what 'verbatim train --lora-rank R "
             "--engine http' pushes); default: whole weights only.")


def device_settings(dtype: str, eager: bool | None) -> dict[str, object]:
    """The EngineConfig settings that follow the device this command's engine runs on: its format (refused in one
    line where the device cannot run it) and its eager mode."""
    from verbatim.engine.precision import engine_dtype, this_device

    device = this_device()
    return {"device": device.kind, "dtype": engine_dtype(dtype, device), "enforce_eager": eager}


RECORD_HELP = ("Record the experts a MoE's router chooses for every token, for runs that train with "
               "--routing-replay (runs eagerly, without CUDA graphs).")


fleet_app = typer.Typer(help="Start and stop local vllm serve replicas for --engine http --url … --route.",
                        no_args_is_help=True)


def serve_command(
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to listen on."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow binding to a non-loopback address."),
    kv_cache_gib: int = typer.Option(2, "--kv-cache-gib", min=1, help="KV cache size in GiB (CPU engine)."),
    max_model_len: int = typer.Option(DEFAULT_MAX_MODEL_LEN, "--max-model-len", min=64,
                                      help="Context length per request: prompt + sampled tokens."),
    dtype: str = typer.Option("auto", "--dtype", "--engine-dtype", help=DTYPE_HELP),
    eager: bool = typer.Option(None, "--eager/--no-eager", help=EAGER_HELP),
    lora_rank: int = typer.Option(None, "--lora-rank", min=1, max=512, help=LORA_HELP),
    record_routing: bool = typer.Option(False, "--record-routing", help=RECORD_HELP),
) -> None:
    """Run vLLM's OpenAI-compatible server with token-ID prompts, logprobs, cache salts and cached-token counts."""
    import os

    from verbatim.engine.expert_capture import check_moe
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import check_bind, server_command
    from verbatim.engine.start_log import note_start

    warning = check_bind(host, allow_remote)
    if warning:
        err_console.print(warning)
    config = EngineConfig(model=model, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, lora_rank=lora_rank,
                          record_experts=record_routing, **device_settings(dtype, eager))
    if record_routing:
        check_moe(config.model, "--record-routing")
    argv, env = server_command(config, host=host, port=port)
    err_console.print(f"serving {config.model} on http://{host}:{port} (Ctrl-C stops it)")
    note_start("served", config.model)
    os.execvpe(argv[0], argv, env)


@fleet_app.command("up")
def fleet_up(
    replicas: int = typer.Option(2, "--replicas", min=1, help="Number of vllm serve processes."),
    file: str = typer.Option("fleet.json", "--file", help="Where to write the fleet file (URLs, pids, logs)."),
    model: str = typer.Option("default", "--model", help="Bundled model name or Hugging Face folder."),
    kv_cache_gib: int = typer.Option(1, "--kv-cache-gib", min=1, help="KV cache space per replica, GiB."),
    kv_blocks: int = typer.Option(None, "--kv-blocks", min=2, help="Cap each replica's KV cache at this many blocks."),
    max_model_len: int = typer.Option(DEFAULT_MAX_MODEL_LEN, "--max-model-len", min=64,
                                      help="Context length per request: prompt + sampled tokens."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow binding to a non-loopback address."),
    gpu_memory: float = typer.Option(None, "--gpu-memory", help="Share of each of its GPUs a replica may take, "
                                     "in (0, 1] (vLLM's --gpu-memory-utilization; default vLLM's, 0.92)."),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", min=1,
                                        help="GPUs per replica (vLLM's --tensor-parallel-size)."),
    devices: str = typer.Option(None, "--devices", help="The GPUs to use, e.g. 0,1,2,3: replica i gets the i-th "
                                "--tensor-parallel of them (CUDA_VISIBLE_DEVICES); --replicas × --tensor-parallel "
                                "must be named. Default: several replicas get GPUs of their own, in order (or "
                                "share them, with --gpu-memory); one replica sees what this command sees."),
    dtype: str = typer.Option("auto", "--dtype", "--engine-dtype", help=DTYPE_HELP),
    eager: bool = typer.Option(None, "--eager/--no-eager", help=EAGER_HELP),
    lora_rank: int = typer.Option(None, "--lora-rank", min=1, max=512, help=LORA_HELP),
    record_routing: bool = typer.Option(False, "--record-routing", help=RECORD_HELP),
) -> None:
    """Start N local vLLM servers (CPUs split between them), wait until healthy, write their URLs."""
    from pathlib import Path

    from verbatim.engine.fleet import fleet_up as start_fleet
    from verbatim.engine.fleet import replica_gpus
    from verbatim.engine.runtime import EngineConfig
    from verbatim.engine.server import check_bind
    from verbatim.jobs.config import device_list

    warning = check_bind(host, allow_remote)
    if warning:
        err_console.print(warning)
    if gpu_memory is not None and not 0 < gpu_memory <= 1:
        raise InputError(f"--gpu-memory {gpu_memory:g} must be in (0, 1]")
    config = EngineConfig(model=model, kv_cache_gib=kv_cache_gib, kv_blocks=kv_blocks, max_model_len=max_model_len,
                          gpu_memory=gpu_memory, tensor_parallel=tensor_parallel, devices=device_list(devices),
                          lora_rank=lora_rank, record_experts=record_routing, **device_settings(dtype, eager))
    if record_routing:
        from verbatim.engine.expert_capture import check_moe

        check_moe(config.model, "--record-routing")
    visible = 0
    if config.devices is None and replicas > 1:  # replicas get GPUs of their own (a CPU machine shows none)
        from verbatim.trainer.reference import visible_gpus

        visible = len(visible_gpus())
    replica_gpus(config, replicas, visible)  # refused before the first line
    err_console.print(f"starting {replicas} replicas of {config.model}…")
    record = start_fleet(config, replicas, Path(file), host=host, visible_gpus=visible)
    for replica in record.replicas:
        gpus = f"  gpus {replica.gpus}" if replica.gpus else ""
        console.print(f"{replica.name}  {replica.url}  pid {replica.pid}  cpus {replica.cpus}{gpus}")
    flags = " ".join(f"--url {u}" for u in record.urls)
    console.print(f"wrote {file}; use: verbatim run --engine http {flags} --route sticky_least_loaded+group",
                  soft_wrap=True)


@fleet_app.command("down")
def fleet_down(
    file: str = typer.Option("fleet.json", "--file", help="The fleet file written by 'fleet up'."),
) -> None:
    """Stop every replica of a fleet (SIGTERM, then SIGKILL after 30 s) and remove the fleet file."""
    from pathlib import Path

    from verbatim.engine.fleet import fleet_down as stop_fleet

    stopped = stop_fleet(Path(file))
    console.print(f"stopped {len(stopped)} replicas" + (f" ({', '.join(stopped)})" if stopped else ""))
