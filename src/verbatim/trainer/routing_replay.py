"""Rollout Routing Replay (R3): the trainer's MoE layers use the experts the engine routed each token to.

A MoE layer's router picks each token's top-k experts from its logits; the engine and the trainer compute those
logits with different kernels, in different precisions, sometimes with different weights (a step under
``--max-lag``), and where the top-k flips, π moves away from μ for reasons that are no part of the policy's
change. Replaying the engine's choice (recorded per token by engine/expert_capture.py) removes that: each
token goes to the recorded experts, weighted by the trainer's own router over them (the softmax of its
logits, taken at the recorded experts and renormalised as the family does), so the router still learns.

:func:`replayed` patches a model's routers for one forward: ``experts`` is ``(rows, tokens, MoE layers, k)``,
aligned with the call's token ids; a token whose row holds :data:`~verbatim.datamodel.NO_EXPERT` keeps the
trainer's own choice (padding, and the tokens the engine never fed, which no loss token reads). While a
:class:`Flips` count is open, every replayed layer adds the token-layers where the trainer's own top-k would
have been another set of experts.

Families: Qwen3-MoE (``Qwen3MoeTopKRouter``: softmax, top-k, renormalised where ``norm_topk_prob``). Another
MoE family needs its router's replay here; :func:`routers` refuses a model whose MoE layers it does not know.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from verbatim.errors import InputError, TrainerError

if TYPE_CHECKING:  # pydantic's models: the GPU probe (scripts/gpu_probe.py) imports this module without them
    from verbatim.datamodel import TokenColumns

REPLAYABLE = ("Qwen3MoeTopKRouter",)
"""The router classes :func:`replayed` knows how to replay."""
_MOE_BLOCKS = ("SparseMoeBlock", "MoeBlock", "MoE")


@dataclass
class Flips:
    """Token-layers replayed, and those where the trainer's own router would have chosen other experts; with
    ``per_token``, each token's count of flipped layers (forwards of that many rows: batch 1)."""

    replayed: int = 0
    flipped: int = 0
    per_token: torch.Tensor | None = None

    @property
    def rate(self) -> float | None:
        return self.flipped / self.replayed if self.replayed else None


_counting: list[Flips] = []


@contextlib.contextmanager
def counting_flips(tokens: int | None = None) -> Iterator[Flips]:
    """Count the flips of every replayed forward inside the block (per token too, for forwards of ``tokens``
    rows)."""
    flips = Flips(per_token=None if tokens is None else torch.zeros(tokens, dtype=torch.long))
    _counting.append(flips)
    try:
        yield flips
    finally:
        _counting.remove(flips)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers, in layer order; refuses a MoE whose router this module cannot replay."""
    found = [m for m in model.modules() if type(m).__name__ in REPLAYABLE]
    if not found and any(type(m).__name__.endswith(_MOE_BLOCKS) for m in model.modules()):
        raise TrainerError(f"routing replay knows the routers {', '.join(REPLAYABLE)}; this model's MoE layers "
                           "have another", hint="train it without --routing-replay")
    return found


def check_replayable(model: nn.Module) -> None:
    """Refuse ``--routing-replay`` for a model whose MoE routers this module cannot replay (one line, before
    any engine starts)."""
    try:
        found = routers(model)
    except TrainerError as exc:
        raise InputError(f"--routing-replay: {exc.message}", hint=exc.hint) from None
    if not found:
        raise InputError("--routing-replay: the model has no MoE router to replay",
                         hint="routing is replayed for mixture-of-experts models only")


_active: list[tuple[Any, torch.Tensor]] = []
"""The replay in effect: each patched router and its forced experts (what a checkpointed layer's recomputation
restores: :func:`snapshot`)."""


@contextlib.contextmanager
def replayed(model: nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, the model's routers send each token to ``experts`` (see the module docstring);
    ``None``: the model routes as it would."""
    if experts is None:
        yield
        return
    gates = routers(model)
    if experts.dim() != 4 or experts.shape[2] != len(gates):
        raise TrainerError(f"routing to replay is {tuple(experts.shape)}; expected rows × tokens × {len(gates)} "
                           "MoE layers × k")
    flat = experts.reshape(-1, experts.shape[2], experts.shape[3]).long()
    with _installed([(gate, flat[:, layer].to(gate.weight.device)) for layer, gate in enumerate(gates)], True):
        yield


def snapshot() -> tuple[tuple[Any, torch.Tensor], ...]:
    """The replay in effect now, for a recomputation to run under again (:func:`restored`)."""
    return tuple(_active)


def restored(state: tuple[tuple[Any, torch.Tensor], ...]) -> contextlib.AbstractContextManager[None]:
    """The replay of :func:`snapshot` again (a checkpointed layer's recomputation), counting no flips twice."""
    return _installed(list(state), False)


@contextlib.contextmanager
def _installed(pairs: list[tuple[Any, torch.Tensor]], count: bool) -> Iterator[None]:
    before = [(gate, gate.__dict__.get("forward")) for gate, _ in pairs]
    for gate, forced in pairs:
        gate.forward = _replaying(gate, forced, count)
    _active.extend(pairs)
    try:
        yield
    finally:
        del _active[len(_active) - len(pairs):]
        for gate, forward in before:
            if forward is None:
                del gate.forward  # the class's own forward again
            else:
                gate.forward = forward


def _replaying(gate: Any, forced: torch.Tensor, count: bool) -> Any:
    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return replay_route(gate, hidden_states, forced, count)

    return forward


def replay_route(gate: Any, hidden_states: torch.Tensor, forced: torch.Tensor,
                 count: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE router's ``(logits, weights, experts)`` with ``forced`` (tokens × k) experts where a token has
    them all (≥ 0), its own top-k where not."""
    hidden = hidden_states.reshape(-1, gate.hidden_dim)
    if forced.shape[0] != hidden.shape[0]:
        raise TrainerError(f"routing to replay covers {forced.shape[0]} tokens; the layer runs {hidden.shape[0]}")
    logits = F.linear(hidden, gate.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    own = torch.topk(probs, gate.top_k, dim=-1).indices
    given = (forced >= 0).all(dim=-1)
    chosen = torch.where(given[:, None], forced, own)
    weights = probs.gather(-1, chosen)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if count and _counting:
        _count(own, forced, given)
    return logits, weights.to(logits.dtype), chosen


def _count(own: torch.Tensor, forced: torch.Tensor, given: torch.Tensor) -> None:
    """Add to every open count: token-layers replayed, and those whose own top-k is another set."""
    flipped = given & (own.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
    for flips in _counting:
        flips.replayed += int(given.sum())
        flips.flipped += int(flipped.sum())
        if flips.per_token is not None and flips.per_token.shape[0] == flipped.shape[0]:
            flips.per_token += flipped.cpu().long()


def padded_experts(rows: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Rows' experts (each ``tokens × layers × k``) right-padded with ``NO_EXPERT`` to ``width`` tokens:
    ``(rows, width, layers, k)``; ``None`` where no row has any."""
    shaped = next((r for r in rows if r is not None), None)
    if shaped is None:
        return None
    out = torch.full((len(rows), width, *shaped.shape[1:]), -1, dtype=torch.long, device=shaped.device)
    for i, row in enumerate(rows):
        if row is not None:
            out[i, :row.shape[0]] = row[:width]
    return out


def row_experts(columns: Sequence[TokenColumns], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each row's recorded experts to replay (``tokens × layers × k``, long, on ``device``). Refuses a row that
    lacks them for a token its loss reads: every token before its last model token (the hidden state of each
    predicts the next); the tokens after it, and its last, no loss token reads."""
    from verbatim.datamodel import Source

    rows = []
    for i, c in enumerate(columns):
        model = np.flatnonzero(c.source == Source.MODEL)
        needed = int(model[-1]) if len(model) else 0
        experts = c.routed_experts
        if experts is None:
            raise TrainerError(f"row {i} has no routed experts recorded, and --routing-replay replays them",
                               hint="play the rollouts with --record-routing, or train without --routing-replay")
        missing = np.flatnonzero((experts[:needed] < 0).any(axis=(1, 2)))
        if len(missing):
            raise TrainerError(f"row {i} has no routed experts for token {int(missing[0])} (of {needed} its loss "
                               "reads)", hint="train without --routing-replay, or drop the rollout")
        rows.append(torch.from_numpy(experts.astype(np.int64)).to(device))
    return tuple(rows)


def mean_gap(logp: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Σ |log π − log μ| over the masked tokens with a sampler logprob, and how many."""
    where = mask & torch.isfinite(logp_mu)
    return float((logp - logp_mu).abs()[where].sum(dtype=torch.float64)), int(where.sum())
