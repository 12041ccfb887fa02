"""Padded trainer batches built from trace token columns.

:func:`behaviour_batch` turns the :class:`~verbatim.datamodel.TokenColumns` of several
rollouts into the right-padded (B, T) tensors that :func:`verbatim.trainer.correction.correct`
takes: token ids, the loss mask (model tokens), the behaviour logprobs μ (NaN where
not sampled, and on padding) and the policy versions (-1 where not sampled, and on padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verbatim.datamodel import Source, TokenColumns


@dataclass(frozen=True, eq=False)
class BehaviourBatch:
    token_ids: torch.Tensor
    """(B, T) int64, padded with 0."""
    loss_mask: torch.Tensor
    """(B, T) bool: model tokens."""
    logp_mu: torch.Tensor
    """(B, T) float32: the sampler's logprob of each token, NaN where there is none."""
    versions: torch.Tensor
    """(B, T) int32: the policy version that sampled each token, -1 where none."""
    lengths: torch.Tensor
    """(B,) int64: unpadded lengths."""


def behaviour_batch(columns: Sequence[TokenColumns]) -> BehaviourBatch:
    """Right-pad the columns of ``columns`` into one batch."""
    width = max((len(c) for c in columns), default=0)
    rows = len(columns)
    token_ids = np.zeros((rows, width), np.int64)
    loss_mask = np.zeros((rows, width), bool)
    logp_mu = np.full((rows, width), np.nan, np.float32)
    versions = np.full((rows, width), -1, np.int32)
    for i, c in enumerate(columns):
        n = len(c)
        token_ids[i, :n] = c.token_id
        loss_mask[i, :n] = c.source == Source.MODEL
        logp_mu[i, :n] = c.logprob
        versions[i, :n] = c.policy_version
    return BehaviourBatch(
        token_ids=torch.from_numpy(token_ids),
        loss_mask=torch.from_numpy(loss_mask),
        logp_mu=torch.from_numpy(logp_mu),
        versions=torch.from_numpy(versions),
        lengths=torch.tensor([len(c) for c in columns], dtype=torch.int64),
    )
