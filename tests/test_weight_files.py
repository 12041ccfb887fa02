"""A checkpoint's weights in several files (numbered, with an index) where they pass the cap, as Hugging Face
writes them: the plan, the round trip, what transformers' loader reads, incomplete sets and run diffs."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.trainer import weight_files
from verbatim.trainer.checkpoint import latest_checkpoint, load_checkpoint, read_checkpoint, save_checkpoint
from verbatim.trainer.weight_files import INDEX, SINGLE, file_plan, weight_index, weight_shapes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

sizes = st.lists(st.integers(0, 100), max_size=30).map(lambda s: [(f"w{i}", n) for i, n in enumerate(s)])


@given(sizes, st.integers(1, 150))
def test_every_weight_goes_once_in_order_and_a_file_passes_the_cap_only_holding_one_weight(weights, cap):
    plan = file_plan(weights, cap)
    assert [name for _, names in plan for name in names] == [name for name, _ in weights]
    size = dict(weights)
    for _, names in plan:
        assert sum(size[n] for n in names) <= cap or len(names) == 1
    for (_, left), (_, right) in zip(plan, plan[1:]):  # a file closes only when the next weight would not fit
        assert sum(size[n] for n in left) + size[right[0]] > cap
    if len(plan) == 1:
        assert plan[0][0] == SINGLE
    else:
        count = len(plan)
        assert [f for f, _ in plan] == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def test_one_file_under_the_cap_is_model_safetensors():
    assert file_plan([("a", 4), ("b", 4)]) == [(SINGLE, ["a", "b"])]
    assert file_plan([("a", 4), ("b", 4)], cap=7) == [("model-00001-of-00002.safetensors", ["a"]),
                                                      ("model-00002-of-00002.safetensors", ["b"])]


@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]),
                          st.integers(0, 6), st.integers(1, 4), st.data()), min_size=1, max_size=4))
def test_rows_read_with_pread_are_the_rows_the_file_holds(tmp_path_factory, weights):
    import safetensors.torch

    from verbatim.trainer.weight_files import RowReader

    file = tmp_path_factory.mktemp("rows") / "w.safetensors"
    tensors = {f"w{i}": (torch.randn(rows, cols) * 100).to(dtype) for i, (dtype, rows, cols, _) in enumerate(weights)}
    safetensors.torch.save_file(tensors, str(file))
    reader = RowReader()
    for (name, tensor), (_, rows, _, data) in zip(tensors.items(), weights, strict=True):
        start = data.draw(st.integers(0, rows))
        stop = data.draw(st.integers(start, rows))
        got = reader.rows(file, name, start, stop)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor[start:stop])


@pytest.fixture
def several(tmp_path, monkeypatch):
    """A tied model checkpointed in files of at most 40 kB (a few weights each), with its config."""
    monkeypatch.setattr(weight_files, "FILE_BYTES", 40_000)
    model = tiny_llama(tied=True, seed=0)
    model.config.save_pretrained(tmp_path / "model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = save_checkpoint(tmp_path / "checkpoints", 1, model, optimizer, {"version": 1},
                           model_files=[tmp_path / "model" / "config.json"])
    return model, path


def test_a_checkpoint_past_the_cap_is_numbered_files_and_an_index_and_loads_back_tied(several):
    model, path = several
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(files) > 2 and not (path / SINGLE).exists()
    assert all(p.stat().st_size < 40_000 + 4_096 or _one_weight(p) for p in path.glob("model-*.safetensors"))
    index = json.loads((path / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["verbatim_aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in index["weight_map"]  # the tied output layer once, under its embedding's name
    assert weight_shapes(path) == {name: tuple(t.shape) for name, t in model.state_dict().items()}
    other = tiny_llama(tied=True, seed=7)
    load_checkpoint(path, other, None)
    assert other.lm_head.weight is other.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name


def _one_weight(path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return len(list(handle.keys())) == 1


def test_transformers_loads_the_numbered_files_as_its_own(several):
    from transformers import AutoModelForCausalLM

    model, path = several
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_checkpoint_missing_one_of_its_files_is_not_complete(several):
    _, path = several
    assert latest_checkpoint(path.parent) == path
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    assert latest_checkpoint(path.parent) is None


def test_run_diff_finds_the_tensor_that_moved_in_the_second_file(several, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from verbatim.harness.run_diff import _checkpoint

    _, path = several
    runs = []
    for name in ("a", "b"):
        shutil.copytree(path, tmp_path / name / "checkpoints" / path.name)
        runs.append(tmp_path / name)
    second = sorted((runs[1] / "checkpoints" / path.name).glob("model-*.safetensors"))[1]
    tensors = load_file(str(second))
    moved = sorted(tensors)[0]
    tensors[moved] = tensors[moved] + 1.0
    save_file(tensors, str(second), metadata={"format": "pt"})
    compared = _checkpoint(*runs)
    assert compared.differ == 1 and compared.first.where == f"tensor {moved}"
    _, read = read_checkpoint(runs[0] / "checkpoints" / path.name)
    files, aliases = weight_index(runs[0] / "checkpoints" / path.name)
    assert set(read) == set(files) | set(aliases)
    assert _checkpoint(runs[0], runs[0]).differ == 0
