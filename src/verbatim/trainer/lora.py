"""LoRA: a low-rank adapter trained in place of the whole model, in PEFT's own format.

:func:`attach` wraps a Hugging Face causal LM's linear layers with PEFT's LoRA layers, in place: the model
stays the same object with the same ``model.model`` / ``lm_head``, so the plain path and PrefixFlow's
adapters (which call the decoder's own modules) run the LoRA layers without knowing of them. The base
weights are frozen; the adapter's are the only parameters that train. Dropout on the adapter is refused
(:class:`~verbatim.trainer.learner_config.LoraConfig`): it would make π differ from μ on the trained tokens.

An adapter's weights travel under PEFT's names (``base_model.model.<module>.lora_A.weight``): what a PEFT
folder holds (:func:`write_adapter`: ``adapter_config.json`` and ``adapter_model.safetensors``, loadable
with ``PeftModel.from_pretrained(base, folder)``), what vLLM's LoRA loader reads, and what a checkpoint
restores (:func:`load_adapter`). :func:`merged_weights` folds the adapter into the base weights (what
``verbatim export-model --merge`` writes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from verbatim.durable import fsync_file
from verbatim.errors import CheckpointError, InputError
from verbatim.trainer.learner_config import LoraConfig

ADAPTER = "default"
"""The name PEFT gives the one adapter a model carries here."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""What PEFT's saved names put before a module's name in the model."""


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """Every linear layer's name inside the decoder layers, in the order they first appear: the attention and MLP
    projections (``q_proj`` … ``down_proj``; Phi-3's ``qkv_proj`` and ``gate_up_proj``). A mixture of experts'
    experts and router are not linear layers in transformers 5 (one tensor for all experts): its default is the
    attention's projections."""
    names: dict[str, None] = {}
    for layer in model.model.layers:
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                names[name.rsplit(".", 1)[-1]] = None
    return tuple(names)


def check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Refuse a target that names no linear layer of the model's decoder (one line, the names it has)."""
    known = default_targets(model)
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise InputError(f"--lora-targets {','.join(unknown)}: no linear layer of the model's decoder has that name "
                         f"(it has {','.join(known)})")


def peft_config(model: nn.Module, config: LoraConfig, base: str | None = None) -> Any:
    """PEFT's ``LoraConfig`` for ``config`` on ``model`` (``base``: the base model's folder, recorded in it)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = config.targets or default_targets(model)
    check_targets(model, targets)
    return PeftLoraConfig(r=int(config.rank or 0), lora_alpha=config.scale_alpha, lora_dropout=0.0,
                          target_modules=list(targets), bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base)


def attach(model: nn.Module, config: LoraConfig, base: str | None = None, seed: int = 0) -> nn.Module:
    """``model`` with a fresh adapter (:func:`init_adapter` from ``seed``; B = 0: the same function as the base) on
    its targets, base weights frozen; the same object, changed in place. A model on the meta device (a team's,
    before it is sharded and filled) gets its adapter's values from :func:`init_adapter` once it has memory."""
    from peft import inject_adapter_in_model

    if config.rank is None:
        raise InputError("a LoRA adapter needs a rank (--lora-rank R)")
    settings = peft_config(model, config, base)
    model.requires_grad_(False)
    inject_adapter_in_model(settings, model, adapter_name=ADAPTER)
    model.peft_config = {ADAPTER: settings}
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    if not any(p.is_meta for p in model.parameters()):
        init_adapter(model, seed)
    return model


def init_adapter(model: nn.Module, seed: int) -> None:
    """A fresh adapter's values, the same in one process and on every rank of a team (each rank its shard): each
    A drawn as PEFT draws it (Kaiming-uniform, a = √5) from one generator seeded with ``seed``, in the model's
    order, each B zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter_name(name):
                continue
            value = torch.zeros(param.shape, dtype=param.dtype)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
            param.copy_(_placed(value, param))


def base_name(name: str) -> str:
    """The base model's own name of a parameter of ``model`` with an adapter (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``): where its weight files hold it."""
    return name.replace(".base_layer.", ".")


def has_adapter(model: nn.Module) -> bool:
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def adapter_settings(model: nn.Module) -> Any:
    return model.peft_config[ADAPTER]


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (``base_model.model.…lora_A.weight``), in model order."""
    return {saved_name(name): param.detach() for name, param in model.named_parameters() if is_adapter_name(name)}


def is_adapter_name(name: str) -> bool:
    """Whether a parameter of the model (its own name) is the adapter's."""
    return f".{ADAPTER}." in name and (".lora_A." in name or ".lora_B." in name)


def saved_name(name: str) -> str:
    """The model's ``x.lora_A.default.weight`` -> PEFT's saved ``base_model.model.x.lora_A.weight``."""
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def write_adapter(folder: Path, model: nn.Module | None = None, *, weights: Mapping[str, torch.Tensor] | None = None,
                  settings: Any = None) -> Path:
    """A PEFT folder in ``folder``: ``adapter_config.json`` and ``adapter_model.safetensors`` (fsynced) of
    ``model``'s adapter, or of ``weights`` under ``settings``."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = settings if settings is not None else adapter_settings(model)
    tensors = dict(weights) if weights is not None else adapter_weights(model)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    safetensors.torch.save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    fsync_file(folder / WEIGHTS_FILE)
    settings.save_pretrained(str(folder))
    fsync_file(folder / CONFIG_FILE)
    return folder


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file() and (Path(folder) / WEIGHTS_FILE).is_file()


def read_adapter_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / CONFIG_FILE} cannot be read: {exc}") from exc


def load_adapter(folder: Path, model: nn.Module) -> None:
    """The adapter saved in ``folder`` into ``model``'s (same targets and rank), every tensor, strictly."""
    saved = read_adapter_config(folder)
    settings = adapter_settings(model)
    for key, ours in (("r", settings.r), ("lora_alpha", settings.lora_alpha),
                      ("target_modules", sorted(settings.target_modules))):
        theirs = sorted(saved.get(key) or ()) if key == "target_modules" else saved.get(key)
        if theirs != ours:
            raise CheckpointError(f"the adapter in {folder} has {key} {theirs}, this run's has {ours}",
                                  hint="resume with the run's own --lora-* settings")
    tensors = safetensors.torch.load_file(str(Path(folder) / WEIGHTS_FILE))
    expected = adapter_weights(model)
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        raise CheckpointError(f"the adapter in {folder} lacks {', '.join(missing) or 'nothing'} or holds others")
    by_name = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = by_name[_parameter_name(name)]
            if param.shape != tensor.shape:
                raise CheckpointError(f"{name} is {tuple(tensor.shape)} in {folder}, {tuple(param.shape)} here")
            param.copy_(_placed(tensor.to(param.dtype), param))


def _placed(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (whole) as ``param`` holds it: its shard where the parameter is sharded (FSDP2's DTensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
    return tensor.to(param.device)


def _parameter_name(saved: str) -> str:  # the inverse of saved_name
    """``base_model.model.x.lora_A.weight`` -> the model's own ``x.lora_A.default.weight``."""
    name = saved.removeprefix(PREFIX)
    head, _, leaf = name.rpartition(".")
    return f"{head}.{ADAPTER}.{leaf}"


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with the adapter folded in (W + scale·B·A), under the base model's own names; the
    model is left as it was."""
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight.detach()
                merged[f"{name}.weight"] = weight + module.get_delta_weight(ADAPTER).to(weight.dtype)
        for name, tensor in model.state_dict().items():
            if not is_adapter_name(name):
                merged.setdefault(base_name(name), tensor.detach())
    return merged


def settings_of(folder: Path) -> LoraConfig:
    """The :class:`LoraConfig` a PEFT folder's adapter was built with (its rank, alpha and targets)."""
    saved = read_adapter_config(folder)
    try:
        return LoraConfig(rank=int(saved["r"]), alpha=float(saved["lora_alpha"]),
                          targets=tuple(sorted(saved["target_modules"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / CONFIG_FILE} is not a LoRA adapter's config: {exc}") from exc


def merged_model(folder: Path, base: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``base`` with the PEFT adapter in ``folder`` folded in, under the base model's names."""
    model = attach(base, settings_of(folder))
    load_adapter(folder, model)
    return merged_weights(model)
