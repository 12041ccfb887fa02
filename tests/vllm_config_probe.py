"""vLLM's own config for an ``EngineConfig``, built from the arguments ``InprocEngine`` passes (no engine starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verbatim.engine.runtime import EngineConfig


def vllm_config(config: EngineConfig, model_dir: Path) -> Any:
    from verbatim.engine.inproc import engine_args
    from verbatim.engine.runtime import configure_environment, import_vllm

    configure_environment(config)
    import_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_args(config, model_dir)).create_engine_config()
