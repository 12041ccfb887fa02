"""A team's model loaded shard by shard: built on the meta device, each rank reading only its rows of each weight.

Every rank of a team would otherwise build the whole float32 model in host memory before FSDP shards it
(33 GB for an 8 B model, times the ranks of a node). :func:`empty_model` builds the model from its
``config.json`` with its parameters on the meta device (no memory; the buffers, such as rotary
frequencies, computed as usual); :class:`~.sharding.ShardedModel` shards it, gives each rank's shards
memory, and :func:`load_shards` fills them: each rank opens the folder's safetensors files and reads, for
every parameter, only the rows of its own shard (FSDP2 shards dimension 0), cast to float32. No rank ever
holds a whole weight it does not own, let alone the whole model.

A folder whose files do not name every parameter of the model (a checkpoint another tool renamed) is
refused here with the first missing name; the caller then loads it whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer import lora
from verbatim.trainer.weight_files import RowReader, weight_index


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; their buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # one already on it stays itself: a tied weight stays tied
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_model(model_dir: str | Path) -> nn.Module:
    """The causal LM of ``model_dir``'s ``config.json`` in float32, its parameters on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(model_dir))
    with _meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Each weight's name → the safetensors file holding it (one file, or an index of several)."""
    return weight_index(Path(model_dir))[0]


def missing_weights(model: nn.Module, files: dict[str, Path]) -> list[str]:
    """The model's parameters (each once: a tied one under its first name) that no file names; a LoRA adapter's
    are not the files' (:func:`~verbatim.trainer.lora.init_adapter` gives them their values)."""
    return [name for name, _ in _base_parameters(model) if lora.base_name(name) not in files]


def _base_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((name, p) for name, p in model.named_parameters() if not lora.is_adapter_name(name))


def load_shards(model: nn.Module, files: dict[str, Path]) -> int:
    """Fill this rank's shard of every parameter of the sharded ``model`` from ``files``, reading only its rows
    (:class:`~verbatim.trainer.weight_files.RowReader`: no file mapped); returns the bytes read."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    missing = missing_weights(model, files)
    if missing:
        raise TrainerError(f"the weight files name no {missing[0]} ({len(missing)} parameters missing)")
    reader = RowReader()
    read = 0
    for name, param in _base_parameters(model):
        local = param.to_local() if hasattr(param, "to_local") else param
        if hasattr(param, "device_mesh"):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        else:
            shape, offset = tuple(param.shape), (0,) * param.dim()
        if not shape[0]:
            continue
        rows = reader.rows(files[lora.base_name(name)], lora.base_name(name), offset[0], offset[0] + shape[0])
        with torch.no_grad():
            local.copy_(rows.reshape(local.shape).to(local.dtype))
        read += rows.numel() * rows.element_size()
    return read


def sharded_from(model_dir: str | Path, team: Any, dtype: str, device: str, model: nn.Module | None = None) -> Any:
    """The model of ``model_dir`` sharded over ``team``, each rank loading its own rows
    (:class:`~.sharding.ShardedModel`); None where the files do not name every parameter (load it whole).
    ``model``: its :func:`empty_model`, where the caller built it already."""
    from verbatim.trainer.distributed.sharding import ShardedModel

    files, model = weight_files(model_dir), model if model is not None else empty_model(model_dir)
    if missing_weights(model, files):
        return None
    return ShardedModel(model, team, dtype, device, files)
