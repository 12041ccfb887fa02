"""Activation checkpointing per decoder layer, for the adapters' decoder calls (``checkpoint_layers=True``).

Inside :func:`checkpointed_layers` each decoder layer of a Hugging Face model runs under
``torch.utils.checkpoint`` (``use_reentrant=False``): a layer keeps its input and nothing inside it,
and its forward runs again when the backward reaches it. The layers are switched through the
library's own ``GradientCheckpointingLayer`` attributes for the duration of the call only, so the
model's other users (the plain path, the reference) are untouched.

It composes with PrefixFlow's delayed prefix backward: phase A's layers are recomputed in phase C,
long after phase A's call returned, and phase B's during its microbatch's backward. Each layer's
recomputation runs under the attention implementation and :class:`~.prefix_attention.AttentionRun`
that were in effect when it first ran (the prefix keys/values it read) and under the same routing
replay (:mod:`~verbatim.trainer.routing_replay`: the same experts), with nothing recorded again, so
a recomputation is the same function of the same inputs and has no side effect.

A call through a ``DynamicCache`` (the cache path of :mod:`.decoder`) is not checkpointed: the cache
is written during the forward and a recomputation would write it again (transformers turns the
cache off under checkpointing for that reason).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from verbatim.trainer.adapters.prefix_attention import attention_state, snapshot, without_capture
from verbatim.trainer.routing_replay import restored as routing_restored
from verbatim.trainer.routing_replay import snapshot as routing_snapshot


@contextlib.contextmanager
def checkpointed_layers(decoder: nn.Module, config: Any) -> Iterator[None]:
    """Every ``GradientCheckpointingLayer`` of ``decoder`` checkpointed during the block (in train mode)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [(m, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func"))
             for m in layers]
    run_layer = functools.partial(_checkpoint_layer, config)
    for module in layers:
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = run_layer
    try:
        yield
    finally:
        for module, flag, func in saved:
            _restore(module, "gradient_checkpointing", flag)
            _restore(module, "_gradient_checkpointing_func", func)


def _checkpoint_layer(config: Any, function: Callable[..., Any], *args: Any) -> Any:
    state, routing = without_capture(snapshot(config)), routing_snapshot()

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        with attention_state(config, state), routing_restored(routing):
            yield

    def contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        return contextlib.nullcontext(), recomputing()

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts)


def _restore(module: nn.Module, name: str, value: Any) -> None:
    if value is None:
        module.__dict__.pop(name, None)
    else:
        setattr(module, name, value)
