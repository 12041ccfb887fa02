"""The trainer's reference log π (plain Hugging Face forward) and its model loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verbatim.errors import TrainerError, UnknownModelError
from verbatim.trainer.reference import load_model, reference_logprobs

from .test_prefixflow import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=5).eval()


def by_hand(model, ids: list[int]) -> list[float]:
    """log softmax of each position's logits, read at the next token: the definition, one token at a time."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return [float(torch.log_softmax(logits[t - 1], dim=-1)[ids[t]]) for t in range(1, len(ids))]


def test_every_next_token_with_nan_first(tiny):
    ids = np.random.default_rng(0).integers(0, 97, 30)
    with torch.no_grad():
        got = reference_logprobs(tiny, ids)
    assert got.dtype == torch.float32 and got.shape == (30,) and torch.isnan(got[0])
    assert got[1:].tolist() == pytest.approx(by_hand(tiny, ids.tolist()), abs=1e-5)
    assert (got[1:] < 0).all()


def test_chosen_positions_in_their_order(tiny):
    ids = list(np.random.default_rng(1).integers(0, 97, 25))
    with torch.no_grad():
        every = reference_logprobs(tiny, ids)
        chosen = reference_logprobs(tiny, torch.tensor(ids), [24, 1, 7])
        none = reference_logprobs(tiny, ids, [])
    assert chosen.tolist() == pytest.approx(every[[24, 1, 7]].tolist(), abs=1e-6)
    assert none.shape == (0,)
    with pytest.raises(TrainerError, match=r"positions must lie in 1\.\.24"):
        reference_logprobs(tiny, ids, [0, 3])
    with pytest.raises(TrainerError, match="one non-empty token sequence"):
        reference_logprobs(tiny, [[1, 2], [3, 4]])


def test_gradients_flow_unless_the_caller_turns_them_off(tiny):
    ids = list(range(1, 12))
    lp = reference_logprobs(tiny, ids, [5, 6])
    assert lp.requires_grad
    lp.sum().backward()
    assert tiny.model.embed_tokens.weight.grad.abs().max() > 0
    tiny.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert not reference_logprobs(tiny, ids).requires_grad


def test_float64_models_stay_float64():
    model = tiny_llama(seed=6, dtype=torch.float64).eval()
    assert reference_logprobs(model, [3, 4, 5], [2]).dtype == torch.float64


def test_loader_gives_a_float32_model_in_eval_mode(tmp_path):
    tiny_llama(seed=2).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("layout, needle", [
    ("missing", "is not a Hugging Face model folder (no config.json)"),
    ("empty", "is not a Hugging Face model folder (no config.json)"),
    ("config only", "cannot be loaded as a causal language model: Error no file named model.safetensors"),
    ("bad json", "cannot be loaded as a causal language model: It looks like the config file"),
])
def test_a_bad_folder_is_one_line(tmp_path, layout, needle):
    folder = tmp_path / "model"
    if layout != "missing":
        folder.mkdir()
    if layout == "config only":
        (folder / "config.json").write_text(json.dumps(tiny_llama().config.to_dict()))
    if layout == "bad json":
        (folder / "config.json").write_text("{not json")
    with pytest.raises(UnknownModelError) as info:
        load_model(folder)
    line = info.value.one_line()
    assert needle in line and "\n" not in line and info.value.exit_code == 2
