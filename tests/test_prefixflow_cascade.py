"""PrefixFlow's attention path: no per-row prefix copy, which calls take it, and per-layer checkpointing.

* What phase B saves for its backward, prefix-sized (a dimension of P or P + S): the prefix
  keys/values once, whatever the microbatch size; the cache path (the fallback) saves more with
  every row, which shows the measurement sees a copy when there is one.
* A family with a sliding window takes the attention path when the window covers the sequence, and is
  exact there against the plain Hugging Face forward/backward; soft-capping (Gemma 2) and shorter
  windows take the cache path (``tests/test_adapters.py`` checks those).
* ``checkpoint_layers=True``: the same gradients, through phase A's delayed backward (also with the
  prefix activations offloaded), with less kept between phase A and phase C.
"""

from __future__ import annotations

import pytest
import torch

from verbatim.bench.prefixflow_exactness import grads_of, make_group, max_rel_err, rl_like_loss, tiny_llama
from verbatim.errors import TrainerError
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.adapters.prefix_attention import ATTENTION, AttentionRun, prefix_attention
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefix_offload import DormantStore
from verbatim.trainer.prefixflow import (
    PrefixGroup,
    encode_prefix,
    full_sequence_backward,
    prefix_backward,
    prefixflow_backward,
)

from .test_adapters import SHAPE, against_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P, S = 41, 7  # no other dimension of the tiny model is 41 or 48


def saved_prefix_bytes(lm, state, rows: int, cache_path: bool = False) -> int:
    """Bytes of distinct storages phase B's forward saves for backward with a dimension of P or P + S."""
    seen: dict[int, int] = {}

    def pack(tensor):
        if P in tensor.shape or P + S in tensor.shape:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, 97, (rows, S), generator=torch.Generator().manual_seed(rows))
    positions = torch.arange(P, P + S).expand(rows, S)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cache_path:
            lm._through_cache(ids, positions, state.kv, keep_kv=False)
        else:
            lm.hidden_states(ids, start=P, past=state.kv)
    return sum(seen.values())


def test_phase_b_saves_the_prefix_once_whatever_the_microbatch():
    model = tiny_llama().train()
    lm = prefix_lm(model)
    group = PrefixGroup(torch.arange(P) % 97, (torch.arange(S),), (torch.zeros(P + S, dtype=torch.bool),))
    state = encode_prefix(lm, group)
    leaf_bytes = sum(t.untyped_storage().nbytes() for pair in state.kv for t in pair)
    assert lm.attention_path(P + S, state.kv)
    assert [saved_prefix_bytes(lm, state, rows) for rows in (1, 4, 8)] == [leaf_bytes] * 3
    copies = [saved_prefix_bytes(lm, state, rows, cache_path=True) for rows in (1, 4)]
    assert copies[1] > 3 * copies[0] > 3 * leaf_bytes  # the cache path copies per row and per query head


def windowed_model(model_type: str, window: int) -> torch.nn.Module:
    import transformers as hf

    made = {
        "mistral": lambda: hf.MistralConfig(**SHAPE, sliding_window=window),
        "phi3": lambda: hf.Phi3Config(**SHAPE, sliding_window=window, pad_token_id=0),
        "qwen2": lambda: hf.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=window, max_window_layers=1),
        "gemma3_text": lambda: hf.Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=window,
                                                   query_pre_attn_scalar=16),
        "gemma2": lambda: hf.Gemma2Config(**SHAPE, head_dim=16, sliding_window=window, attn_logit_softcapping=1.0,
                                          query_pre_attn_scalar=16),
    }
    torch.manual_seed(0)
    return hf.AutoModelForCausalLM.from_config(made[model_type]()).float().train()


@pytest.mark.parametrize("model_type", ["mistral", "phi3", "qwen2", "gemma3_text"])
def test_a_window_covering_the_sequence_takes_the_attention_path_exactly(model_type):
    model = windowed_model(model_type, window=64)
    lm = prefix_lm(model, 0.7)
    assert lm.attention_path(60) and not lm.attention_path(65)
    group = make_group(4, 0.6, loss_in_prefix=True, seed=1)  # 60 tokens
    errors = against_hf(model, lm, group, lambda lm, g, f: prefixflow_backward(lm, g, f, microbatches(4, 3)), 0.7)
    assert max(errors) <= 1e-5, errors


def test_a_window_covering_the_prefix_only_mixes_the_paths_exactly():
    """Phase A (36 tokens) on the attention path, phase B (60 tokens) on the cache path over the recorded K/V."""
    model = windowed_model("mistral", window=40)
    lm = prefix_lm(model)
    group = make_group(4, 0.6, loss_in_prefix=True, seed=2)
    assert lm.attention_path(group.prefix_len) and not lm.attention_path(60)
    errors = against_hf(model, lm, group, lambda lm, g, f: prefixflow_backward(lm, g, f, [[0, 1], [2, 3]]), 1.0)
    assert max(errors) <= 1e-5, errors


def test_soft_capped_attention_always_takes_the_cache_path():
    lm = prefix_lm(windowed_model("gemma2", window=64))
    assert not lm.attention_path(10)


def test_the_attention_refuses_what_it_cannot_compute_exactly():
    model = windowed_model("mistral", window=16)
    ids = torch.zeros(1, 20, dtype=torch.long)
    with prefix_attention(model, AttentionRun(capture={}, length=20)):
        with pytest.raises(TrainerError, match="cannot run layer 0 exactly"):
            model.model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == "sdpa"


def test_the_attention_implementation_is_set_for_the_call_only():
    model = tiny_llama().train()
    lm = prefix_lm(model)
    before = model.config._attn_implementation
    seen = []
    original = model.model.layers[0].self_attn.forward

    def spy(*args, **kwargs):
        seen.append(model.config._attn_implementation)
        return original(*args, **kwargs)

    model.model.layers[0].self_attn.forward = spy
    group = make_group(2, 0.5, loss_in_prefix=False)
    prefixflow_backward(lm, group, rl_like_loss(group), [[0, 1]])
    assert seen == [ATTENTION, ATTENTION] and model.config._attn_implementation == before


def flow_grads(model, group, checkpoint_layers, offload="keep", splits=None) -> tuple[dict, DormantStore]:
    lm = prefix_lm(model, checkpoint_layers=checkpoint_layers)
    model.zero_grad(set_to_none=True)
    stores = []
    original = DormantStore.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        stores.append(self)

    DormantStore.__init__ = keep
    try:
        prefixflow_backward(lm, group, rl_like_loss(group), splits or microbatches(group.size, 3), offload=offload,
                            offload_min_bytes=0)
    finally:
        DormantStore.__init__ = original
    return grads_of(model), stores[0]


@pytest.mark.parametrize("model_type", ["llama", "mistral-16"])
def test_checkpointed_layers_give_the_same_gradients_and_keep_less(model_type):
    model = tiny_llama().train() if model_type == "llama" else windowed_model("mistral", window=16)
    group = make_group(5, 0.6, loss_in_prefix=True, seed=3)
    want, plain_store = flow_grads(model, group, False, offload="disk")
    got, store = flow_grads(model, group, True, offload="disk")
    assert max_rel_err(got, want) <= 1e-6
    if model_type == "llama":  # the cache path (a window shorter than the sequence) is not checkpointed
        assert store.moved_bytes < plain_store.moved_bytes / 3
    lm = prefix_lm(model, checkpoint_layers=True)
    model.zero_grad(set_to_none=True)
    full_sequence_backward(lm, group, rl_like_loss(group), [[0, 1, 2], [3, 4]])
    assert max_rel_err(grads_of(model), want) <= 1e-5


@pytest.mark.parametrize("model_type", ["llama", "mistral-16"])
def test_a_recomputed_prefix_gives_the_same_gradients_and_keeps_no_graph(model_type):
    """``"recompute"``: phase A saves nothing for the backward (its outputs are plain leaves); phase C runs the prefix
    again with its graph. The gradients are the kept graph's, on the attention path and on the cache path."""
    model = tiny_llama(seed=6).train() if model_type == "llama" else windowed_model("mistral", window=16)
    group = make_group(4, 0.83, loss_in_prefix=True, seed=6)
    want, _ = flow_grads(model, group, False)
    got, _ = flow_grads(model, group, False, offload="recompute", splits=[[0, 1, 2], [3]])
    assert max_rel_err(got, want) <= 1e-6
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        state = encode_prefix(prefix_lm(model), group, "recompute")
    assert saved == [] and state.outputs == [] and all(leaf.is_leaf and leaf.requires_grad for leaf in state.leaves)
    prefix_backward(state)  # no suffix ran: recomputed all the same (a team's ranks make the same calls), adding 0
    assert state.leaves == [] and state.outputs == [] and state.reach is None
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_checkpointed_layers_with_the_prefix_on_disk():
    model = tiny_llama(seed=4).train()
    group = make_group(3, 0.83, loss_in_prefix=True, seed=4)
    want, _ = flow_grads(model, group, False)
    got, store = flow_grads(model, group, True, offload="disk", splits=[[0], [1, 2]])
    assert max_rel_err(got, want) <= 1e-6 and store.moved_bytes > 0


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_bfloat16_autocast_stays_within_the_bf16_bound(checkpoint_layers):
    """Under bfloat16 autocast (the learner's ``bf16``), attention computes in bfloat16 on both paths (query, keys
    and values cast as ``scaled_dot_product_attention`` casts them); PrefixFlow stays within the 3e-2 of the bf16
    exactness row of full bf16, and within 2.5× full bf16's own distance from float32."""
    model = tiny_llama().train()
    lm = prefix_lm(model, checkpoint_layers=checkpoint_layers)
    group = make_group(8, 0.83, loss_in_prefix=True, seed=1)
    loss_fn = rl_like_loss(group)
    model.zero_grad(set_to_none=True)
    full_sequence_backward(lm, group, loss_fn, [list(range(8))])
    fp32 = grads_of(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.zero_grad(set_to_none=True)
        full_sequence_backward(lm, group, loss_fn, [list(range(8))])
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        prefixflow_backward(lm, group, loss_fn, microbatches(8, 3))
    got = grads_of(model)
    assert max_rel_err(got, want) <= 3e-2
    assert max_rel_err(got, fp32) <= 2.5 * max_rel_err(want, fp32)
