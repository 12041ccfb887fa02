"""The small model interface the trainer computes log π through, and the plain path every causal LM takes.

PrefixFlow needs three things from a causal language model:

* run the decoder over token ids whose positions start at ``start``, optionally reading
  per-layer keys/values of earlier tokens (``past``), and return the final hidden states
  (after the last norm) and the per-layer keys/values of these tokens plus the past ones;
* turn hidden states into log-probabilities of given target tokens;
* its parameters.

:class:`PrefixCausalLM` states that contract, log-probabilities at the sampling temperature
included (:func:`target_logprobs`). The PrefixFlow adapters, one module per model family, are
in :mod:`verbatim.trainer.adapters`; :class:`PlainCausalLM` is the path of any other causal LM:
whole sequences through the model's own forward, no keys/values kept.

A model in train mode with dropout is refused: the shared prefix runs once, so every
sequence of the group would see one dropout mask on it, which full-sequence training
(an independent mask per sequence) never does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from verbatim.errors import TrainerError

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each (batch, kv_heads, tokens, head_dim)."""


class PrefixCausalLM(Protocol):
    temperature: float
    """The T of log π = log_softmax(logits / T): the sampling temperature the traced μ describes."""

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False) -> tuple[torch.Tensor, KV | None]:
        """(b, n) ids at positions start..start+n-1 -> ((b, n, hidden), past + own KV if keep_kv)."""

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(n, hidden) states and (n,) target ids -> (n,) log-probabilities at :attr:`temperature`, at least
        float32."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) states -> (n, vocab) logits, before the temperature."""

    def parameters(self) -> Iterator[nn.Parameter]: ...


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each row's target, in at least float32: what vLLM's processed logprobs
    hold for a token sampled at temperature T (no top-p/top-k mask)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None].long()).squeeze(-1)


class PlainCausalLM:
    """Any Hugging Face causal LM through its own full forward: ``model(ids).logits``, whatever the family's
    architecture does after its decoder. The plain path (no PrefixFlow): its "hidden states" are the logits
    of every position, so a microbatch holds (rows × tokens × vocabulary) of them."""

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        self.model = model
        self.temperature = temperature

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False) -> tuple[torch.Tensor, KV | None]:
        if past is not None or keep_kv or start:
            raise TrainerError(f"model type {model_type(self.model)!r} has no PrefixFlow adapter: it trains "
                               "whole sequences only")
        if self.model.training:
            refuse_dropout(self.model)
        return self.model(input_ids=ids, use_cache=False).logits, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return target_logprobs(hidden, targets, self.temperature)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()


def model_type(model: nn.Module) -> str | None:
    """A Hugging Face model's ``config.model_type`` (None for a model without one)."""
    return getattr(getattr(model, "config", None), "model_type", None)


def dropout_settings(model: nn.Module) -> dict[str, float]:
    """Every dropout probability above 0: config entries (``*dropout*``, ``*pdrop*``) and ``nn.Dropout`` modules."""
    found: dict[str, float] = {}
    config = getattr(model, "config", None)
    pending = [("", config.to_dict())] if hasattr(config, "to_dict") else []
    while pending:
        prefix, entries = pending.pop()
        for key, value in entries.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                pending.append((name + ".", value))
            elif ("dropout" in str(key) or "pdrop" in str(key)) and _positive(value):
                found[name] = float(value)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found[name] = float(module.p)
    return found


def refuse_dropout(model: nn.Module) -> None:
    """A :class:`TrainerError` for a model that would apply dropout (train mode, a probability above 0)."""
    settings = dropout_settings(model)
    if settings:
        listed = ", ".join(f"{key}={value:g}" for key, value in sorted(settings.items()))
        raise TrainerError(f"PrefixFlow cannot train a model with dropout ({listed}): the shared prefix runs once, "
                           "so the whole group would share one dropout mask",
                           hint="set the dropout to 0 in the model config, or call model.eval()")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def sequence_logprobs(lm: PrefixCausalLM, hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                      targets: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A (b, T) tensor (at least float32) holding log π of ``targets`` at (rows, cols), 0 elsewhere.

    ``hidden`` is (n, hidden): the state that predicts each target (the previous position's).
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    values = lm.token_logprobs(hidden, targets) if hidden.shape[0] else hidden.new_zeros(0, dtype=dtype)
    out = torch.zeros(tuple(shape), dtype=values.dtype, device=hidden.device)
    return out.index_put((rows, cols), values)
