"""Cascade attention: suffix queries over one shared prefix's keys/values and their own, without copying the prefix.

PrefixFlow's phase B runs b suffixes (right-padded to S tokens) that all continue one P-token
prefix. Each suffix query attends to every prefix key and, causally, to its own suffix's keys.
:func:`cascade_attention` computes that as two attentions merged exactly by log-sum-exp, as in
ring or cascade attention:

* **prefix part**: one attention over the prefix keys/values as they are, (1, kv_heads, P, d).
  The batch and the query heads of each key/value group are flattened into the query axis,
  (1, kv_heads, b·g·S, d) with g = heads / kv_heads, so grouped-query attention is kept and no
  row of the microbatch gets a copy of the prefix;
* **suffix part**: causal attention of each suffix over its own keys (these small ones are
  repeated to the query heads);
* **merge**: lse = logaddexp(lse₁, lse₂), out = e^(lse₁−lse)·out₁ + e^(lse₂−lse)·out₂.

The backward runs each part's attention backward with the merged output and the merged
log-sum-exp: softmax probabilities taken against the merged lse are the whole attention's, and
rowsum(dO ∘ O) is the whole attention's, so each part's dQ, dK, dV are exact. What is saved for
the backward is what one flash attention saves: the suffix's q, k, v, the merged output and lse,
and the prefix keys/values themselves (no copy). With right padding, a padded query sees earlier
real keys and the prefix, while no real query sees a padded key (causality): padding never
reaches a real position.

Kernels (:func:`attend`, :func:`attend_backward`): on the CPU the flash kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; on CUDA in float16 or
bfloat16 with a head size up to 256 the flash kernel ``aten._scaled_dot_product_flash_attention``
(not run by this project's tests: they have no GPU); anywhere else an explicit softmax in the
query dtype promoted to float32, over chunks of queries so its scores stay under :data:`MATH_CHUNK`
elements (``"math"``, also used by the tests as a second reference).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

Kernel = Literal["auto", "flash", "math"]


class Attended(NamedTuple):
    """One attention's output, its log-sum-exp, and what its kernel's backward needs from its forward."""

    out: torch.Tensor
    lse: torch.Tensor
    state: tuple = ()
    """CUDA flash: the cumulative sequence lengths (None: the dense path), the longest query and key lengths, and the
    RNG state and offset, exactly as the forward returned them. An empty tensor in place of a None would be a
    defined tensor, which selects the kernel's variable-length path. Other kernels keep nothing."""


def cascade_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_key: torch.Tensor,
                      prefix_value: torch.Tensor, scale: float, kernel: Kernel = "auto") -> torch.Tensor:
    """(b, heads, S, d) queries over (1, kv_heads, P, d) prefix and (b, kv_heads, S, d) suffix keys/values.

    Returns (b, heads, S, d): softmax(q·kᵀ·scale) over the prefix and the causal suffix, times the values.
    """
    if prefix_key.shape[0] != 1 or prefix_key.shape[1] != key.shape[1] or query.shape[1] % key.shape[1]:
        raise ValueError(f"cascade attention: queries {tuple(query.shape)}, keys {tuple(key.shape)}, prefix keys "
                         f"{tuple(prefix_key.shape)} (one prefix copy, kv heads dividing the query heads)")
    return _CascadeAttention.apply(query, key, value, prefix_key, prefix_value, scale, kernel)


class _CascadeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, prefix_key, prefix_value, scale, kernel):  # noqa: ANN001, ANN205
        groups = query.shape[1] // key.shape[1]
        flat = _flatten_groups(query, groups)
        prefix_out, prefix_lse, prefix_state = attend(flat, prefix_key, prefix_value, False, scale, kernel)
        own_out, own_lse, own_state = attend(query, _repeat(key, groups), _repeat(value, groups), True, scale,
                                             kernel)
        prefix_out = _unflatten_groups(prefix_out, query.shape)
        prefix_lse = _unflatten_groups(prefix_lse[..., None], (*query.shape[:3], 1))[..., 0]
        lse = torch.logaddexp(prefix_lse, own_lse)
        out = (prefix_out * torch.exp(prefix_lse - lse)[..., None]
               + own_out * torch.exp(own_lse - lse)[..., None]).to(query.dtype)
        ctx.save_for_backward(query, key, value, prefix_key, prefix_value, out, lse)
        ctx.scale, ctx.kernel, ctx.groups = scale, kernel, groups
        ctx.states = prefix_state, own_state
        return out

    @staticmethod
    def backward(ctx: Any, grad_out):  # noqa: ANN001, ANN205
        query, key, value, prefix_key, prefix_value, out, lse = ctx.saved_tensors
        scale, kernel, groups = ctx.scale, ctx.kernel, ctx.groups
        grad_out = grad_out.contiguous()
        flat_lse = _flatten_groups(lse[..., None], groups)[..., 0]
        dq_prefix, d_prefix_key, d_prefix_value = attend_backward(
            _flatten_groups(grad_out, groups), _flatten_groups(query, groups), prefix_key, prefix_value,
            _flatten_groups(out, groups), flat_lse, False, scale, kernel, ctx.states[0])
        dq_own, dk_own, dv_own = attend_backward(grad_out, query, _repeat(key, groups), _repeat(value, groups),
                                                 out, lse, True, scale, kernel, ctx.states[1])
        dq = dq_own + _unflatten_groups(dq_prefix, query.shape)
        return (dq, _sum_groups(dk_own, groups), _sum_groups(dv_own, groups), d_prefix_key, d_prefix_value,
                None, None)


def _flatten_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv·g, S, d) -> (1, kv, b·g·S, d): the batch and each kv group's query heads into the query axis."""
    b, heads, s, d = x.shape
    kv = heads // groups
    return x.reshape(b, kv, groups, s, d).transpose(0, 1).reshape(1, kv, b * groups * s, d)


def _unflatten_groups(x: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The inverse of :func:`_flatten_groups` for a (b, heads, S, d) ``shape``."""
    b, heads, s, d = shape
    kv = x.shape[1]
    return x.reshape(kv, b, heads // kv, s, d).transpose(0, 1).reshape(b, heads, s, d)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, s, d = x.shape
    return x if groups == 1 else x.reshape(b, heads // groups, groups, s, d).sum(dim=2)


# ---------------------------------------------------------------------------
# One attention with its log-sum-exp, and its backward given (out, lse)
# ---------------------------------------------------------------------------


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float,
           kernel: Kernel = "auto") -> Attended:
    """softmax(q·kᵀ·scale [causal, top-left]) · v for (B, H, L, d) tensors with equal heads -> (out, lse (B, H, L))."""
    chosen = _kernel(query, kernel)
    if chosen == "cpu":
        return Attended(*torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                                   scale=scale))
    if chosen == "cuda":
        forward, _ = cuda_flash_ops()
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, rng_offset, _ = forward(query, key, value, 0.0, causal,
                                                                               False, scale=scale)
        return Attended(out, lse, (cum_q, cum_k, max_q, max_k, rng_state, rng_offset))
    return Attended(*_math_attend(query, key, value, causal, scale))


def attend_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                    kernel: Kernel = "auto", state: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of :func:`attend` given the (possibly merged) output and log-sum-exp of the whole attention, and
    the ``state`` its forward returned (:class:`Attended`)."""
    chosen = _kernel(query, kernel)
    if chosen == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    if chosen == "cuda":
        _, backward = cuda_flash_ops()
        cum_q, cum_k, max_q, max_k, rng_state, rng_offset = state
        return backward(grad_out, query, key, value, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal,
                        rng_state, rng_offset, scale=scale)
    return _math_attend_backward(grad_out, query, key, value, out, lse, causal, scale)


def cuda_flash_ops() -> tuple[Any, Any]:
    """PyTorch's CUDA flash attention forward and backward (one place, so a test can stand in for them on a CPU)."""
    return (torch.ops.aten._scaled_dot_product_flash_attention,
            torch.ops.aten._scaled_dot_product_flash_attention_backward)


def _kernel(query: torch.Tensor, kernel: Kernel) -> str:
    if kernel == "math":
        return "math"
    if query.device.type == "cpu":
        return "cpu"
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return "cuda"
    if kernel == "flash":
        raise ValueError(f"no flash kernel for {query.dtype} on {query.device}")
    return "math"


def _scores(query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float, first: int = 0) -> torch.Tensor:
    """Scaled scores of queries ``first``, ``first`` + 1, … against every key (-inf above the diagonal if causal)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(first, first + scores.shape[-2], device=scores.device)[:, None]
        hidden = torch.arange(scores.shape[-1], device=scores.device)[None, :] > rows
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


MATH_CHUNK = 1 << 24
"""Score elements per query chunk of the explicit softmax (64 MiB in float32): its memory stays bounded."""


def _query_chunks(query: torch.Tensor, key: torch.Tensor) -> list[tuple[int, int]]:
    per_query = query.shape[0] * query.shape[1] * key.shape[2]
    step = max(1, MATH_CHUNK // max(per_query, 1))
    return [(i, min(i + step, query.shape[2])) for i in range(0, query.shape[2], step)]


def _math_attend(query, key, value, causal, scale):  # noqa: ANN001, ANN202
    outs, lses = [], []
    for lo, hi in _query_chunks(query, key):
        scores = _scores(query[:, :, lo:hi], key, causal, scale, lo)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse[..., None]), value.to(scores.dtype)).to(query.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _math_attend_backward(grad_out, query, key, value, out, lse, causal, scale):  # noqa: ANN001, ANN202
    dtype = torch.promote_types(query.dtype, torch.float32)
    d_query, d_key = [], torch.zeros(key.shape, dtype=dtype, device=key.device)
    d_value = torch.zeros(value.shape, dtype=dtype, device=value.device)
    keys, values = key.to(dtype), value.to(dtype)
    for lo, hi in _query_chunks(query, key):
        probs = torch.exp(_scores(query[:, :, lo:hi], key, causal, scale, lo) - lse[:, :, lo:hi, None])
        grad, o = grad_out[:, :, lo:hi].to(dtype), out[:, :, lo:hi].to(dtype)
        d_value += torch.matmul(probs.transpose(-1, -2), grad)
        d_probs = torch.matmul(grad, values.transpose(-1, -2))
        d_scores = probs * (d_probs - (grad * o).sum(-1, keepdim=True)) * scale
        d_query.append(torch.matmul(d_scores, keys).to(query.dtype))
        d_key += torch.matmul(d_scores.transpose(-1, -2), query[:, :, lo:hi].to(dtype))
    return torch.cat(d_query, dim=2), d_key.to(key.dtype), d_value.to(value.dtype)
