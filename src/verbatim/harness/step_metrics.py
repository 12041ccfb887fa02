"""One training step's metrics as a typed record: :class:`StepMetrics`, a line of ``metrics.jsonl`` read by name.

The loop writes each step's record as a JSON object (``rl/train_step.step_record``; trackers and
``metrics.jsonl`` take it as it is); code that reads one (the CLI's step line and table, the benchmarks)
reads it through this model, so a key it needs is a field with a type, not a string it spells. Keys this
model does not name (the correction's quantiles, token counts, memory) are kept as they came.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from verbatim.harness.evaluation import score


class StepMetrics(BaseModel):
    """A step's record: what every consumer reads; other keys pass through (``model_extra``)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    step: int
    """The step, counted from 1."""
    version: int
    """The policy version after the step's update."""
    reward_mean: float | None = None
    """Mean reward of the step's trained rollouts (None: none had a reward)."""
    success_rate: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    mismatch_mean_abs: float | None = None
    """Mean |log π − log μ| over the step's model tokens (the sampler/trainer mismatch)."""
    cache_hit_rate: float | None = None
    rollouts: int = 0
    statuses: dict[str, int] = {}
    """Rollouts by status (``ok``, ``truncated``, ``error``…)."""
    hybrid_tokens: int = 0
    dropped: dict[str, float] | None = None
    """The correction's dropped share of tokens by rule (``any``: by one rule or more)."""
    ignored_request_fields: dict[str, int] = {}
    rollout_s: float | None = None
    train_s: float | None = None
    weight_sync_s: float | None = None
    eval: dict[str, Any] | None = None
    """The evaluation of this step's weights on held-out tasks (``--eval-every``; harness/evaluation.py's
    figures); step 0's line holds only the evaluation before the first step."""

    @property
    def trained(self) -> bool:
        """A line of a trained step (not step 0's, which records the evaluation before the first)."""
        return is_trained({"step": self.step})

    def eval_score(self) -> float | None:
        """The evaluation's headline: pass@1 where the env says solved, else avg@K; None without one."""
        return score(self.eval)

    @property
    def errors(self) -> int:
        """Rollouts of the step that ended in an error."""
        return self.statuses.get("error", 0)


def is_trained(record: Mapping[str, Any]) -> bool:
    """A metrics.jsonl line of a trained step: steps count from 1, and step 0's line holds only the evaluation
    before the first step (``--eval-every``)."""
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 1


def steps_of(records: Iterable[Mapping[str, Any]]) -> list[StepMetrics]:
    """``metrics.jsonl``'s records (:func:`~verbatim.harness.metrics_log.read_metrics`) as typed steps."""
    return [StepMetrics.model_validate(dict(record)) for record in records]
