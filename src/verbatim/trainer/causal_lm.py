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

:class:`LearnerLM` is either path as the learner runs it: log π computed in chunks of rows
(:func:`chunked_target_logprobs`: at most ``rows × vocabulary`` logits exist at once, forward and
backward, each chunk's logits recomputed in the backward; π_old's pass also takes the policy's entropy
from those logits) and the forward in bfloat16 under autocast
when asked (fp32 master weights; the log-softmax always in float32).

A model in train mode with dropout is refused: the shared prefix runs once, so every
sequence of the group would see one dropout mask on it, which full-sequence training
(an independent mask per sequence) never does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from verbatim.errors import TrainerError
from verbatim.trainer.modes import Precision
from verbatim.trainer.routing_replay import replayed

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each (batch, kv_heads, tokens, head_dim); a past of batch 1 (a shared prefix) serves
every row of the call that reads it."""


class PrefixCausalLM(Protocol):
    temperature: float
    """The T of log π = log_softmax(logits / T): the sampling temperature the traced μ describes."""

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, KV | None]:
        """(b, n) ids at positions start..start+n-1 -> ((b, n, hidden), past + own KV if keep_kv); a MoE's
        routers send the tokens to ``experts`` (b, n, MoE layers, k) where given (Rollout Routing Replay:
        :mod:`~verbatim.trainer.routing_replay`)."""

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(n, hidden) states and (n,) target ids -> (n,) log-probabilities at :attr:`temperature`, at least
        float32."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) states -> (n, vocab) logits, before the temperature."""

    def parameters(self) -> Iterator[nn.Parameter]: ...


def _log_policy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each row, in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each row's target, in at least float32: what vLLM's processed logprobs
    hold for a token sampled at temperature T (no top-p/top-k mask)."""
    return _log_policy(logits, temperature).gather(-1, targets[:, None].long()).squeeze(-1)


def target_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_logprobs`, the same values, and the entropy in nats of softmax(logits / T) of each row
    (a token the policy cannot draw, probability 0, adds 0); without autograd.

    One rows × vocabulary tensor more than :func:`target_logprobs` holds (the probabilities): each row's
    Σ p·log p is a dot product, not an elementwise product summed."""
    with torch.no_grad():
        log_policy = _log_policy(logits, temperature)
        chosen = log_policy.gather(-1, targets[:, None].long()).squeeze(-1)
        log_policy.clamp_(min=torch.finfo(log_policy.dtype).min)  # -inf (p = 0): 0 · finite = 0, not NaN
        probs = log_policy.exp()
        entropy = -torch.bmm(probs[:, None, :], log_policy[:, :, None]).reshape(-1)
    return chosen, entropy


def chunk_rows(n: int, rows: int) -> int:
    """Rows per chunk of logits for ``n`` rows: ``rows``, or all of them at once when ``rows`` is 0 or not
    fewer than ``n`` (the one rule both :func:`chunked_target_logprobs` and π_old's pass split by)."""
    return rows if 0 < rows < n else max(n, 1)


def chunked_target_logprobs(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            targets: torch.Tensor, temperature: float, rows: int) -> torch.Tensor:
    """:func:`target_logprobs` of ``logits(hidden)``, ``rows`` rows at a time (0: all at once).

    ``rows`` or fewer rows are one chunk, computed directly: their logits are no more than a chunk's.

    With autograd on, each chunk runs under non-reentrant activation checkpointing: the forward keeps
    only the chunk's inputs, and the backward recomputes that chunk's logits, log-softmax and gradient
    before the next chunk's, so no more than ``rows × vocabulary`` logits (and their float32 copies)
    exist at any moment. The values are the unchunked ones row for row; the output layer's gradient is
    summed chunk by chunk (float rounding of the order of the unchunked sum's).
    """
    n = int(hidden.shape[0])
    if chunk_rows(n, rows) >= n:  # one chunk: checkpointing it would only run the output layer twice
        return target_logprobs(logits(hidden), targets, temperature)

    def chunk(states: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return target_logprobs(logits(states), ids, temperature)

    recompute = torch.is_grad_enabled()
    parts = []
    for start in range(0, n, rows):
        states, ids = hidden[start:start + rows], targets[start:start + rows]
        if recompute:
            parts.append(checkpoint(chunk, states, ids, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(chunk(states, ids))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class LearnerLM:
    """A model's path (its PrefixFlow adapter or :class:`PlainCausalLM`) as the learner runs it.

    * ``logprob_chunk`` rows of logits at a time (:func:`chunked_target_logprobs` over the path's own
      :meth:`~PrefixCausalLM.logits`, so a family's soft-cap or anything else after its output layer is
      chunked with it); 0 computes every row at once, as the path itself does. On the plain path the
      model's forward already returns the logits of every position (rows × tokens × vocabulary): only
      the float32 copy, the log-softmax and their gradients are chunked there.
    * ``dtype`` ``bf16``: the decoder and the output layer run under ``torch.autocast`` in bfloat16 over
      the float32 master weights (their gradients, and the optimizer's state, stay float32); the logits are
      cast to float32 before the log-softmax, so log π is float32 either way.

    Everything else (``model``, an adapter's own attributes) is the wrapped path's.
    """

    def __init__(self, lm: PrefixCausalLM, logprob_chunk: int = 0, dtype: Precision = "fp32") -> None:
        self.lm = lm
        self.logprob_chunk = logprob_chunk
        self.dtype = dtype

    @property
    def temperature(self) -> float:
        return self.lm.temperature

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, KV | None]:
        with self.compute():
            return self.lm.hidden_states(ids, start, past, keep_kv, experts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.compute():
            return self.lm.logits(hidden)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return chunked_target_logprobs(self.logits, hidden, targets, self.temperature, self.logprob_chunk)

    def token_logprobs_and_entropy(self, hidden: torch.Tensor,
                                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` without autograd (the same values, chunk for chunk) and the entropy of π at
        T before each target (:func:`target_logprobs_and_entropy`), ``logprob_chunk`` rows of logits at a time."""
        n = int(hidden.shape[0])
        rows = chunk_rows(n, self.logprob_chunk)
        with torch.no_grad():
            parts = [target_logprobs_and_entropy(self.logits(hidden[i:i + rows]), targets[i:i + rows],
                                                 self.temperature) for i in range(0, n, rows)]
        if not parts:
            empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
            return empty, empty.clone()
        return torch.cat([lp for lp, _ in parts]), torch.cat([h for _, h in parts])

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.lm.parameters()

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: bfloat16 autocast on the parameters' device, or nothing for fp32."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        device = next(iter(self.lm.parameters())).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    def __getattr__(self, name: str) -> Any:
        if name == "lm":  # not set yet (copy, pickle): never recurse
            raise AttributeError(name)
        return getattr(self.lm, name)


class PlainCausalLM:
    """Any Hugging Face causal LM through its own full forward: ``model(ids).logits``, whatever the family's
    architecture does after its decoder. The plain path (no PrefixFlow): its "hidden states" are the logits
    of every position, so a microbatch holds (rows × tokens × vocabulary) of them."""

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        self.model = model
        self.temperature = temperature

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, KV | None]:
        if past is not None or keep_kv or start:
            raise TrainerError(f"model type {model_type(self.model)!r} has no PrefixFlow adapter: it trains "
                               "whole sequences only")
        if self.model.training:
            refuse_dropout(self.model)
        with replayed(self.model, experts):
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
