"""Cascade attention (``verbatim.trainer.cascade``) against one plain attention over the concatenated keys.

Suffix queries attend to every prefix key and causally to their own suffix's: the reference is
``scaled_dot_product_attention`` over [prefix; suffix] keys (the prefix expanded to every row, repeated
to every query head) with that mask. Forward and every gradient (queries, suffix keys/values, prefix
keys/values) are compared, in float64 to rounding and in float32 to float32 rounding, with grouped-query
attention, both kernels, and right-padded suffixes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.trainer.cascade import attend, attend_backward, cascade_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def inputs(b, heads, kv, s, p, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)

    return leaf(b, heads, s, d), leaf(b, kv, s, d), leaf(b, kv, s, d), leaf(1, kv, p, d), leaf(1, kv, p, d)


def reference(q, k, v, pk, pv, scale):
    b, heads, s, _ = q.shape
    groups = heads // k.shape[1]
    keys = torch.cat([pk.expand(b, -1, -1, -1), k], dim=2).repeat_interleave(groups, dim=1)
    values = torch.cat([pv.expand(b, -1, -1, -1), v], dim=2).repeat_interleave(groups, dim=1)
    p = pk.shape[2]
    mask = torch.ones(s, p + s, dtype=torch.bool).tril(p)  # every prefix key, own keys up to the query
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def errors(b, heads, kv, s, p, d, dtype, kernel, seed=0) -> list[float]:
    tensors = inputs(b, heads, kv, s, p, d, dtype, seed)
    scale = d ** -0.5 * 1.3
    out = cascade_attention(*tensors, scale, kernel)
    want = reference(*tensors, scale)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    got_grads = torch.autograd.grad(out, tensors, grad)
    want_grads = torch.autograd.grad(want, tensors, grad)
    pairs = [(out, want), *zip(got_grads, want_grads)]
    return [float((g - w).detach().abs().max() / w.detach().abs().max()) for g, w in pairs]


@pytest.mark.parametrize("kernel", ["auto", "math"])
@pytest.mark.parametrize("kv", [1, 2, 6])
def test_float64_equals_one_attention_over_the_concatenated_keys(kernel, kv):
    assert max(errors(3, 6, kv, 5, 9, 8, torch.float64, kernel)) < 1e-12


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), kv=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 2, 3]),
       s=st.integers(1, 9), p=st.integers(1, 20), d=st.sampled_from([4, 8, 16]),
       kernel=st.sampled_from(["auto", "math"]), seed=st.integers(0, 1000))
def test_float32_equals_one_attention_over_the_concatenated_keys(b, kv, groups, s, p, d, kernel, seed):
    assert max(errors(b, kv * groups, kv, s, p, d, torch.float32, kernel, seed)) < 2e-5


def test_right_padding_never_reaches_a_real_position():
    """A row padded from 3 to 6 tokens: its 3 real outputs and every gradient from them equal the row alone."""
    q, k, v, pk, pv = inputs(2, 4, 2, 6, 7, 8, torch.float64)
    scale = 0.35
    weight = torch.zeros(2, 4, 6, 8, dtype=torch.float64)
    weight[0, :, :3] = torch.randn(4, 3, 8, dtype=torch.float64)  # row 0 has 3 real tokens, row 1 is all padding
    padded = cascade_attention(q, k, v, pk, pv, scale)
    grads = torch.autograd.grad((padded * weight).sum(), (q, k, v, pk, pv))
    alone = [t[:1, :, :3].detach().requires_grad_(True) for t in (q, k, v)]
    out = cascade_attention(*alone, pk, pv, scale)
    alone_grads = torch.autograd.grad((out * weight[:1, :, :3]).sum(), (*alone, pk, pv))
    torch.testing.assert_close(padded[:1, :, :3], out, rtol=0, atol=1e-13)
    for got, want in zip(grads[:3], alone_grads[:3]):
        torch.testing.assert_close(got[:1, :, :3], want, rtol=0, atol=1e-13)
        assert float(got[:1, :, 3:].abs().max()) == 0 and float(got[1:].abs().max()) == 0
    for got, want in zip(grads[3:], alone_grads[3:]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_the_kernels_agree_on_one_attention_and_its_backward():
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out, lse, _ = attend(q, k, v, causal, 0.4)
        out_m, lse_m, _ = attend(q, k, v, causal, 0.4, kernel="math")
        torch.testing.assert_close(out, out_m)
        torch.testing.assert_close(lse, lse_m)
        grad = torch.randn_like(out)
        for got, want in zip(attend_backward(grad, q, k, v, out, lse, causal, 0.4),
                             attend_backward(grad, q, k, v, out, lse, causal, 0.4, kernel="math")):
            torch.testing.assert_close(got, want)


def test_the_cuda_backward_is_given_what_its_own_forward_returned(monkeypatch):
    """No GPU here: stand-ins for PyTorch's CUDA flash ops, returning what the CUDA forward returns on the dense path
    (no cumulative lengths: None, which a defined tensor in their place would turn into the variable-length path),
    check that each backward gets its own forward's state, and the cascade's output and gradients equal the math
    kernel's (scripts/gpu_probe.py runs the real ops on a GPU)."""
    import verbatim.trainer.cascade as cascade

    forwards, backwards = [], []

    def forward(query, key, value, dropout, causal, debug, *, scale):  # noqa: ANN001, ANN202
        out, lse = cascade._math_attend(query, key, value, causal, scale)
        state = (None, None, query.shape[2], key.shape[2], torch.tensor([len(forwards)]), torch.tensor([0]))
        forwards.append(state)
        return out, lse, *state, torch.empty(0)

    def backward(grad, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, rng_state,  # noqa: ANN001
                 rng_offset, *, scale):  # noqa: ANN001, ANN202
        backwards.append((cum_q, cum_k, max_q, max_k, rng_state, rng_offset))
        return cascade._math_attend_backward(grad, query, key, value, out, lse, causal, scale)

    q, k, v, pk, pv = inputs(2, 4, 2, 5, 6, 8, torch.float64)
    weight = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    want = torch.autograd.grad((cascade_attention(q, k, v, pk, pv, 0.3, "math") * weight).sum(), (q, k, v, pk, pv))
    monkeypatch.setattr(cascade, "cuda_flash_ops", lambda: (forward, backward))
    monkeypatch.setattr(cascade, "_kernel", lambda query, kernel: "cuda")
    got = torch.autograd.grad((cascade_attention(q, k, v, pk, pv, 0.3) * weight).sum(), (q, k, v, pk, pv))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert len(forwards) == len(backwards) == 2  # the prefix part and the suffix part
    for state in backwards:
        assert any(all(x is y for x, y in zip(state, mine)) for mine in forwards), state


def test_shapes_that_do_not_fit_are_refused():
    q, k, v, pk, pv = inputs(2, 4, 2, 3, 5, 8, torch.float32)
    with pytest.raises(ValueError, match="one prefix copy"):
        cascade_attention(q, k, v, pk.expand(2, -1, -1, -1), pv.expand(2, -1, -1, -1), 0.3)


def test_the_explicit_softmax_in_query_chunks(monkeypatch):
    import verbatim.trainer.cascade as cascade

    monkeypatch.setattr(cascade, "MATH_CHUNK", 40)  # a few queries per chunk
    assert max(errors(2, 4, 2, 9, 11, 8, torch.float64, "math")) < 1e-12
