"""What one training step is given: :class:`StepInput`, the rows as traced with their advantages.

Plain data (NumPy and the data model, no torch): the harness builds it from a step's rollouts
(:mod:`verbatim.rl.train_step`, :mod:`verbatim.rl.rerendered`) without loading the trainer, and
:meth:`verbatim.trainer.learner.Learner.train_step` turns it into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verbatim.datamodel import TokenColumns


@dataclass(frozen=True, eq=False)
class StepInput:
    """The rows a step trains: token columns as traced, one advantage per row, the groups' rows."""

    columns: Sequence[TokenColumns]
    advantages: np.ndarray
    groups: Sequence[Sequence[int]]
    rollout_ids: Sequence[str] = ()
    """The rollout of each row, when known (the trainer logprob file of the step names them)."""
    behaviour_from_trainer: bool = False
    """Rows whose model tokens have no sampler logprob (NaN, as in re-rendered contexts): π_old stands in
    for μ there, so the correction sees those tokens as on-policy. Off, a NaN μ is an error."""
    temperature: float = 1.0
    """The T of the distribution the rows' μ describes (the traced turns' sampling settings): π is
    log_softmax(logits / T) on every path."""
    truncation: tuple[float, int] | None = None
    """(top_p, top_k) of rows sampled under a mask the trainer does not reproduce (allowed by the user):
    the step counts the sampled tokens π at T would not sample from under that mask."""
