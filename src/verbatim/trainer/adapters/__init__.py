"""The trainer's model adapters: one module per model family, and the choice of path for a model.

A family module maps the ``config.model_type`` values it covers to its PrefixFlow adapter (a
:class:`~verbatim.trainer.causal_lm.PrefixCausalLM` that can keep and read a prefix's keys/values).
:func:`trainer_lm` picks a model's path: PrefixFlow through its family's adapter, or the plain path
(:class:`~verbatim.trainer.causal_lm.PlainCausalLM`, whole sequences through ``model(ids).logits``)
that every causal LM takes. An adapter is registered once its exactness test passes: logprobs and
every parameter's gradient against the plain forward on a small random model of the family
(``tests/test_adapters.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer.adapters import gemma, llama, mistral, phi3, qwen
from verbatim.trainer.causal_lm import PlainCausalLM, PrefixCausalLM, model_type

ADAPTERS: dict[str, Callable[..., PrefixCausalLM]] = {
    **llama.ADAPTERS, **qwen.ADAPTERS, **mistral.ADAPTERS, **phi3.ADAPTERS, **gemma.ADAPTERS,
}
"""``config.model_type`` -> PrefixFlow adapter."""

TrainerPath = Literal["prefixflow", "plain"]


def prefix_lm(model: nn.Module, temperature: float = 1.0, checkpoint_layers: bool = False) -> PrefixCausalLM:
    """The PrefixFlow adapter of a Hugging Face causal LM, by its ``config.model_type``; ``checkpoint_layers``
    recomputes each decoder layer in the backward (:mod:`.layer_checkpoint`)."""
    kind = model_type(model)
    if kind not in ADAPTERS:
        raise TrainerError(f"PrefixFlow has no adapter for model type {kind!r} (supported: "
                         f"{', '.join(sorted(ADAPTERS))})",
                         hint="drop --prefixflow: without an adapter a model trains through the plain forward")
    return ADAPTERS[kind](model, temperature=temperature, checkpoint_layers=checkpoint_layers)


def trainer_lm(model: nn.Module, prefixflow: bool | None = None, temperature: float = 1.0,
               checkpoint_layers: bool = False) -> tuple[PrefixCausalLM, TrainerPath]:
    """The model's adapter and its path: ``prefixflow`` True requires an adapter, False takes the plain path,
    None (auto) takes PrefixFlow where the family has an adapter. ``checkpoint_layers`` applies to the
    PrefixFlow adapters (the plain path runs the model's own forward as it is)."""
    if prefixflow is False or (prefixflow is None and model_type(model) not in ADAPTERS):
        return PlainCausalLM(model, temperature=temperature), "plain"
    return prefix_lm(model, temperature, checkpoint_layers), "prefixflow"
