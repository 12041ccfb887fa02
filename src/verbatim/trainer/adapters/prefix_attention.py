"""The decoder's attention during PrefixFlow: registered with transformers' ``AttentionInterface``, set per call.

:func:`prefix_attention` switches a model's attention implementation to :data:`ATTENTION` for the
duration of one decoder call and tells it what to do there (an :class:`AttentionRun`):

* phase A (``capture``): plain causal attention over the prefix, and each layer's keys/values as the
  attention computes with them (after the rotary embedding and any q/k norm, in autocast's dtype where
  autocast is on, as ``scaled_dot_product_attention`` casts them) recorded by layer index;
* phase B (``prefix``): :func:`~verbatim.trainer.cascade.cascade_attention` of the suffix queries over
  that layer's prefix keys/values, one (1, kv_heads, P, d) copy for the whole microbatch, and the
  suffixes' own keys (causal).

No cache object is built, the prefix is never expanded to the microbatch nor repeated to the query
heads, and the decoder builds no mask (the implementation has no mask function: causality is the
kernels'). Without an active run (a recomputation outside any call, see :mod:`.layer_checkpoint`)
the function is plain causal attention.

Where this is exact (:func:`cascade_exact`): the attention a layer receives is plain scaled
softmax attention. Attention-logit soft-capping (Gemma 2) is not, and a sliding window is not once a
query can be a window or more behind a key: Gemma 2 and 3's sliding layers, Mistral, Phi-3 and Qwen2
with ``sliding_window`` set, whenever the sequence is longer than the window. Those calls take the
cache path of :mod:`.decoder` (the decoder's own attention and masks over a full ``DynamicCache``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer.cascade import cascade_attention
from verbatim.trainer.causal_lm import KV

ATTENTION = "verbatim_prefix"
"""The name :func:`prefix_attention_forward` is registered under in transformers' ``AttentionInterface``."""


@dataclass(frozen=True, eq=False)
class AttentionRun:
    """What the attention does during one decoder call."""

    prefix: KV | None = None
    """Phase B: per layer, the prefix keys/values (1, kv_heads, P, d) the suffix queries also attend to."""
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    """Phase A: filled with each layer's (keys, values), by layer index."""
    length: int = 0
    """Prefix plus query tokens: the longest distance a window would have to cover."""


_ACTIVE: dict[int, tuple[str | None, AttentionRun | None]] = {}
"""id(model config) -> (attention implementation, run) in effect for that model, while a call runs."""


def cascade_exact(config: Any, length: int) -> bool:
    """Whether :data:`ATTENTION` computes a model's attention exactly over sequences of ``length`` tokens."""
    if getattr(config, "attn_logit_softcapping", None):
        return False
    window = getattr(config, "sliding_window", None)
    return not window or length <= window


def snapshot(config: Any) -> tuple[str | None, AttentionRun | None]:
    """The attention implementation and run in effect for ``config`` now."""
    return _ACTIVE.get(id(config), (config._attn_implementation, None))


@contextlib.contextmanager
def attention_state(config: Any, state: tuple[str | None, AttentionRun | None]) -> Iterator[None]:
    """Put a :func:`snapshot` in effect for the block (a run is recorded under :data:`ATTENTION`)."""
    implementation, run = state
    key, before = id(config), (config._attn_implementation, _ACTIVE.get(id(config)))
    config._attn_implementation = implementation
    if run is None:
        _ACTIVE.pop(key, None)
    else:
        _ACTIVE[key] = state
    try:
        yield
    finally:
        config._attn_implementation = before[0]
        if before[1] is None:
            _ACTIVE.pop(key, None)
        else:
            _ACTIVE[key] = before[1]


def prefix_attention(model: nn.Module, run: AttentionRun) -> contextlib.AbstractContextManager[None]:
    """The decoder's attention is :data:`ATTENTION` doing ``run`` inside the block."""
    _register()
    return attention_state(model.config, (ATTENTION, run))


def without_capture(state: tuple[str | None, AttentionRun | None]) -> tuple[str | None, AttentionRun | None]:
    """The same attention, recording nothing: what a recomputation of the call runs."""
    implementation, run = state
    return implementation, (None if run is None else replace(run, capture=None))


def prefix_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: (b, heads, n, d) queries -> ((b, n, heads, d), no weights)."""
    run = _ACTIVE.get(id(module.config), (None, AttentionRun()))[1] or AttentionRun()
    _refuse_inexact(module, dropout, kwargs, run)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    query, key, value = _attention_dtype(query, key, value)
    if run.capture is not None:
        run.capture[module.layer_idx] = (key, value)
    if run.prefix is not None:
        prefix_key, prefix_value = run.prefix[module.layer_idx]
        out = cascade_attention(query, key, value, prefix_key.to(query.dtype), prefix_value.to(query.dtype), scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _attention_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the dtype scaled-dot-product attention computes in: autocast's where it is on (as
    ``scaled_dot_product_attention`` casts under autocast), else the query's."""
    device = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


def _refuse_inexact(module: nn.Module, dropout: float, kwargs: dict[str, Any], run: AttentionRun) -> None:
    window = kwargs.get("sliding_window")
    if kwargs.get("softcap") or dropout or (window and run.length > window):
        raise TrainerError(f"PrefixFlow's cascade attention cannot run layer {module.layer_idx} exactly "
                           f"(soft-cap {kwargs.get('softcap')}, dropout {dropout}, window {window} over "
                           f"{run.length} tokens)")


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, prefix_attention_forward)


def layer_count(model: nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def captured_kv(capture: dict[int, tuple[torch.Tensor, torch.Tensor]], layers: int) -> KV:
    """The recorded keys/values in layer order (every layer must have run)."""
    missing = [i for i in range(layers) if i not in capture]
    if missing:
        raise TrainerError(f"the decoder's attention recorded no keys/values for layers {missing}")
    return [capture[i] for i in range(layers)]
