"""Importance-ratio correction between the sampler (behaviour policy μ) and the trainer (π).

Everything here is a pure torch function over padded batches of shape (B, T):

* ``logp_pi``: the trainer's log-probabilities of the sampled tokens (may carry grad);
* ``logp_mu``: the sampler's log-probabilities from the trace (NaN where not sampled);
* ``loss_mask``: True on model tokens (the tokens that are trained);
* ``versions``: the policy version that sampled each token (-1 where not sampled).

The per-token ratio is r = π/μ = exp(log π − log μ). The modes, all optional and combinable,
except token and sequence TIS, which are alternatives (see :class:`CorrectionConfig` for the defaults):

* token TIS: weight_t = min(r_t, C);
* token masking: drop tokens whose r_t lies outside [low, high] (IcePop-style band);
* sequence TIS: weight of every token of a sequence = min(R, C_seq), with R the product
  or the geometric mean of r over the sequence's model tokens;
* sequence masking: drop whole sequences whose geometric-mean ratio lies outside [low, high];
* version-lag masking: drop tokens sampled more than K versions behind the trainer.

Weights and masks are detached: a loss built from them (:func:`policy_gradient_loss`)
sends gradient only through π.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from verbatim.errors import TrainerError
from verbatim.trainer.correction_metrics import CorrectionMetrics, hybrid_tokens, summarize
from verbatim.trainer.learner_config import CorrectionConfig

RULES = ("token_band", "sequence_band", "version_lag")
"""Names of the masking rules, in the order they are reported."""


@dataclass(frozen=True, eq=False)
class Correction:
    """The result of :func:`correct`: detached weights and masks of shape (B, T), and metrics."""

    weights: torch.Tensor
    """Per-token weight to multiply the loss with; 0 on dropped and non-model tokens."""
    keep: torch.Tensor
    """Model tokens that no rule dropped."""
    dropped: dict[str, torch.Tensor]
    """Per rule, the model tokens that rule drops (rules overlap)."""
    log_ratio: torch.Tensor
    """log π − log μ on model tokens, 0 elsewhere."""
    sequence_log_ratio: torch.Tensor
    """(B,) sum of the log ratios over each sequence's model tokens."""
    metrics: CorrectionMetrics


def correct(logp_pi: torch.Tensor, logp_mu: torch.Tensor, loss_mask: torch.Tensor,
            versions: torch.Tensor, trainer_version: int,
            config: CorrectionConfig | None = None) -> Correction:
    """Apply ``config``'s corrections to one padded batch (see the module docstring)."""
    config = config or CorrectionConfig()
    loss_mask = loss_mask.bool()
    _check_inputs(logp_pi, logp_mu, loss_mask, versions, trainer_version)
    with torch.no_grad():
        log_ratio = token_log_ratio(logp_pi.detach(), logp_mu, loss_mask)
        lag = (trainer_version - versions.long()).masked_fill(~loss_mask, 0)
        dropped = {
            "token_band": token_band_drop(log_ratio, loss_mask, config.token_mask_band),
            "sequence_band": sequence_band_drop(log_ratio, loss_mask, config.sequence_mask_band),
            "version_lag": version_lag_drop(lag, loss_mask, config.max_version_lag),
        }
        keep = loss_mask.clone()
        for mask in dropped.values():
            keep &= ~mask
        weights = token_tis_weights(log_ratio, loss_mask, config.token_tis_cap)
        weights = weights * sequence_tis_weights(log_ratio, loss_mask, config.sequence_tis,
                                                 config.sequence_tis_cap)[:, None]
        weights = weights.masked_fill(~keep, 0.0)
        hybrid = hybrid_tokens(versions, loss_mask, config.hybrid_window)
        metrics = summarize(log_ratio, loss_mask, dropped, keep, lag, hybrid)
    return Correction(weights=weights, keep=keep, dropped=dropped, log_ratio=log_ratio,
                      sequence_log_ratio=log_ratio.sum(dim=1), metrics=metrics)


def _check_inputs(logp_pi: torch.Tensor, logp_mu: torch.Tensor, loss_mask: torch.Tensor,
                  versions: torch.Tensor, trainer_version: int) -> None:
    shapes = {t.shape for t in (logp_pi, logp_mu, loss_mask, versions)}
    if len(shapes) != 1 or logp_pi.dim() != 2:
        raise TrainerError(f"correction needs four (B, T) tensors of one shape, got {sorted(map(tuple, shapes))}")
    missing = int((loss_mask & torch.isnan(logp_mu)).sum())
    if missing:
        raise TrainerError(f"{missing} model tokens have no behaviour logprob (NaN)",
                           hint="the trace was written without sampler logprobs")
    if bool((loss_mask & ~torch.isfinite(logp_pi.detach())).any()):
        raise TrainerError("trainer logprobs must be finite on model tokens")
    unversioned = int((loss_mask & (versions < 0)).sum())
    if unversioned:
        raise TrainerError(f"{unversioned} model tokens have no policy version (-1)")
    ahead = int((loss_mask & (versions.long() > trainer_version)).sum())
    if ahead:
        raise TrainerError(f"{ahead} model tokens were sampled by a version newer than the "
                           f"trainer's ({trainer_version})")


def token_log_ratio(logp_pi: torch.Tensor, logp_mu: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log π − log μ on model tokens (+inf where μ = −inf), exactly 0 elsewhere; at least float32."""
    dtype = torch.promote_types(torch.promote_types(logp_pi.dtype, logp_mu.dtype), torch.float32)
    mu = logp_mu.to(dtype)
    diff = logp_pi.to(dtype) - torch.where(torch.isnan(mu), torch.zeros_like(mu), mu)
    return torch.where(loss_mask, diff, torch.zeros_like(diff))


def token_tis_weights(log_ratio: torch.Tensor, loss_mask: torch.Tensor, cap: float | None) -> torch.Tensor:
    """min(π/μ, cap) on model tokens (1 when off), 0 elsewhere."""
    ones = loss_mask.to(log_ratio.dtype)
    if cap is None:
        return ones
    return torch.clamp(torch.exp(log_ratio), max=cap) * ones


def token_band_drop(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                    band: tuple[float, float] | None) -> torch.Tensor:
    """Model tokens whose ratio lies outside ``band`` (none when off)."""
    if band is None:
        return torch.zeros_like(loss_mask)
    return loss_mask & _outside(log_ratio, band)


def sequence_log_ratios(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                        how: Literal["product", "geo_mean"]) -> torch.Tensor:
    """(B,) log of the product (sum) or geometric mean (mean) of ratios; 0 for empty sequences."""
    total = log_ratio.sum(dim=1)
    if how == "product":
        return total
    return total / loss_mask.sum(dim=1).clamp(min=1).to(total.dtype)


def sequence_tis_weights(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                         how: Literal["product", "geo_mean"] | None, cap: float) -> torch.Tensor:
    """(B,) min(R, cap) per sequence (1 when off)."""
    if how is None:
        return torch.ones(log_ratio.shape[0], dtype=log_ratio.dtype, device=log_ratio.device)
    return torch.clamp(torch.exp(sequence_log_ratios(log_ratio, loss_mask, how)), max=cap)


def sequence_band_drop(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                       band: tuple[float, float] | None) -> torch.Tensor:
    """All model tokens of sequences whose geometric-mean ratio lies outside ``band``."""
    if band is None:
        return torch.zeros_like(loss_mask)
    outside = _outside(sequence_log_ratios(log_ratio, loss_mask, "geo_mean"), band)
    return loss_mask & outside[:, None]


def version_lag_drop(lag: torch.Tensor, loss_mask: torch.Tensor, max_lag: int | None) -> torch.Tensor:
    """Model tokens sampled more than ``max_lag`` versions behind the trainer."""
    if max_lag is None:
        return torch.zeros_like(loss_mask)
    return loss_mask & (lag > max_lag)


def _outside(log_value: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    low, high = band
    log_low = float("-inf") if low == 0 else torch.log(torch.tensor(low, dtype=torch.float64)).item()
    log_high = torch.log(torch.tensor(high, dtype=torch.float64)).item()
    return (log_value < log_low) | (log_value > log_high)


def policy_gradient_loss(logp_pi: torch.Tensor, advantages: torch.Tensor, correction: Correction) -> torch.Tensor:
    """−Σ w·A·log π over kept tokens, divided by the number of kept tokens (at least 1).

    ``advantages`` is (B,) per sequence or (B, T) per token. Gradient flows only through
    ``logp_pi``: the weights are detached, and dropped tokens contribute exactly 0.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    coef = (correction.weights * advantages.to(correction.weights.dtype)).detach()
    kept = correction.keep.sum().clamp(min=1)
    safe_logp = torch.where(correction.keep, logp_pi, torch.zeros_like(logp_pi))
    return -(coef * safe_logp).sum() / kept
