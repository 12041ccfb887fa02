"""The shared-memory weight channel: layout, staging and the worker side, without an engine.

The evidence that vLLM samples from pushed weights is tests/test_engine.py (a real engine, two pushes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from verbatim.engine.weight_push import ALIGN, WeightChannel, WeightReceiver, layout, views


class Runner:
    """vLLM's model runner as the reload sees it: a model without MoE layers (nothing to repack)."""

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 2)


class Worker(WeightReceiver):
    """vLLM's worker as the receiver sees it: ``reload_weights`` takes (name, tensor) pairs."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.planned = 0
        self.model_runner = Runner()

    def _verbatim_new_plan(self, weights):
        self.planned += 1
        return None  # no vLLM model here: the direct reload is tests/test_direct_reload.py's and the engine's

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


def test_names_of_one_tensor_share_a_slot():
    """A tied output layer spelled out as its embedding: one slot, copied and read once."""
    embedding = torch.randn(7, 5)
    slots, size = layout({"embed.weight": embedding, "norm.weight": torch.ones(3),
                          "lm_head.weight": embedding.detach()})
    assert slots[0].offset == slots[2].offset != slots[1].offset
    assert size == layout({"embed.weight": embedding, "norm.weight": torch.ones(3)})[1]
    same_values = layout({"a": embedding, "b": embedding.clone()})[0]
    assert same_values[0].offset != same_values[1].offset  # equal values in other memory are another tensor


def test_weights_kept_in_the_shared_buffer_are_pushed_without_a_copy(monkeypatch):
    channel, worker = WeightChannel(), Worker()
    try:
        sent = _weights(1.0)
        kept = channel.share(sent)
        assert kept is not None and list(kept) == list(sent)
        assert all(torch.equal(kept[k], sent[k]) for k in sent)
        path = str(channel.path)
        assert worker.verbatim_map_shared(path, [s.as_list() for s in channel.slots]) is False  # no plan here
        channel.mapped_by_engine()
        kept["embed.weight"].mul_(3.0)  # the learner's step, in place
        copies = []
        real_copy = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(1) or real_copy(self, src))
        again, slots = channel.stage(kept)
        monkeypatch.undo()
        assert again == path and copies == []  # the buffer already holds them: nothing copied, same mapping
        worker.verbatim_reload_shared(again, slots)
        assert torch.equal(worker.loaded[-1]["embed.weight"], sent["embed.weight"] * 3.0)
        assert worker.planned == 1  # mapped and planned once, before the first push
        other = _weights(2.0)  # tensors of their own: copied into the same buffer
        channel.stage(other)
        assert torch.equal(kept["embed.weight"], other["embed.weight"])
    finally:
        channel.close()


def test_views_of_the_buffer_are_the_slots():
    slots, size = layout(_weights(1.0))
    buffer = torch.zeros(size, dtype=torch.uint8)
    for (name, view), slot in zip(views(buffer, slots), slots):
        assert name == slot.name and view.data_ptr() == buffer.data_ptr() + slot.offset


def test_weights_outside_cpu_memory_are_not_shared():
    channel = WeightChannel()
    try:
        assert channel.share({"w": torch.zeros(4, device="meta")}) is None and channel.path is None
    finally:
        channel.close()


def test_a_push_to_a_bfloat16_engine_is_cast_to_bfloat16_in_half_the_bytes():
    """The engine's format, not the trainer's float32, crosses: half the bytes, and the values the engine would
    get by casting on its side; integer tensors go as they are."""
    weights = {"embed.weight": torch.randn(64, 32), "norm.weight": torch.ones(32),
               "ids": torch.arange(6, dtype=torch.int64)}
    channel, worker = WeightChannel("bfloat16"), Worker()
    try:
        path, slots = channel.stage(weights)
        worker.verbatim_reload_shared(path, slots)
        got = worker.loaded[-1]
        assert got["embed.weight"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64
        assert torch.equal(got["embed.weight"], weights["embed.weight"].to(torch.bfloat16))
        assert torch.equal(got["ids"], weights["ids"])
        assert layout(weights, torch.bfloat16)[1] < 0.6 * layout(weights)[1]
        assert channel.share(weights) is None  # a float32 learner cannot keep its weights in a bfloat16 buffer
    finally:
        channel.close()


def test_a_dev_shm_too_small_for_the_buffer_is_one_warning_naming_the_sizes(tmp_path, monkeypatch, capsys):
    import shutil
    import tempfile

    import verbatim.engine.weight_push as weight_push

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 0, 64 << 20))
    monkeypatch.setattr(weight_push, "_warned", set())
    small = tmp_path / "shm"
    small.mkdir()
    assert weight_push.shared_folder(600 << 20, small) == Path(tempfile.gettempdir())
    assert weight_push.shared_folder(600 << 20, small) == Path(tempfile.gettempdir())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # once, not at every push
    assert f"{small} has 64 MiB free" in lines[0] and "weight buffer (600 MiB" in lines[0]
    assert "--shm-size=3g" in lines[0]
    assert weight_push.shared_folder(16 << 20, small) == small  # room to spare: no word
    assert capsys.readouterr().err == ""
