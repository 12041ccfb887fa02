"""engine/lora_cpu.py: its LoRA ops compute what vLLM's CPU torch ops compute (to float rounding) for any batch of
adapters, the no-LoRA index (-1) and both weight layouts included, and :func:`install` puts them where vLLM's CPU
punica wrapper and its prefill ops look them up. The real engine runs them in tests/test_lora_engine.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from verbatim.engine import lora_cpu


def vllms_ops():
    """vLLM's own ops, from a fresh copy of their module (an installed engine module may have replaced them)."""
    import vllm.lora.ops.torch_ops.lora_ops as installed

    spec = importlib.util.spec_from_file_location("vllm_lora_ops_as_shipped", installed.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [  # (tokens, the adapter slot of each token)
    (1, [0]), (5, [2] * 5), (6, [0, 1, 0, 2, 1, 0]), (4, [-1, 0, -1, 3]), (7, [3, 3, 1, 1, 1, 0, -1])]


@pytest.mark.parametrize("tokens,slots", CASES)
@pytest.mark.parametrize("four_dims", [False, True])
def test_shrink_and_expands_equal_vllms(tokens, slots, four_dims):
    shipped = vllms_ops()
    gen = torch.Generator().manual_seed(tokens)
    indices = torch.tensor(slots)
    hidden, rank, out_size, count = 24, 8, 40, 4
    a = torch.randn(count, rank, hidden, generator=gen)
    b = torch.randn(count, out_size, rank, generator=gen)
    if four_dims:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    x = torch.randn(tokens, hidden, generator=gen)
    shrunk, want = torch.zeros(tokens, rank), torch.zeros(tokens, rank)
    lora_cpu.bgmv_shrink(x, a, shrunk, indices, 0.5)
    shipped.bgmv_shrink(x, a, want, indices, 0.5)
    torch.testing.assert_close(shrunk, want, rtol=1e-5, atol=1e-6)
    for add in (False, True):
        base = torch.randn(tokens, out_size + 3, generator=gen)  # the model's output padded wider than the adapter
        got, expected = base.clone(), base.clone()
        lora_cpu.bgmv_expand(shrunk, b, got, indices, add)
        shipped.bgmv_expand(shrunk, b, expected, indices, add)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        got, expected = base.clone(), base.clone()
        lora_cpu.bgmv_expand_slice(shrunk, b, got, indices, 2, out_size, add)
        shipped.bgmv_expand_slice(shrunk, b, expected, indices, 2, out_size, add)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_token_whose_adapter_is_another_gets_another_result():
    """The check can fail: the products follow each token's slot, not the batch's first."""
    a = torch.randn(2, 4, 6)
    x = torch.randn(2, 6)
    together = lora_cpu.products(x, a, torch.tensor([0, 1]), torch.float32)
    assert not torch.allclose(together[1], lora_cpu.products(x, a, torch.tensor([0, 0]), torch.float32)[1])


def test_install_puts_them_where_vllms_cpu_wrapper_and_prefill_ops_call_them():
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as wrapper

    lora_cpu.install()
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        assert getattr(wrapper, name) is getattr(lora_cpu, name) and getattr(ops, name) is getattr(lora_cpu, name)
    assert lora_cpu.install() == []  # once is enough
    calls = []
    original, ops.bgmv_shrink = ops.bgmv_shrink, lambda *a: calls.append(a)
    try:  # a prefill's sgmv op expands each sequence's slot to its tokens, then calls bgmv_shrink by name
        wrapper.sgmv_shrink(torch.zeros(3, 2), torch.zeros(1, 2, 2), torch.zeros(3, 2), None,
                            torch.tensor([3]), torch.tensor([0]), 1, 3, 3, 1.0)
    finally:
        ops.bgmv_shrink = original
    assert len(calls) == 1 and calls[0][3].tolist() == [0, 0, 0]
