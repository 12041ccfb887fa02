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

With ``kl_coef`` β > 0 each kept token also pays β · coef · k(log π, log π_ref), a penalty toward the
reference policy π_ref (the run's starting model), weighted like the surrogate: the correction weight is
the importance weight that makes a μ-sampled token estimate an expectation under π. Per token, with
d = log π_ref − log π (:func:`kl_penalty`):

* ``k3`` = e^d − d − 1 (GRPO's estimator; never negative). Its value estimates KL(π ‖ π_ref), but its
  gradient, (1 − e^d)·∇log π, is in expectation over π the gradient of the other direction,
  KL(π_ref ‖ π): a pull toward covering the reference's tokens.
* ``k2`` = d²/2. Its gradient, −d·∇log π, is in expectation the gradient of KL(π ‖ π_ref) itself (each
  token's own term; the effect on later tokens of the sequence is left out, as in k3).

Both are 0 with gradient 0 where π = π_ref, so a step from the reference's own weights is the step
without the penalty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verbatim.errors import TrainerError
from verbatim.trainer.modes import KlEstimator, Normaliser


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


def kl_penalty(logp_pi: torch.Tensor, logp_ref: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Each token's penalty toward π_ref (the module docstring): k3 = e^d − d − 1 or k2 = d²/2, with
    d = log π_ref − log π; the gradient reaches ``logp_pi`` only."""
    d = logp_ref.detach() - logp_pi
    if estimator == "k3":
        return torch.expm1(d) - d
    if estimator == "k2":
        return 0.5 * d * d
    raise TrainerError(f"unknown KL estimator {estimator!r}", hint="use k3 or k2")


def objective_loss(logp_pi: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   coef: torch.Tensor, keep: torch.Tensor, clip_eps: float, logp_ref: torch.Tensor | None = None,
                   kl_coef: float = 0.0, kl_estimator: KlEstimator = "k3") -> torch.Tensor:
    """Scalar −Σ over ``keep`` of coef · (:func:`surrogate` − ``kl_coef`` · :func:`kl_penalty` against
    ``logp_ref``): a sum of per-row terms.

    Positions off ``keep`` (dropped, prompt, padding) contribute exactly 0 to the value and the
    gradient, whatever ``logp_pi``, ``logp_old`` and ``logp_ref`` hold there.
    """
    if kl_coef > 0 and logp_ref is None:
        raise TrainerError("a KL penalty needs the reference policy's logprobs")
    shapes = {tuple(t.shape) for t in (logp_pi, logp_old, coef, keep, *(() if logp_ref is None else (logp_ref,)))}
    if len(shapes) != 1 or logp_pi.dim() != 2 or tuple(advantages.shape) != tuple(logp_pi.shape[:1]):
        raise TrainerError(f"objective needs (B, T) logprobs, coefficients and keep and (B,) advantages, "
                           f"got {sorted(shapes)} and {tuple(advantages.shape)}")
    keep = keep.bool()
    zeros = torch.zeros_like(logp_pi)
    pi = torch.where(keep, logp_pi, zeros)
    old = torch.where(keep, logp_old.detach().to(logp_pi.dtype), zeros)
    weight = torch.where(keep, coef.detach(), torch.zeros_like(coef))
    terms = surrogate(pi, old, advantages, clip_eps)
    if kl_coef > 0 and logp_ref is not None:
        ref = torch.where(keep, logp_ref.detach().to(logp_pi.dtype), zeros)
        terms = terms - kl_coef * kl_penalty(pi, ref, kl_estimator)
    terms = weight * terms
    return -torch.where(keep, terms, torch.zeros_like(terms)).sum()
