"""Metrics of an importance-ratio correction, over model tokens only.

For a set of model tokens, :class:`RatioStats` holds: the token count, the fraction
dropped by each rule (and by any rule), quantiles of the ratio π/μ, the mean
|log π − log μ|, and the k1 and k3 estimates of KL(μ ‖ π) from tokens sampled by μ
(with r = π/μ: k1 = mean(−log r), k3 = mean(r − 1 − log r)). KL estimates use the
tokens whose log ratio is finite; ``nonfinite`` counts the others (μ = −inf).

:class:`CorrectionMetrics` has these stats for all tokens, per version lag (trainer
version − sampling version), and for the *hybrid* tokens (sampled within the first N
model tokens after the sampler's weights changed mid-sequence, see :func:`hybrid_tokens`)
apart from the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
"""Ratio quantiles reported (nearest rank), keyed 'p01', 'p10', 'p50', 'p90', 'p99'."""


@dataclass(frozen=True)
class RatioStats:
    tokens: int
    dropped: dict[str, float]
    """Fraction of these tokens dropped per rule, plus 'any'. 0.0 when there are no tokens."""
    ratio_quantiles: dict[str, float]
    """Empty when there are no tokens."""
    mean_abs_log_ratio: float | None
    k1: float | None
    k3: float | None
    nonfinite: int


@dataclass(frozen=True)
class CorrectionMetrics:
    all: RatioStats
    by_lag: dict[int, RatioStats] = field(default_factory=dict)
    hybrid: RatioStats | None = None
    non_hybrid: RatioStats | None = None

    def as_dict(self) -> dict:
        """Plain JSON-ready data (lag keys become strings)."""
        data = asdict(self)
        data["by_lag"] = {str(lag): stats for lag, stats in data["by_lag"].items()}
        return data


def hybrid_tokens(versions: torch.Tensor, loss_mask: torch.Tensor, window: int) -> torch.Tensor:
    """Model tokens sampled within ``window`` model tokens after a version change in their sequence.

    A version change is a model token whose version differs from the previous model
    token of the same sequence; that token is the first hybrid one. The first model
    token of a sequence is never a change.
    """
    hybrid = torch.zeros_like(loss_mask, dtype=torch.bool)
    for row in range(loss_mask.shape[0]):
        positions = torch.nonzero(loss_mask[row]).flatten()
        if positions.numel() < 2:
            continue
        v = versions[row, positions].long()
        change = torch.zeros(positions.numel(), dtype=torch.bool, device=v.device)
        change[1:] = v[1:] != v[:-1]
        ordinal = torch.arange(positions.numel(), device=v.device)
        last_change = torch.cummax(torch.where(change, ordinal, torch.full_like(ordinal, -1)), dim=0).values
        inside = (last_change >= 0) & (ordinal - last_change < window)
        hybrid[row, positions[inside]] = True
    return hybrid


def summarize(log_ratio: torch.Tensor, loss_mask: torch.Tensor, dropped: dict[str, torch.Tensor],
              keep: torch.Tensor, lag: torch.Tensor, hybrid: torch.Tensor) -> CorrectionMetrics:
    """Stats for all model tokens, per version lag, and for hybrid versus other tokens."""
    by_lag = {
        int(value): ratio_stats(log_ratio, loss_mask & (lag == value), dropped, keep)
        for value in torch.unique(lag[loss_mask]).tolist()
    }
    return CorrectionMetrics(
        all=ratio_stats(log_ratio, loss_mask, dropped, keep),
        by_lag=by_lag,
        hybrid=ratio_stats(log_ratio, loss_mask & hybrid, dropped, keep),
        non_hybrid=ratio_stats(log_ratio, loss_mask & ~hybrid, dropped, keep),
    )


def ratio_stats(log_ratio: torch.Tensor, select: torch.Tensor, dropped: dict[str, torch.Tensor],
                keep: torch.Tensor) -> RatioStats:
    """Stats over the tokens in ``select``."""
    n = int(select.sum())
    fractions = {rule: _fraction(mask, select, n) for rule, mask in dropped.items()}
    fractions["any"] = _fraction(~keep, select, n)
    if n == 0:
        return RatioStats(tokens=0, dropped=fractions, ratio_quantiles={}, mean_abs_log_ratio=None,
                          k1=None, k3=None, nonfinite=0)
    lr = log_ratio[select].double()
    finite = lr[torch.isfinite(lr)]
    return RatioStats(
        tokens=n,
        dropped=fractions,
        ratio_quantiles=ratio_quantiles(lr),
        mean_abs_log_ratio=float(lr.abs().mean()),
        k1=float((-finite).mean()) if finite.numel() else None,
        k3=float((torch.expm1(finite) - finite).mean()) if finite.numel() else None,
        nonfinite=int(lr.numel() - finite.numel()),
    )


def ratio_quantiles(log_ratio: torch.Tensor) -> dict[str, float]:
    """Nearest-rank quantiles of exp(log_ratio): the ratio of an actual token, never interpolated."""
    ordered = torch.sort(log_ratio.double()).values
    n = ordered.numel()
    out = {}
    for q in QUANTILES:
        rank = min(n - 1, max(0, int(round(q * (n - 1)))))
        out[f"p{round(q * 100):02d}"] = float(torch.exp(ordered[rank]))
    return out


def _fraction(mask: torch.Tensor, select: torch.Tensor, n: int) -> float:
    return float((mask & select).sum()) / n if n else 0.0
