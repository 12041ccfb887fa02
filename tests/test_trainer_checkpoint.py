"""Trainer checkpoints: exact round trips (weights, AdamW, RNG), pruning, failed and killed writes, config diffs."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import verbatim
from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.errors import CheckpointError, InputError, TrainerError
from verbatim.trainer.checkpoint import (
    CHECKPOINT_SCHEMA,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def _train_step(model, optimizer, seed: int = 3) -> None:
    ids = _batch(seed)
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def _trained(steps: int = 2, seed: int = 0):
    model = tiny_llama(tied=True, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(steps):
        _train_step(model, optimizer, seed=i)
    return model, optimizer


def _fresh(seed: int = 7):
    model = tiny_llama(tied=True, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _same_params(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _same_optimizer_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(torch.equal(sa["state"][k][name], sb["state"][k][name])
               for k in sa["state"] for name in ("step", "exp_avg", "exp_avg_sq"))


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------


def test_a_loaded_checkpoint_trains_on_bitwise_identically(tmp_path):
    model, optimizer = _trained()
    path = save_checkpoint(tmp_path, 2, model, optimizer, {"version": 2, "config": {"lr": 0.01}})
    assert path == tmp_path / "step-000002"
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]

    other, other_optimizer = _fresh()
    assert not _same_params(model, other)
    state = load_checkpoint(path, other, other_optimizer)
    assert state == {"schema": CHECKPOINT_SCHEMA, "step": 2, "version": 2, "config": {"lr": 0.01}}
    assert _same_params(model, other)
    assert _same_optimizer_state(optimizer, other_optimizer)
    _train_step(model, optimizer, seed=9)
    _train_step(other, other_optimizer, seed=9)
    assert _same_params(model, other)
    assert not _same_params(model, tiny_llama(tied=True, seed=0))  # the step did move the weights


def test_tied_weights_are_saved_once_and_stay_tied(tmp_path):
    model, optimizer = _trained(steps=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())  # noqa: SIM118 - not a dict
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert names | {"lm_head.weight"} == set(model.state_dict())

    other, other_optimizer = _fresh()
    load_checkpoint(path, other, other_optimizer)
    assert other.lm_head.weight is other.model.embed_tokens.weight
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_weights_side_by_side_in_one_storage_are_saved_as_they_are(tmp_path):
    """A learner whose weights live in the engine's shared buffer: views side by side in one storage are
    saved without a copy each, and load back as the same weights."""
    from verbatim.trainer.checkpoint import deduplicated

    model, optimizer = _trained(steps=1)
    params = list(model.parameters())
    buffer = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    tensors, aliases = deduplicated(model.state_dict())
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert all(tensors[n].data_ptr() == t.data_ptr() for n, t in model.state_dict().items() if n in tensors)
    overlapping, _ = deduplicated({"a": buffer[:10], "b": buffer[5:15]})
    assert overlapping["b"].data_ptr() != buffer[5:15].data_ptr()  # overlapping memory: a copy of its own
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    other, other_optimizer = _fresh()
    load_checkpoint(path, other, other_optimizer)
    assert _same_params(model, other)


def test_the_three_random_generators_are_restored(tmp_path):
    model, optimizer = _trained(steps=1)
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    np.random.normal()  # a cached Gaussian in NumPy's state too
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    expected = (torch.rand(4), random.random(), np.random.normal(), np.random.rand(3))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load_checkpoint(path, *_fresh())
    got = (torch.rand(4), random.random(), np.random.normal(), np.random.rand(3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and got[2] == expected[2]
    assert np.array_equal(got[3], expected[3])


def test_load_without_an_optimizer_loads_the_weights(tmp_path):
    model, optimizer = _trained(steps=1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"version": 1})
    other, _ = _fresh()
    assert load_checkpoint(path, other, None)["version"] == 1
    assert _same_params(model, other)


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, optimizer = _trained(steps=1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    smaller = LlamaForCausalLM(config)
    before = {k: v.clone() for k, v in smaller.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, smaller, torch.optim.AdamW(smaller.parameters()))
    line = caught.value.one_line()
    assert "\n" not in line and "was written for another model" in line
    assert "unexpected model.layers.2." in line
    assert "other shapes lm_head.weight (97, 64) (the model's (64, 32))" in line
    assert all(torch.equal(before[k], v) for k, v in smaller.state_dict().items())  # untouched
    assert isinstance(caught.value, TrainerError) and caught.value.exit_code == 2


def test_a_newer_schema_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, 1, *_trained(steps=1), {})
    (path / "state.json").write_text(json.dumps({"schema": CHECKPOINT_SCHEMA + 1, "step": 1}))
    with pytest.raises(CheckpointError, match="has schema 2; this verbatim reads schema 1"):
        load_checkpoint(path, *_fresh())


@pytest.mark.parametrize("state,needle", [({"step": 3}, "may not set step"), ({"schema": 0}, "may not set schema"),
                                          ({"x": object()}, "is not JSON data")])
def test_bad_state_is_refused_before_anything_is_written(tmp_path, state, needle):
    with pytest.raises(InputError, match=needle):
        save_checkpoint(tmp_path / "ck", 1, *_trained(steps=0), state)
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------
# which checkpoints exist
# ---------------------------------------------------------------------------


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    model, optimizer = _trained(steps=0)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=2)
        assert sorted(p.name for p in tmp_path.iterdir()) == \
            [f"step-{s:06d}" for s in range(max(1, step - 1), step + 1)]
    save_checkpoint(tmp_path, 6, model, optimizer, {}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000006"]
    with pytest.raises(InputError, match="keep must be at least 1"):
        save_checkpoint(tmp_path, 7, model, optimizer, {}, keep=0)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000006"


def test_saving_an_earlier_step_drops_the_later_ones(tmp_path):
    """After a resume from step 2 the loop saves step 3 again: the old 3 and 4 belong to an abandoned run."""
    model, optimizer = _trained(steps=0)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, optimizer, {"run": "old"}, keep=5)
    save_checkpoint(tmp_path, 3, model, optimizer, {"run": "new"}, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002", "step-000003"]
    assert json.loads((tmp_path / "step-000003" / "state.json").read_text())["run"] == "new"


def test_latest_skips_incomplete_folders_and_removes_killed_writes(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    assert latest_checkpoint(tmp_path) is None
    model, optimizer = _trained(steps=0)
    save_checkpoint(tmp_path, 1, model, optimizer, {})
    second = save_checkpoint(tmp_path, 2, model, optimizer, {})
    (tmp_path / ".tmp-step-000003-abc").mkdir()
    (tmp_path / ".tmp-step-000003-abc" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "step-000004").mkdir()  # no state.json
    (tmp_path / "step-000004" / "model.safetensors").write_bytes(b"x")
    garbled = tmp_path / "step-000005"
    garbled.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "rng.pt"):
        (garbled / name).write_bytes(b"x")
    (garbled / "state.json").write_text('{"schema": 1, "st')
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == second
    assert not (tmp_path / ".tmp-step-000003-abc").exists()
    assert (tmp_path / "step-000004").exists()  # ignored, not deleted
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(garbled, model, optimizer)


# ---------------------------------------------------------------------------
# failed and killed writes
# ---------------------------------------------------------------------------


def _fail(*args, **kwargs):
    raise ENOSPC


def _rust_fail(*args, **kwargs):  # what safetensors' own writer raises on a full disk
    raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                       'message: "No space left on device" })')


@pytest.mark.parametrize("target,replacement", [
    ((safetensors.torch, "save_file"), _fail),
    ((safetensors.torch, "save_file"), _rust_fail),
    ((torch, "save"), _fail),
    ((os, "rename"), _fail),
])
def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, target, replacement):
    model, optimizer = _trained(steps=1)
    first = save_checkpoint(tmp_path, 1, model, optimizer, {"version": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model, optimizer)
    monkeypatch.setattr(*target, replacement)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 2, model, optimizer, {"version": 2}, keep=1)
    monkeypatch.undo()
    line = caught.value.one_line()
    assert line == (f"cannot write checkpoint step-000002 in {tmp_path}: No space left on device; nothing was "
                    "written (free space or pass another --out, then --resume)")
    assert caught.value.exit_code == 2
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]
    assert latest_checkpoint(tmp_path) == first
    other, other_optimizer = _fresh()
    assert load_checkpoint(first, other, other_optimizer)["version"] == 1
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict().items())


def test_a_failed_rewrite_of_the_same_step_puts_the_old_one_back(tmp_path, monkeypatch):
    model, optimizer = _trained(steps=1)
    save_checkpoint(tmp_path, 1, model, optimizer, {"version": 1})
    real_rename = os.rename

    def publish_fails(src, dst):
        if Path(src).name.startswith(".tmp-step-000001"):
            raise ENOSPC
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", publish_fails)
    with pytest.raises(CheckpointError, match="No space left on device; nothing was written"):
        save_checkpoint(tmp_path, 1, model, optimizer, {"version": 99})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]
    assert load_checkpoint(tmp_path / "step-000001", *_fresh())["version"] == 1


def test_an_unwritable_root_is_one_line(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.mkdtemp", read_only)
    with pytest.raises(CheckpointError, match="step-000001 in .*: Read-only file system; nothing was written"):
        save_checkpoint(tmp_path, 1, *_trained(steps=0), {})


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from verbatim.trainer.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    root = Path(sys.argv[1])
    save_checkpoint(root, 1, model, optimizer, {"version": 1})
    real_save = torch.save

    def slow_save(obj, handle):  # the model file is on disk; the optimizer's is half written
        handle.write(b"PK half an optimizer")
        handle.flush()
        print("writing", flush=True)
        time.sleep(60)

    torch.save = slow_save
    save_checkpoint(root, 2, model, optimizer, {"version": 2})
""")


def test_a_write_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(verbatim.__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", proc.stderr.read()
        half = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-000002")]
        assert len(half) == 1 and (half[0] / "model.safetensors").is_file()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]
    model = torch.nn.Linear(8, 8)
    assert load_checkpoint(tmp_path / "step-000001", model, torch.optim.AdamW(model.parameters())) == \
        {"schema": 1, "step": 1, "version": 1}
