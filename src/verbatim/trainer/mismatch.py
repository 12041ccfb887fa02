"""The mismatch report: recompute π for every model token of a trace and compare with the sampler's μ.

For each rollout the trainer-side logprob log π of every model token is
recomputed with transformers (fp32) on the given weights, over exactly the
trace's token sequence (:func:`verbatim.trainer.reference.reference_logprobs`);
the importance-ratio correction then runs with its defaults. The report says
how far the sampler and the trainer disagree, what the correction would mask,
and how that depends on the version lag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verbatim.datamodel import Rollout, Source
from verbatim.errors import InputError, TraceError, install_hint
from verbatim.trainer.batch import behaviour_batch
from verbatim.trainer.correction import correct
from verbatim.trainer.learner import row_logprobs
from verbatim.trainer.learner_config import CorrectionConfig
from verbatim.trainer.logprob_files import RolloutLogprobs, write_logprobs
from verbatim.trainer.reference import reference_logprobs
from verbatim.trainer.routing_replay import counting_flips, routers
from verbatim.trainer.routing_replay import replayed as replayed_routing


@dataclass(frozen=True)
class MismatchReport:
    rollouts: int
    model_tokens: int
    trainer_version: int
    mean_abs_log_ratio: float
    log_ratios: np.ndarray
    metrics: dict[str, Any]
    per_rollout: tuple[RolloutLogprobs, ...] = ()
    """Each rollout's log π (NaN off its model tokens) and the correction's keep mask, for ``--save``."""
    routing: dict[str, Any] | None = None
    """Where the trace recorded routed experts and the model's routers replay them: how often the model's own router
    chose otherwise, where, and the mismatch with the replay (:func:`routing_report`)."""

    def as_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "model_tokens": self.model_tokens,
                "trainer_version": self.trainer_version, "mean_abs_log_ratio": self.mean_abs_log_ratio,
                "metrics": self.metrics, "routing": self.routing}


def usable_rollouts(rollouts: list[Rollout]) -> list[Rollout]:
    """Rollouts with at least one sampled token that carries a finite logprob, as the sequences the sampler saw
    (one per segment of a rollout whose agent rewrote its history: π is computed in each segment's context)."""
    usable = []
    for rollout in (piece for whole in rollouts for piece in whole.segments()):
        model = rollout.tokens.source == Source.MODEL
        if model.any() and np.isfinite(rollout.tokens.logprob[model]).all():
            usable.append(rollout)
    if not usable:
        raise TraceError("the trace has no sampled tokens with logprobs to compare",
                         hint="record a run with 'verbatim run' (every model token carries its sampler logprob)")
    return usable


def check_vocabulary(rollouts: list[Rollout], vocab_size: int, model_name: str) -> None:
    highest = max(int(r.tokens.token_id.max()) for r in rollouts if len(r.tokens))
    if highest >= vocab_size:
        raise InputError(f"token id {highest} in the trace is outside {model_name}'s vocabulary of {vocab_size}",
                         hint="pass the --model the trace was sampled with")


def sampled_temperature(rollout: Rollout) -> float:
    """The T of the distribution a rollout's μ describes, from the sampling settings its turns record."""
    sampling = rollout.sampling()
    if sampling is None:
        raise TraceError(f"rollout {rollout.rollout_id}'s turns were sampled with different settings",
                         hint="its μ describes no one temperature the report could recompute π at")
    return sampling.logprob_temperature


def mismatch(rollouts: list[Rollout], model: Any, *, trainer_version: int | None = None,
             config: CorrectionConfig | None = None) -> MismatchReport:
    rollouts = usable_rollouts(rollouts)
    batch = behaviour_batch([r.tokens for r in rollouts])
    logp_pi = torch.zeros_like(batch.logp_mu)
    with torch.no_grad():
        for i, rollout in enumerate(rollouts):
            n = len(rollout.tokens)
            temperature = sampled_temperature(rollout)
            logp_pi[i, :n] = torch.nan_to_num(reference_logprobs(model, rollout.tokens.token_id,
                                                                 temperature=temperature), nan=0.0)
    version = int(batch.versions.max()) if trainer_version is None else trainer_version
    logp_mu = torch.nan_to_num(batch.logp_mu, nan=0.0)
    result = correct(logp_pi, logp_mu, batch.loss_mask, batch.versions, version, config)
    ratios = result.log_ratio[batch.loss_mask].numpy()
    routing, flips = routing_report(rollouts, model)
    return MismatchReport(rollouts=len(rollouts), model_tokens=int(batch.loss_mask.sum()), trainer_version=version,
                          mean_abs_log_ratio=float(np.abs(ratios).mean()), log_ratios=ratios,
                          metrics=result.metrics.as_dict(),
                          per_rollout=per_rollout([r.row_id for r in rollouts], logp_pi, batch.loss_mask,
                                                  batch.lengths, result.keep, flips),
                          routing=routing)


SHOWN_FLIPS = 50
"""The flipped tokens a report lists (the first, in trace order)."""


def routing_report(rollouts: list[Rollout], model: Any) -> tuple[dict[str, Any] | None, list[np.ndarray] | None]:
    """π again with each rollout's recorded experts replayed (trainer/routing_replay.py): the share of token-layers
    the model's own router sends elsewhere, the tokens where it does (rollout, position, layers flipped), and the
    mean |log π − log μ| over the sampled tokens with the replay; and each rollout's flipped layers per token.
    ``None`` where a rollout has no experts or the model no router to replay."""
    if any(r.tokens.routed_experts is None for r in rollouts) or not routers(model):
        return None, None
    replayed = flipped = 0
    gaps, where, per_token = [], [], []
    with torch.no_grad():
        for rollout in rollouts:
            tokens, n = rollout.tokens, len(rollout.tokens)
            experts = torch.from_numpy(tokens.routed_experts.astype(np.int64))[None]
            with counting_flips(n) as flips, replayed_routing(model, experts):
                logp = reference_logprobs(model, tokens.token_id, temperature=sampled_temperature(rollout))
            model_tokens = tokens.source == Source.MODEL
            gaps.append(np.abs(logp.numpy()[model_tokens] - tokens.logprob[model_tokens]))
            replayed, flipped = replayed + flips.replayed, flipped + flips.flipped
            per_token.append(flips.per_token.numpy())
            where += [[rollout.row_id, int(t), int(flips.per_token[t])]
                      for t in np.flatnonzero(flips.per_token.numpy())]
    return {"flip_rate": flipped / replayed if replayed else None, "token_layers": replayed,
            "flipped_token_layers": flipped, "tokens_with_flips": len(where),
            "mean_abs_log_ratio_replayed": float(np.concatenate(gaps).mean()) if gaps else None,
            "flipped_tokens": where[:SHOWN_FLIPS]}, per_token


def per_rollout(ids: list[str], logp_pi: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                keep: torch.Tensor, flips: list[np.ndarray] | None = None) -> tuple[RolloutLogprobs, ...]:
    """Padded (B, T) log π and keep mask → one row per rollout, NaN off its model tokens (with each token's routing
    flips, where counted)."""
    rows = row_logprobs(logp_pi, loss_mask, lengths, keep)
    flipped = flips if flips is not None else [None] * len(ids)
    return tuple(RolloutLogprobs(rid, logprob, kept, flip) for rid, (logprob, kept), flip in zip(ids, rows, flipped))


def save_logprobs(report: MismatchReport, path: Path, model: str, config: CorrectionConfig | None = None) -> Path:
    """``verbatim mismatch --save``: the report's per-rollout log π and keep mask, written atomically."""
    meta = {"writer": "mismatch", "model": model, "trainer_version": report.trainer_version,
            "correction": (config or CorrectionConfig()).model_dump(mode="json")}
    return write_logprobs(path, report.per_rollout, meta)


def plot_histogram(report: MismatchReport, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("--plot needs matplotlib", hint=install_hint("report")) from exc
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.hist(report.log_ratios, bins=60, color="#3b6ea8")
    axis.axvline(0.0, color="black", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xlabel("log π − log μ  (trainer minus sampler, per model token)")
    axis.set_ylabel("tokens")
    axis.set_title(f"{report.model_tokens} model tokens in {report.rollouts} rollouts; "
                   f"mean |Δ| = {report.mean_abs_log_ratio:.2e}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
