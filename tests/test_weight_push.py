"""The shared-memory weight channel: layout, staging and the worker side, without an engine.

The evidence that vLLM samples from pushed weights is tests/test_engine.py (a real engine, two pushes).
"""

from __future__ import annotations

import os

import torch

from verbatim.engine.weight_push import ALIGN, WeightChannel, WeightReceiver, layout


class Worker(WeightReceiver):
    """vLLM's worker as the receiver sees it: ``reload_weights`` takes (name, tensor) pairs."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []

    def _verbatim_direct(self, path, weights):
        return False  # no vLLM model here: the direct reload is tests/test_direct_reload.py's and the engine's

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        assert is_checkpoint_format
        self.loaded.append({name: tensor.clone() for name, tensor in weights_iterator})


def _weights(scale: float) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.randn(7, 5) * scale, "norm.weight": torch.ones(3, dtype=torch.bfloat16) * scale,
            "layer.bias": torch.arange(5, dtype=torch.float64) * scale}


def test_every_tensor_starts_aligned_and_none_overlap():
    slots, size = layout(_weights(1.0))
    assert all(s.offset % ALIGN == 0 for s in slots)
    ends = [s.offset + torch.Size(s.shape).numel() * torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
            for s in slots]
    assert all(end <= nxt.offset for end, nxt in zip(ends, slots[1:])) and ends[-1] <= size


def test_a_push_reaches_the_worker_exactly_and_the_next_reuses_the_buffer():
    channel, worker = WeightChannel(), Worker()
    try:
        first = _weights(1.0)
        path, slots = channel.stage(first)
        worker.verbatim_reload_shared(path, slots)
        channel.mapped_by_engine()
        assert not os.path.exists(path)  # mapped on both sides: nothing left for a killed process to leak
        second = _weights(2.0)
        again, slots = channel.stage(second)
        worker.verbatim_reload_shared(again, slots)
        assert again == path  # same layout: the same mapped file
        for sent, got in zip((first, second), worker.loaded):
            assert list(got) == list(sent)
            assert all(torch.equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype for k in sent)
        other = {"only.weight": torch.zeros(2)}
        moved, _ = channel.stage(other)
        assert moved != path and os.path.exists(moved)  # another layout: another file, until the engine maps it
    finally:
        channel.close()
    assert channel.path is None
