"""PrefixFlow exactness: its gradients equal full-sequence training's, parameter by parameter.

The model, group and loss builders are those `verbatim bench prefixflow --exactness` measures
with (bench/prefixflow_exactness.py), so the table in docs/trainer.md is of these settings.

Error metric, per parameter: max |g_prefixflow − g_full| / max |g_full|; the test takes the
worst parameter. fp32 must stay within 1e-5 on a small random Llama; float64 (with the
norm computed in float64) shows the algorithm is exact to rounding on the default model too.

Two references: ``full_sequence_backward`` (the same adapter, the same ``sequence_logprobs``)
and, independent of both, the plain Hugging Face forward ``model(ids).logits``
(``verbatim.trainer.reference``), which also checks PrefixFlow's logprobs column by column.
"""

from __future__ import annotations

import pytest
import torch

from verbatim.bench.prefixflow_exactness import (
    VOCAB,
    grads_of,
    make_group,
    max_rel_err,
    rl_like_loss,
    tiny_llama,
)
from verbatim.bench.prefixflow_exactness import float64_norm as keep_float64_norm
from verbatim.errors import TrainerError
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.causal_lm import dropout_settings
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefixflow import (
    PrefixGroup,
    encode_prefix,
    full_sequence_backward,
    group_from_sequences,
    prefix_backward,
    prefixflow_backward,
    shared_prefix_len,
    suffix_backward,
)
from verbatim.trainer.reference import reference_backward, reference_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def compare(model, group, loss_fn, splits_list, offload="keep", **kw) -> list[float]:
    lm = prefix_lm(model)
    model.zero_grad(set_to_none=True)
    want_loss = full_sequence_backward(lm, group, loss_fn, [list(range(group.size))])
    want = grads_of(model)
    errors = []
    for splits in splits_list:
        got_loss = prefixflow_backward(lm, group, loss_fn, splits, offload=offload, **kw)
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        errors.append(max_rel_err(grads_of(model), want))
    return errors


def recording(loss_fn, seen: dict[int, torch.Tensor]):
    """``loss_fn`` that also keeps the logprobs each group row was given (full-sequence coordinates)."""

    def wrapped(logprobs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        for k, row in enumerate(rows.tolist()):
            seen[row] = logprobs[k].detach().clone()
        return loss_fn(logprobs, rows)

    return wrapped


def logprob_rel_err(model, group: PrefixGroup, seen: dict[int, torch.Tensor]) -> float:
    """Max |lp_prefixflow − lp_hf| / max |lp_hf| over every column of every row (0 expected off the mask)."""
    worst, scale = 0.0, 0.0
    with torch.no_grad():
        for i in range(group.size):
            sequence, mask = group.sequence(i), group.loss_masks[i]
            want = torch.zeros(seen[i].shape, dtype=torch.float64)
            positions = torch.nonzero(mask).flatten()
            want[positions] = reference_logprobs(model, sequence, positions).double()
            worst = max(worst, float((seen[i].double() - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
    return worst / scale if scale > 0 else worst


def compare_with_hf(model, group, loss_fn, splits) -> tuple[float, float]:
    """PrefixFlow against the plain Hugging Face forward/backward: (logprob error, gradient error)."""
    model.zero_grad(set_to_none=True)
    want_loss = reference_backward(model, group, loss_fn)
    want = grads_of(model)
    seen: dict[int, torch.Tensor] = {}
    got_loss = prefixflow_backward(prefix_lm(model), group, recording(loss_fn, seen), splits)
    assert sorted(seen) == list(range(group.size))
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    return logprob_rel_err(model, group, seen), max_rel_err(grads_of(model), want)


@pytest.mark.parametrize("group_size", [1, 2, 8])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.83, 0.95])
def test_fp32_gradients_equal_full_sequence_training(tiny, group_size, ratio):
    group = make_group(group_size, ratio, loss_in_prefix=(group_size + int(ratio * 100)) % 2 == 0)
    splits_list = [microbatches(group_size, group_size), microbatches(group_size, 1),
                   microbatches(group_size, 3), [list(range(group_size))[::-1]]]
    errors = compare(tiny, group, rl_like_loss(group), splits_list)
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("group_size", [1, 8])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.95])
@pytest.mark.parametrize("loss_in_prefix", [False, True])
def test_fp32_logprobs_and_gradients_equal_the_plain_hf_forward(tiny, group_size, ratio, loss_in_prefix):
    group = make_group(group_size, ratio, loss_in_prefix, seed=group_size + int(ratio * 100))
    lp_err, grad_err = compare_with_hf(tiny, group, rl_like_loss(group), microbatches(group_size, 3))
    assert lp_err <= 1e-5 and grad_err <= 1e-5, (lp_err, grad_err)


def test_fp32_untied_and_boundary_only_equal_the_plain_hf_forward():
    model = tiny_llama(tied=False, seed=3)
    group = make_group(8, 0.83, loss_in_prefix=True, seed=4)
    assert max(compare_with_hf(model, group, rl_like_loss(group), [[5, 0, 2], [7, 1], [3, 4, 6]])) <= 1e-5
    p = group.prefix_len
    masks = tuple(torch.nn.functional.one_hot(torch.tensor(p), p + s.numel()).bool() for s in group.suffixes)
    boundary_only = PrefixGroup(group.prefix, group.suffixes, masks)
    assert max(compare_with_hf(model, boundary_only, rl_like_loss(boundary_only), microbatches(8, 3))) <= 1e-5


def test_fp32_untied_embeddings_and_loss_inside_the_prefix():
    model = tiny_llama(tied=False, seed=3)
    group = make_group(8, 0.83, loss_in_prefix=True, seed=4)
    assert max(compare(model, group, rl_like_loss(group), [[[5, 0, 2], [7, 1], [3, 4, 6]]])) <= 1e-5


def test_boundary_token_alone(tiny):
    """Only each suffix's first token is trained: its logprob comes from the prefix's last position."""
    group = make_group(4, 0.5, loss_in_prefix=False, seed=5)
    p = group.prefix_len
    masks = tuple(torch.nn.functional.one_hot(torch.tensor(p), p + s.numel()).bool() for s in group.suffixes)
    boundary_only = PrefixGroup(group.prefix, group.suffixes, masks)
    errors = compare(tiny, boundary_only, rl_like_loss(boundary_only), [microbatches(4, 3)])
    assert max(errors) <= 1e-5
    # and the prefix parameters really do get gradient from it
    lm = prefix_lm(tiny)
    prefixflow_backward(lm, boundary_only, rl_like_loss(boundary_only), [[0, 1, 2, 3]])
    assert grads_of(tiny)["model.layers.0.self_attn.k_proj.weight"].abs().max() > 0


@pytest.fixture
def float64_norm():
    """Hugging Face's Llama RMSNorm computes in float32 even for float64 weights; keep float64 throughout."""
    with keep_float64_norm():
        yield


def test_float64_exact_to_rounding(float64_norm):
    model = tiny_llama(seed=7, dtype=torch.float64)
    group = make_group(8, 0.5, loss_in_prefix=True, seed=7)
    assert max(compare(model, group, rl_like_loss(group), [microbatches(8, 3)])) <= 1e-12
    assert max(compare_with_hf(model, group, rl_like_loss(group), microbatches(8, 3))) <= 1e-12


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_prefix_activations_give_the_same_gradients(tiny, offload):
    group = make_group(4, 0.83, loss_in_prefix=True, seed=8)
    loss_fn = rl_like_loss(group)
    assert max(compare(tiny, group, loss_fn, [microbatches(4, 2)], offload=offload,
                       offload_min_bytes=0)) <= 1e-5
    lm = prefix_lm(tiny)
    state = encode_prefix(lm, group, offload, offload_min_bytes=0)
    directory = state.store._dir
    if offload == "disk":
        assert state.store.moved_bytes > 0 and any(directory.iterdir())
    else:  # already on the CPU: nothing to move
        assert state.store.moved_bytes == 0
    for rows in microbatches(4, 2):
        suffix_backward(lm, group, state, loss_fn, rows)
    prefix_backward(state)
    assert directory is None or not directory.exists()
    tiny.zero_grad(set_to_none=True)


def test_phase_a_keeps_one_copy_and_leaves_require_grad(tiny):
    group = make_group(8, 0.5, loss_in_prefix=False, seed=9)
    state = encode_prefix(prefix_lm(tiny), group)
    assert len(state.kv) == tiny.config.num_hidden_layers
    for keys, values in state.kv:
        assert keys.shape[0] == 1 and keys.shape[-2] == group.prefix_len and keys.is_leaf and keys.requires_grad
        assert values.shape == keys.shape and values.is_leaf
    assert state.boundary.shape == (tiny.config.hidden_size,) and state.loss_positions.numel() == 0
    prefix_backward(state)  # no suffix ran: nothing to propagate, nothing to fail
    # its backward still runs through every layer (a team's ranks make the same calls), adding 0 to each gradient
    layers = {name.split(".")[2] for name, p in tiny.named_parameters() if ".layers." in name and p.grad is not None}
    assert layers == {str(i) for i in range(tiny.config.num_hidden_layers)}
    assert all(p.grad is None or not p.grad.any() for p in tiny.parameters())
    tiny.zero_grad(set_to_none=True)


def test_bf16_tolerance_measured():
    """bf16: PrefixFlow vs full-sequence bf16 within 3e-2, and as close to fp32 as full bf16 is (2.5x)."""
    for seed in range(2):
        model = tiny_llama(seed=seed, dtype=torch.bfloat16)
        group = make_group(8, 0.83, loss_in_prefix=True, seed=seed)
        loss_fn = rl_like_loss(group)
        lm = prefix_lm(model)
        full_sequence_backward(lm, group, loss_fn, microbatches(8, 2))
        full_bf16 = grads_of(model)
        prefixflow_backward(lm, group, loss_fn, microbatches(8, 2))
        flow_bf16 = grads_of(model)
        model.float()
        full_sequence_backward(lm, group, loss_fn, microbatches(8, 2))
        full_fp32 = grads_of(model)
        assert max_rel_err(flow_bf16, full_bf16) <= 3e-2
        assert max_rel_err(flow_bf16, full_fp32) <= 2.5 * max_rel_err(full_bf16, full_fp32)


def test_shared_prefix_found_token_for_token():
    a = torch.tensor([1, 2, 3, 4, 5])
    b = torch.tensor([1, 2, 3, 9])
    c = torch.tensor([1, 2, 7, 4, 5])
    assert shared_prefix_len([a, b]) == 3 and shared_prefix_len([a, b, c]) == 2 and shared_prefix_len([a]) == 5
    masks = [torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool), torch.tensor([0, 0, 0, 1], dtype=torch.bool)]
    group = group_from_sequences([a, b], masks)
    assert group.prefix.tolist() == [1, 2, 3] and [s.tolist() for s in group.suffixes] == [[4, 5], [9]]
    same = group_from_sequences([a, a.clone()], [masks[0], masks[0]])
    assert same.prefix_len == 4  # identical sequences still leave each suffix one token
    with pytest.raises(TrainerError, match="share no prefix"):
        group_from_sequences([a, torch.tensor([8, 2])], [masks[0], torch.tensor([False, True])])


def test_bad_groups_and_splits_are_clear_errors(tiny):
    prefix = torch.tensor([1, 2, 3])
    with pytest.raises(TrainerError, match="empty"):
        PrefixGroup(prefix, (torch.tensor([], dtype=torch.long),), (torch.zeros(3, dtype=torch.bool),))
    with pytest.raises(TrainerError, match="entries"):
        PrefixGroup(prefix, (torch.tensor([4]),), (torch.zeros(5, dtype=torch.bool),))
    with pytest.raises(TrainerError, match="first token"):
        PrefixGroup(prefix, (torch.tensor([4]),), (torch.ones(4, dtype=torch.bool),))
    group = make_group(3, 0.5, loss_in_prefix=False)
    with pytest.raises(TrainerError, match="once each"):
        prefixflow_backward(prefix_lm(tiny), group, rl_like_loss(group), [[0, 1], [1]])


def test_unknown_architecture_is_refused():
    class Config:
        model_type = "gpt2"

    class Model(torch.nn.Module):
        config = Config()

    with pytest.raises(TrainerError, match="no adapter for model type 'gpt2'"):
        prefix_lm(Model())


@pytest.mark.parametrize("setting", [{"attention_dropout": 0.1}, {"hidden_dropout": 0.2}])
def test_dropout_in_train_mode_is_refused(setting):
    """A shared prefix would carry one dropout mask for the whole group: not full-sequence training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, **setting)
    model = LlamaForCausalLM(config).train()
    assert dropout_settings(model) == setting
    group = make_group(2, 0.5, loss_in_prefix=False, seed=10)
    with pytest.raises(TrainerError, match="cannot train a model with dropout") as info:
        prefixflow_backward(prefix_lm(model), group, rl_like_loss(group), [[0, 1]])
    line = info.value.one_line()
    assert "\n" not in line and f"{next(iter(setting))}=" in line and "one dropout mask" in line
    assert all(p.grad is None for p in model.parameters())
    model.eval()  # dropout off: training through the adapter is allowed
    prefixflow_backward(prefix_lm(model), group, rl_like_loss(group), [[0, 1]])
    assert any(p.grad is not None for p in model.parameters())


def test_dropout_modules_are_found_and_zero_dropout_is_not_refused(tiny):
    assert dropout_settings(tiny) == {}
    wrapped = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Dropout(0.0))
    assert dropout_settings(wrapped) == {"1": pytest.approx(0.3)}
