"""Each family's PrefixFlow adapter, and the plain path, against the plain Hugging Face forward/backward.

For every registered family a small random model is built from the family's own config class
(3 layers, grouped-query attention, sliding windows shorter than the sequences where the family has
them), and PrefixFlow's logprobs (every column of every row) and every parameter's gradient are
compared with ``reference_backward`` (each sequence alone through ``model(ids).logits``, no code shared
with the adapters), in float32, to the 1e-5 of docs/trainer.md, at temperature 1 and at 0.7. The
plain path (:class:`PlainCausalLM`, the path of a family without an adapter) is held to the same.
"""

from __future__ import annotations

import pytest
import torch

from verbatim.bench.prefixflow_exactness import grads_of, make_group, max_rel_err, rl_like_loss
from verbatim.errors import TrainerError
from verbatim.trainer.adapters import ADAPTERS, prefix_lm, trainer_lm
from verbatim.trainer.causal_lm import PlainCausalLM
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefixflow import full_sequence_backward, prefixflow_backward
from verbatim.trainer.reference import reference_backward, reference_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, WINDOW = 97, 16
TOLERANCE = 1e-5  # docs/trainer.md, the float32 exactness rows
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0)


def family_config(model_type: str):
    """A small config of the family's own class; windows shorter than the test sequences (60 tokens)."""
    import transformers as hf

    head = {"head_dim": 16}
    window = {"sliding_window": WINDOW}
    caps = {"final_logit_softcapping": 0.5, "attn_logit_softcapping": 1.0}  # low enough to bend a random model's
    # logits (about ±0.5): at the families' 30 and 50 a missing cap would pass unnoticed
    made = {
        "llama": lambda: hf.LlamaConfig(**SHAPE),
        "qwen2": lambda: hf.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1),
        "qwen3": lambda: hf.Qwen3Config(**SHAPE, **head),
        "qwen3_moe": lambda: hf.Qwen3MoeConfig(**SHAPE, **head, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, decoder_sparse_step=1),
        "mistral": lambda: hf.MistralConfig(**SHAPE, **window),
        "phi3": lambda: hf.Phi3Config(**SHAPE, **window, pad_token_id=0),
        "gemma2": lambda: hf.Gemma2Config(**SHAPE, **head, **window, **caps, query_pre_attn_scalar=16),
        "gemma3_text": lambda: hf.Gemma3TextConfig(**SHAPE, **head, **window, **caps, query_pre_attn_scalar=16),
    }
    return made[model_type]()


def family_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(model_type)).float()


def test_every_registered_family_is_tested_here():
    assert sorted(ADAPTERS) == sorted(FAMILIES)


FAMILIES = ["gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe"]


def seen_logprob_err(model, group, seen, temperature) -> float:
    worst, scale = 0.0, 0.0
    with torch.no_grad():
        for i in range(group.size):
            positions = torch.nonzero(group.loss_masks[i]).flatten()
            want = torch.zeros(seen[i].shape, dtype=torch.float64)
            want[positions] = reference_logprobs(model, group.sequence(i), positions, temperature).double()
            worst = max(worst, float((seen[i].double() - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
    return worst / scale


def against_hf(model, lm, group, backward, temperature) -> tuple[float, float]:
    """(logprob error, gradient error) of ``backward(lm, group, loss_fn)`` against the plain HF forward."""
    loss_fn = rl_like_loss(group)
    model.zero_grad(set_to_none=True)
    want_loss = reference_backward(model, group, loss_fn, temperature)
    want = grads_of(model)
    seen: dict[int, torch.Tensor] = {}

    def recording(logprobs, rows):
        for k, row in enumerate(rows.tolist()):
            seen[row] = logprobs[k].detach().clone()
        return loss_fn(logprobs, rows)

    got_loss = backward(lm, group, recording)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    return seen_logprob_err(model, group, seen, temperature), max_rel_err(grads_of(model), want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_prefixflow_equals_the_plain_hf_forward_and_backward(model_type, temperature):
    model = family_model(model_type).train()
    assert model.config.model_type == model_type
    group = make_group(4, 0.6, loss_in_prefix=True, seed=1)  # a 36-token prefix, 60 tokens: past every window
    lm = prefix_lm(model, temperature)
    errors = against_hf(model, lm, group, lambda lm, g, f: prefixflow_backward(lm, g, f, microbatches(4, 3)),
                        temperature)
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe", "mistral"])
def test_the_plain_path_equals_the_plain_hf_forward_and_backward(model_type):
    model = family_model(model_type, seed=2).train()
    group = make_group(3, 0.5, loss_in_prefix=False, seed=2)
    lm = PlainCausalLM(model, temperature=1.3)
    errors = against_hf(model, lm, group, lambda lm, g, f: full_sequence_backward(lm, g, f, [[0, 2], [1]]), 1.3)
    assert max(errors) <= TOLERANCE, errors


def test_the_soft_cap_is_applied():
    """Gemma 2 soft-caps its final logits: without the cap, the adapter's logprobs would not be the model's."""
    model = family_model("gemma2").eval()
    assert model.config.final_logit_softcapping
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    lm = prefix_lm(model)
    hidden, _ = lm.hidden_states(ids)
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(hidden[0]), model(ids).logits[0], rtol=1e-5, atol=1e-5)
        assert (lm.lm_head(hidden[0]) - model(ids).logits[0]).abs().max() > 1e-2


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def test_a_family_without_an_adapter_takes_the_plain_path_by_default_and_refuses_prefixflow():
    model = gpt2()
    lm, path = trainer_lm(model, None, 0.7)
    assert path == "plain" and isinstance(lm, PlainCausalLM) and lm.temperature == 0.7
    assert trainer_lm(family_model("qwen3"), None)[1] == "prefixflow"
    assert trainer_lm(family_model("qwen3"), False)[1] == "plain"
    with pytest.raises(TrainerError, match=r"no adapter for model type 'gpt2' \(supported: gemma2, .*qwen3_moe\)"):
        trainer_lm(model, True)
    with pytest.raises(TrainerError, match="trains whole sequences only"):
        lm.hidden_states(torch.zeros(1, 3, dtype=torch.long), keep_kv=True)
