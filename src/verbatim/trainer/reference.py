"""The trainer's reference computation of log π: the plain Hugging Face forward, nothing else.

Every place that needs the trainer's log-probabilities of given tokens (the mismatch report,
the benchmarks' trainer views, the engine's logprob-agreement check, PrefixFlow's exactness
tests) takes them from here:

* :func:`load_model`: a Hugging Face model folder -> the causal LM in float32, eval mode;
  a folder that is not one is a one-line :class:`~verbatim.errors.UnknownModelError`;
* :func:`reference_logprobs`: log π(token_t | tokens_<t) of one token sequence, from
  ``model(ids).logits`` (log-softmax, then the next token's entry), every t or chosen ones;
* :func:`reference_backward`: full-sequence training of a PrefixFlow group through that
  same plain forward, one sequence at a time.

This path deliberately shares no code with :mod:`verbatim.trainer.causal_lm` (hidden states,
keys/values, ``sequence_logprobs``), so that it can check PrefixFlow rather than repeat it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from verbatim.errors import InputError, TrainerError, UnknownModelError
from verbatim.trainer.prefixflow import LossFn, PrefixGroup


def load_model(model_dir: str | Path) -> nn.Module:
    """A Hugging Face causal-LM folder as a float32 model in eval mode; a PEFT folder (a LoRA run's checkpoint) as
    the base model it names with its adapter attached (:mod:`verbatim.trainer.lora`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from verbatim.trainer import lora

    hf_logging.disable_progress_bar()  # one local folder: a progress bar is noise on the terminal
    path = Path(model_dir)
    if lora.is_adapter_folder(path) and not (path / "config.json").is_file():
        return _with_adapter(path)
    if not (path / "config.json").is_file():
        raise UnknownModelError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UnknownModelError(f"{path} cannot be loaded as a causal language model: {reason}") from exc
    return model.eval()


def _with_adapter(folder: Path) -> nn.Module:
    """The base model a PEFT folder names, with the folder's adapter, in eval mode."""
    from verbatim.trainer import lora

    base = lora.read_adapter_config(folder).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise UnknownModelError(f"the adapter in {folder} names base model {base!r}, which is not a model folder here")
    model = lora.attach(load_model(base), lora.settings_of(folder))
    lora.load_adapter(folder, model)
    return model.eval()


def trainer_device(text: str) -> str:
    """``--trainer-device`` checked against what torch sees here: ``cpu`` or an existing CUDA device."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise InputError(f"--trainer-device {text!r} is not a device", hint="cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise InputError(f"--trainer-device {text!r}: the trainer runs on cpu or cuda", hint="cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InputError(f"--trainer-device {text}: torch sees no CUDA device here (torch {torch.__version__})",
                         hint="use --trainer-device cpu, or install a CUDA build of torch")
    if device.index is not None and device.index >= count:
        raise InputError(f"--trainer-device {text}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return str(device)


def visible_gpus() -> list[int]:
    """The memory (bytes) of each CUDA device torch sees here, in index order; empty without one."""
    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]


def reference_logprobs(model: nn.Module, token_ids: Any,
                       positions: torch.Tensor | Sequence[int] | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log π(token_t | tokens_<t) of the sequence ``token_ids`` (T tokens), from ``model(ids).logits``
    divided by ``temperature`` (the distribution a token sampled at that temperature was drawn from).

    ``positions``: the t to return, each in 1..T−1, in the given order. Without them every t
    is returned, as a (T,) tensor whose entry 0 is NaN (nothing comes before the first token).
    The values are float32 (float64 for a float64 model) and on the model's device; they carry
    autograd unless the caller runs under ``torch.no_grad()``.
    """
    device = next(model.parameters()).device
    ids = _as_ids(token_ids, device)
    length = int(ids.numel())
    if positions is None:
        wanted = torch.arange(1, length, device=device)
    else:
        wanted = torch.as_tensor(positions, dtype=torch.long, device=device).flatten()
        if wanted.numel() and (int(wanted.min()) < 1 or int(wanted.max()) >= length):
            raise TrainerError(f"positions must lie in 1..{length - 1} for a sequence of {length} tokens")
    logits = model(ids[None]).logits[0, wanted - 1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[wanted, None])[:, 0]
    if positions is not None:
        return picked
    return torch.cat([picked.new_full((1,), float("nan")), picked])


def reference_backward(model: nn.Module, group: PrefixGroup, loss_fn: LossFn, temperature: float = 1.0) -> float:
    """Full-sequence training of ``group`` through :func:`reference_logprobs`; returns the loss.

    Each sequence runs alone (batch 1, no padding); its loss-mask positions are scattered
    into a (1, P + S_i) row in full-sequence coordinates, as PrefixFlow's ``loss_fn`` expects.
    With a loss that is a sum of per-row terms, the parameters' ``.grad`` then holds the
    group's gradient, to compare with :func:`~verbatim.trainer.prefixflow.prefixflow_backward`'s.
    """
    total = 0.0
    for i in range(group.size):
        sequence = group.sequence(i)
        positions = torch.nonzero(group.loss_masks[i]).flatten()
        values = reference_logprobs(model, sequence, positions, temperature)
        row = torch.zeros(1, sequence.numel(), dtype=values.dtype, device=values.device)
        row = row.index_put((torch.zeros_like(positions), positions.to(values.device)), values)
        loss = loss_fn(row, torch.tensor([i]))
        if loss.requires_grad:
            loss.backward()
        total += float(loss.detach())
    return total


def _as_ids(token_ids: Any, device: torch.device) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.to(device=device, dtype=torch.long)
    else:
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(device)
    if ids.dim() != 1 or ids.numel() < 1:
        raise TrainerError(f"expected one non-empty token sequence, got shape {tuple(ids.shape)}")
    return ids
