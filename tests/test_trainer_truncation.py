"""outside_mask: which sampled tokens a top-k / top-p mask over π at temperature T would not keep."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.trainer.truncation import outside_mask


def kept_by_vllm(probs: np.ndarray, top_p: float, top_k: int) -> set[int]:
    """The tokens vLLM samples from: the top k, then the smallest most-likely set reaching p of their mass."""
    order = np.argsort(-probs, kind="stable")
    if top_k:
        order = order[:top_k]
    mass = probs[order] / probs[order].sum()
    before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
    return {int(i) for i, b in zip(order, before) if b < top_p}


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.integers(-24, 24).map(lambda x: x / 4), min_size=2, max_size=12, unique=True),
       top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3]), top_k=st.integers(0, 5),
       temperature=st.sampled_from([0.5, 1.0, 1.7]))
def test_outside_is_the_complement_of_what_vllm_keeps(logits, top_p, top_k, temperature):
    """Distinct logits a quarter apart: no ties, whose order the mask's edge would not define."""
    values = torch.tensor([logits], dtype=torch.float64)
    probs = torch.softmax(values[0] / temperature, dim=-1).numpy()
    kept = kept_by_vllm(probs, top_p, top_k)
    for target in range(len(logits)):
        got = bool(outside_mask(values, torch.tensor([target]), temperature, top_p, top_k)[0])
        assert got == (target not in kept), (target, kept)


def test_no_mask_keeps_everything():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    assert not outside_mask(logits, torch.arange(5), 1.0, 1.0, 0).any()
