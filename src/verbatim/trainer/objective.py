"""The policy loss of one training step: decoupled PPO over corrected, normalised tokens.

Three policies meet in a step:

* μ, the sampler's (behaviour) policy, whose log-probabilities the trace holds;
* π_old, the trainer's weights when the step starts (the *proximal* policy);
* π, the weights being trained, which move after each optimizer update of the step.

The objective is the decoupled PPO objective of AReaL (arXiv 2505.24298): the behaviour
correction weight, which :func:`verbatim.trainer.correction.correct` computes from π_old
against μ (truncated IS and masking), multiplies a PPO-clipped term in ρ = π/π_old:

    loss = −Σ_t coef_t · min(ρ_t·A, clip(ρ_t, 1 − ε, 1 + ε)·A)

over the kept tokens, with ``coef`` the correction weight divided by the update's normaliser
(:func:`loss_coefficients`). The clip only bites when a step makes more than one update:
with one update π_old = π, ρ = 1 and the gradient is the plain −Σ coef·A·∇log π.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from verbatim.errors import TrainerError

Normaliser = Literal["token", "sequence"]


class LossConfig(BaseModel):
    """How the step's loss is normalised and clipped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    normaliser: Normaliser = "token"
    """``"token"``: divide by the update's kept tokens; ``"sequence"``: average each row over its
    kept tokens, then over the update's rows that have any. Default ``"token"``."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip ε on π/π_old (bites only with more than one update per step). Default 0.2."""


def loss_coefficients(weights: torch.Tensor, keep: torch.Tensor, normaliser: Normaliser) -> torch.Tensor:
    """(B, T) detached per-token coefficients for the rows of ONE optimizer update; 0 off ``keep``.

    ``"token"``: weights / (kept tokens of these rows, at least 1);
    ``"sequence"``: weights / (kept tokens of the row × rows with at least one kept token).
    """
    if weights.shape != keep.shape or weights.dim() != 2:
        raise TrainerError(f"weights {tuple(weights.shape)} and keep {tuple(keep.shape)} must be one (B, T) shape")
    keep = keep.bool()
    weights = weights.detach()
    if normaliser == "token":
        denominator = keep.sum().clamp(min=1).to(weights.dtype)
    elif normaliser == "sequence":
        per_row = keep.sum(dim=1)
        rows = (per_row > 0).sum().clamp(min=1)
        denominator = (per_row.clamp(min=1) * rows).to(weights.dtype)[:, None]
    else:
        raise TrainerError(f"unknown normaliser {normaliser!r}", hint="use token or sequence")
    return torch.where(keep, weights / denominator, torch.zeros_like(weights))


def update_coefficients(weights: torch.Tensor, keep: torch.Tensor, updates: Sequence[Sequence[int]],
                        normaliser: Normaliser) -> torch.Tensor:
    """(B, T) coefficients of a step whose rows are split over several updates (disjoint rows).

    Each update's rows get :func:`loss_coefficients` over those rows alone; rows in no update get 0.
    """
    out = torch.zeros_like(weights.detach())
    seen: set[int] = set()
    for rows in updates:
        if seen & set(rows) or len(set(rows)) != len(rows):
            raise TrainerError(f"a row is in more than one update: {[list(u) for u in updates]}")
        seen |= set(rows)
        if rows:
            index = torch.tensor(list(rows), dtype=torch.long, device=weights.device)
            out[index] = loss_coefficients(weights[index], keep[index], normaliser)
    return out


def surrogate(logp_pi: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
              clip_eps: float) -> torch.Tensor:
    """(B, T) PPO-clipped term min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A), ρ = exp(log π − log π_old).

    ``advantages`` is (B,), one per row. The gradient reaches ``logp_pi`` only, and is 0 where
    the clip is active (ρ above 1 + ε with A > 0, below 1 − ε with A < 0).
    """
    ratio = torch.exp(logp_pi - logp_old.detach())
    advantage = advantages.detach()[:, None]
    return torch.minimum(ratio * advantage, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage)


def objective_loss(logp_pi: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   coef: torch.Tensor, keep: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Scalar −Σ over ``keep`` of coef · :func:`surrogate`: a sum of per-row terms.

    Positions off ``keep`` (dropped, prompt, padding) contribute exactly 0 to the value and the
    gradient, whatever ``logp_pi`` and ``logp_old`` hold there.
    """
    shapes = {tuple(t.shape) for t in (logp_pi, logp_old, coef, keep)}
    if len(shapes) != 1 or logp_pi.dim() != 2 or tuple(advantages.shape) != tuple(logp_pi.shape[:1]):
        raise TrainerError(f"objective needs (B, T) logprobs, coefficients and keep and (B,) advantages, "
                           f"got {sorted(shapes)} and {tuple(advantages.shape)}")
    keep = keep.bool()
    zeros = torch.zeros_like(logp_pi)
    pi = torch.where(keep, logp_pi, zeros)
    old = torch.where(keep, logp_old.detach().to(logp_pi.dtype), zeros)
    weight = torch.where(keep, coef.detach(), torch.zeros_like(coef))
    terms = weight * surrogate(pi, old, advantages, clip_eps)
    return -torch.where(keep, terms, torch.zeros_like(terms)).sum()
