"""Publishing a trainer's weights for served replicas (engine/checkpoints.py ``publish_weights``):
``root/vNNNNNN`` appears whole or not at all, with the output layer spelled out."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verbatim.bench.prefixflow_exactness import tiny_llama
from verbatim.engine.checkpoints import publish_weights, state_dict_checkpoint
from verbatim.engine.untied import EMBEDDING, OUTPUT
from verbatim.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENOSPC = OSError(errno.ENOSPC, "No space left on device")



@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied model's folder and its weights as the learner hands them over: each storage once."""
    model = tiny_llama(tied=True, seed=5)
    folder = tmp_path_factory.mktemp("tied")
    model.save_pretrained(folder)
    weights = {name: t.detach().clone() for name, t in model.state_dict().items() if name != OUTPUT}
    return folder, weights


def scaled(weights: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {name: t * by for name, t in weights.items()}


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_version_is_written_whole_with_the_output_layer(tied, tmp_path, monkeypatch):
    like, weights = tied
    root = tmp_path / "weights"
    import safetensors.torch

    save = safetensors.torch.save_file
    seen_while_writing = []

    def watched(tensors, path, *args, **kwargs):
        seen_while_writing.append(listing(root))
        return save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", watched)
    final = publish_weights(weights, like, root, 1)
    assert final == root / "v000001"
    assert len(seen_while_writing) == 1 and "v000001" not in seen_while_writing[0]  # written elsewhere, renamed in
    assert listing(root) == ["v000001"]
    assert (final / "config.json").read_text() == (like / "config.json").read_text()
    written = load_file(str(final / "model.safetensors"))
    assert set(written) == set(weights) | {OUTPUT}
    assert torch.equal(written[OUTPUT], weights[EMBEDDING])
    assert all(torch.equal(written[name], weights[name]) for name in weights)


def test_a_full_state_dict_of_a_tied_model_is_published_too(tied, tmp_path):
    """``model.state_dict()`` of a tied model holds the output layer as the embedding's own storage."""
    like, _ = tied
    model = tiny_llama(tied=True, seed=6)
    state = model.state_dict()
    assert state[OUTPUT].data_ptr() == state[EMBEDDING].data_ptr()
    written = load_file(str(publish_weights(state, like, tmp_path, 3) / "model.safetensors"))
    assert torch.equal(written[OUTPUT], state[EMBEDDING]) and torch.equal(written[EMBEDDING], state[EMBEDDING])
    assert listing(tmp_path) == ["v000003"]
    folder = state_dict_checkpoint(state, like, parent=tmp_path)
    assert torch.equal(load_file(str(folder / "model.safetensors"))[OUTPUT], state[EMBEDDING])


def test_publishing_a_version_again_replaces_it_whole(tied, tmp_path):
    like, weights = tied
    first = publish_weights(weights, like, tmp_path, 1)
    (first / "stray.txt").write_text("left by the first publication")
    again = publish_weights(scaled(weights, 2.0), like, tmp_path, 1)
    assert again == first and listing(tmp_path) == ["v000001"]
    assert not (again / "stray.txt").exists()
    written = load_file(str(again / "model.safetensors"))
    assert torch.equal(written[EMBEDDING], weights[EMBEDDING] * 2.0)
    assert torch.equal(written[OUTPUT], weights[EMBEDDING] * 2.0)


def test_leftover_temporary_folders_are_removed(tied, tmp_path):
    like, weights = tied
    for name in ("verbatim-weights-killed1", "verbatim-weights-killed2"):
        (tmp_path / name / "old").mkdir(parents=True)
        (tmp_path / name / "old" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "unrelated").mkdir()
    publish_weights(weights, like, tmp_path, 1)
    assert listing(tmp_path) == ["unrelated", "v000001"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_versions_stay(tied, tmp_path, keep):
    like, weights = tied
    for version in (1, 2, 3, 9, 10):
        publish_weights(weights, like, tmp_path, version, keep=keep)
    assert listing(tmp_path) == ["v000001", "v000002", "v000003", "v000009", "v000010"][-keep:]


def test_publishing_an_older_version_keeps_it_and_removes_the_later_ones(tied, tmp_path):
    """A resumed run publishes its checkpoint's version (or its base weights, version 0) below versions a killed
    run published past it: those are trained again, and the one the servers are about to reload stays."""
    like, weights = tied
    for version in (1, 2, 3):
        publish_weights(weights, like, tmp_path, version)
    assert publish_weights(weights, like, tmp_path, 0).is_dir()
    assert listing(tmp_path) == ["v000000"]
    for version in (1, 2):
        publish_weights(weights, like, tmp_path, version)
    publish_weights(weights, like, tmp_path, 1)  # v000000 went with v000002's publication (keep 2)
    assert listing(tmp_path) == ["v000001"]


def _fail_rename(monkeypatch):
    """The rename of a new folder into place fails (putting an old one back does not)."""
    rename = os.rename

    def fail(src, dst, *args, **kwargs):
        if Path(src).name.startswith("verbatim-weights-") and Path(dst).name.startswith("v0"):
            raise ENOSPC
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", fail)


@pytest.mark.parametrize("where", ["save", "rename", "mkdir"])
def test_an_os_error_is_one_line_and_leaves_no_temporary_folder(tied, tmp_path, monkeypatch, where):
    like, weights = tied
    root = tmp_path / "weights"
    if where == "save":
        def full(*args, **kwargs):
            raise ENOSPC

        monkeypatch.setattr("safetensors.torch.save_file", full)
    elif where == "rename":
        _fail_rename(monkeypatch)
    else:
        root.write_text("a file where the folder goes")
    with pytest.raises(InputError) as caught:
        publish_weights(weights, like, root, 4)
    line = caught.value.one_line()
    assert "\n" not in line and line.startswith(f"cannot publish the version 4 weights in {root}: ")
    assert "free space or pass another --out, then --resume" in line
    if root.is_dir():
        assert listing(root) == []


def test_a_failed_republication_keeps_the_published_version_and_no_temporary_folder(tied, tmp_path, monkeypatch):
    like, weights = tied
    publish_weights(weights, like, tmp_path, 1)
    _fail_rename(monkeypatch)
    with pytest.raises(InputError, match="No space left on device"):
        publish_weights(scaled(weights, 2.0), like, tmp_path, 1)
    assert listing(tmp_path) == ["v000001"]
    assert torch.equal(load_file(str(tmp_path / "v000001" / "model.safetensors"))[EMBEDDING], weights[EMBEDDING])
