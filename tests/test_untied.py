"""Serving a tied model untied (engine/untied.py): the copy computes what the tied model computes,
holds the output layer spelled out, is made once, and a failed write leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from verbatim.bench.prefixflow_exactness import VOCAB, tiny_llama
from verbatim.engine.untied import (
    EMBEDDING,
    OUTPUT,
    is_tied,
    needs_untying,
    serves_untied,
    serving_copy,
    untie_state_dict,
    untied_folder,
)
from verbatim.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def tied_model():
    return tiny_llama(tied=True, seed=1).eval()


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tied_model) -> Path:
    folder = tmp_path_factory.mktemp("tied")
    tied_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("untied")
    tiny_llama(tied=False, seed=2).save_pretrained(folder)
    return folder


def names(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            found.update(f.keys())
    return found


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        out.update(load_file(str(path)))
    return out


def logits(folder_or_model, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = folder_or_model if isinstance(folder_or_model, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


def test_the_saved_tied_model_has_no_output_layer(tied_dir, untied_dir):
    """The premise: a tied checkpoint holds the embedding only, an untied one both."""
    assert EMBEDDING in names(tied_dir) and OUTPUT not in names(tied_dir)
    assert {EMBEDDING, OUTPUT} <= names(untied_dir)


def test_is_tied(tied_dir, untied_dir, tmp_path):
    assert is_tied(tied_dir) and not is_tied(untied_dir)
    assert not is_tied(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    assert not is_tied(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert is_tied(tmp_path)  # a multimodal config ties in its text part
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True,
                                                      "text_config": {"tie_word_embeddings": False}}))
    assert not is_tied(tmp_path)  # the text part decides


def test_a_tied_gemma2_is_served_as_it_is(tied_dir, tmp_path):
    """vLLM's Gemma 2 computes its logits with the embedding (no lm_head to load): an untied copy would be
    refused, and a reload of the embedding reaches the output. tests/test_train_families.py trains one."""
    gemma = tmp_path / "gemma2"
    shutil.copytree(tied_dir, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps(config | {"architectures": ["Gemma2ForCausalLM"]}))
    assert is_tied(gemma) and not serves_untied(gemma) and not needs_untying(gemma)
    assert serves_untied(tied_dir) and serving_copy(gemma) == gemma.resolve()


def test_needs_untying(tied_dir, untied_dir, tmp_path):
    assert needs_untying(tied_dir)
    assert not needs_untying(untied_dir)
    assert not needs_untying(tmp_path)  # no weights: nothing to untie


def test_asking_whether_a_bfloat16_folder_needs_untying_loads_no_torch(tied_model, tmp_path):
    """``verbatim run --engine http`` asks this as it begins the server; nothing else there needs torch."""
    import copy
    import subprocess
    import sys

    copy.deepcopy(tied_model).to(torch.bfloat16).save_pretrained(tmp_path)
    code = ("import sys\nfrom verbatim.engine.untied import needs_untying\n"
            "print(needs_untying(sys.argv[1]), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split() == ["True", "False"]


def test_untie_state_dict_adds_a_copy_of_the_embedding_only_where_missing():
    embedding = torch.randn(5, 3)
    state = {EMBEDDING: embedding, "model.norm.weight": torch.ones(3)}
    untied = untie_state_dict(state)
    assert set(untied) == {EMBEDDING, OUTPUT, "model.norm.weight"} and set(state) == {EMBEDDING, "model.norm.weight"}
    assert torch.equal(untied[OUTPUT], embedding)
    assert untied[OUTPUT].untyped_storage().data_ptr() != embedding.untyped_storage().data_ptr()  # a copy
    pushed = untie_state_dict(state, copy=False)  # for the in-memory push: the embedding itself
    assert pushed[OUTPUT].untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    both = {EMBEDDING: embedding, OUTPUT: torch.zeros(5, 3)}
    assert untie_state_dict(both) is both  # an explicit output layer is kept as it is
    partial = {"model.norm.weight": torch.ones(3)}
    assert untie_state_dict(partial) is partial  # no embedding (e.g. a partial update): nothing to copy


def test_an_untied_model_is_served_from_its_own_folder(untied_dir, tmp_path):
    root = tmp_path / "serving"
    assert serving_copy(untied_dir, root) == untied_dir.resolve()
    assert not root.exists()


def test_a_tied_model_is_served_from_an_untied_copy_made_once(tied_dir, tied_model, tmp_path):
    root = tmp_path / "serving"
    copy = serving_copy(tied_dir, root)
    assert copy.parent == root and copy.name.startswith(f"{tied_dir.name}-untied-")
    config = json.loads((copy / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and not is_tied(copy) and not needs_untying(copy)
    weights, source = tensors(copy), tensors(tied_dir)
    assert set(weights) == set(source) | {OUTPUT}
    assert torch.equal(weights[OUTPUT], source[EMBEDDING])
    assert all(torch.equal(weights[name], source[name]) for name in source)
    assert (copy / "generation_config.json").is_file()

    made = (copy / "model.safetensors").stat().st_mtime_ns
    assert serving_copy(tied_dir, root) == copy
    assert (copy / "model.safetensors").stat().st_mtime_ns == made  # reused, not rewritten
    assert [p.name for p in root.iterdir()] == [copy.name]  # no temporary folders left

    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    served = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    assert served.lm_head.weight.data_ptr() != served.model.embed_tokens.weight.data_ptr()  # really untied
    assert torch.equal(logits(served, ids), logits(tied_model, ids))
    assert torch.equal(logits(tied_dir, ids), logits(tied_model, ids))


def test_new_source_weights_get_a_new_copy(tmp_path):
    source, root = tmp_path / "model", tmp_path / "serving"
    tiny_llama(tied=True, seed=3).save_pretrained(source)
    first = serving_copy(source, root)
    tiny_llama(tied=True, seed=4).save_pretrained(source)
    os.utime(source / "model.safetensors", ns=(1, 1))  # a different mtime even on a coarse clock
    second = serving_copy(source, root)
    assert second != first
    assert not torch.equal(tensors(second)[OUTPUT], tensors(first)[OUTPUT])
    assert torch.equal(tensors(second)[OUTPUT], tensors(source)[EMBEDDING])


def test_a_copy_made_meanwhile_by_another_process_is_used(tied_dir, tmp_path, monkeypatch):
    import verbatim.engine.untied as untied

    root = tmp_path / "serving"
    made = untied.untied_folder

    def racing(source, parent=None):
        folder = made(source, parent=parent)
        other = made(source, parent=parent)  # the other process finishes first
        (other / untied._MARK).write_text("{}\n")
        other.rename(root / f"{Path(source).name}-untied-{untied._fingerprint(Path(source).resolve())}")
        return folder

    monkeypatch.setattr(untied, "untied_folder", racing)
    copy = serving_copy(tied_dir, root)
    assert (copy / untied._MARK).read_text() == "{}\n"  # the other process's copy
    assert [p.name for p in root.iterdir()] == [copy.name]


def test_a_sharded_checkpoint_is_untied_into_one_file(tied_model, tmp_path):
    source = tmp_path / "sharded"
    tied_model.save_pretrained(source, max_shard_size="100KB")
    assert len(list(source.glob("*.safetensors"))) > 1 and (source / "model.safetensors.index.json").is_file()
    folder = untied_folder(source, parent=tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith("verbatim-untied-")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.equal(tensors(folder)[OUTPUT], tensors(source)[EMBEDDING])
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(folder, ids), logits(tied_model, ids))


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(InputError, match="has no .safetensors weights"):
        untied_folder(tmp_path / "model", parent=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_folder(tied_dir, tmp_path, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(type(error)):
        untied_folder(tied_dir, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []
    root = tmp_path / "serving"
    with pytest.raises(type(error)):
        serving_copy(tied_dir, root)
    assert list(root.iterdir()) == []  # and serving_copy has no half-made copy to reuse next time
