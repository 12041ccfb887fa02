"""``verbatim bench prefixflow --exactness``: PrefixFlow's gradients against full-sequence training's, measured.

Error metric, per parameter: max |g_PrefixFlow − g_full| / max |g_full|; the worst
parameter counts. The measurements, the settings of the exactness tests
(``tests/test_prefixflow.py``, ``tests/test_prefixflow_default_model.py``), each reported
with the bound its test holds it to: float32 and float64 on small random Llamas, float64
and float32 on the default model, and bfloat16 on random Llamas; and PrefixFlow against the plain
Hugging Face forward/backward (``trainer.reference.reference_backward``, which shares no code with
it), so an indexing bug shared by PrefixFlow and the full-sequence reference cannot pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.packing import microbatches
from verbatim.trainer.prefixflow import PrefixGroup, full_sequence_backward, prefixflow_backward

SECTION = "prefixflow-exactness"
VOCAB, SEQ = 97, 60
GROUP_SIZES, RATIOS = (1, 2, 8), (0.1, 0.5, 0.83, 0.95)


def tiny_llama(tied: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random 3-layer Llama small enough to run in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(dtype)


def make_group(group_size: int, ratio: float, loss_in_prefix: bool, seed: int = 0,
               seq: int = SEQ, vocab: int = VOCAB) -> PrefixGroup:
    """Uneven suffixes; the loss starts 2 tokens before the suffixes when ``loss_in_prefix``."""
    gen = torch.Generator().manual_seed(seed)
    p = max(1, round(ratio * seq))
    prefix = torch.randint(0, vocab, (p,), generator=gen)
    suffixes, masks = [], []
    for i in range(group_size):
        length = max(1, seq - p - (5 * i) % 7)
        suffixes.append(torch.randint(0, vocab, (length,), generator=gen))
        mask = torch.zeros(p + length, dtype=torch.bool)
        mask[max(1, p - 2) if loss_in_prefix else p:] = True
        masks.append(mask)
    return PrefixGroup(prefix=prefix, suffixes=tuple(suffixes), loss_masks=tuple(masks))


def rl_like_loss(group: PrefixGroup, seed: int = 1):
    """A per-row sum: signed per-token terms plus a nonlinear sequence-level term, global normaliser."""
    gen = torch.Generator().manual_seed(seed)
    width = max(group.prefix_len + s.numel() for s in group.suffixes)
    coef = torch.randn(group.size, width, generator=gen, dtype=torch.float64)
    advantage = torch.randn(group.size, generator=gen, dtype=torch.float64)
    tokens = torch.tensor([float(m.sum()) for m in group.loss_masks], dtype=torch.float64).clamp(min=1)
    total = float(tokens.sum())

    def loss_fn(logprobs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        c = coef[rows, : logprobs.shape[1]].to(logprobs)  # the logprobs' dtype and device (a GPU's too)
        mean_lp = logprobs.sum(dim=1) / tokens[rows].to(logprobs)
        sequence_term = advantage[rows].to(logprobs) * torch.exp(torch.clamp(mean_lp + 4.0, max=3.0))
        return ((c * logprobs).sum() + sequence_term.sum()) / total

    return loss_fn


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30)) for n in want)


@contextlib.contextmanager
def float64_norm() -> Iterator[None]:
    """Hugging Face's Llama RMSNorm computes in float32 even for float64 weights; keep float64 throughout."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = forward
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward = original


def _flow_vs_full(model: torch.nn.Module, group: PrefixGroup, splits_list: list) -> list[float]:
    lm, loss_fn = prefix_lm(model), rl_like_loss(group)
    model.zero_grad(set_to_none=True)
    full_sequence_backward(lm, group, loss_fn, [list(range(group.size))])
    want = grads_of(model)
    errors = []
    for splits in splits_list:
        prefixflow_backward(lm, group, loss_fn, splits)
        errors.append(max_rel_err(grads_of(model), want))
    return errors


def _flow_vs_hf(model: torch.nn.Module, group: PrefixGroup, splits: list) -> float:
    from verbatim.trainer.reference import reference_backward

    loss_fn = rl_like_loss(group)
    model.zero_grad(set_to_none=True)
    reference_backward(model, group, loss_fn)
    want = grads_of(model)
    prefixflow_backward(prefix_lm(model), group, loss_fn, splits)
    return max_rel_err(grads_of(model), want)


def _random_fp32_groups() -> Iterator[tuple[torch.nn.Module, int, PrefixGroup]]:
    """(model, G, group) over tied and untied embeddings × group sizes × prefix ratios."""
    for tied in (True, False):
        model = tiny_llama(tied=tied, seed=0 if tied else 3)
        for g in GROUP_SIZES:
            for r in RATIOS:
                yield model, g, make_group(g, r, loss_in_prefix=(g + int(r * 100)) % 2 == 0)


def random_fp32_vs_hf() -> list[float]:
    """Every random float32 group against the plain HF forward, one microbatch per sequence."""
    return [_flow_vs_hf(model, group, microbatches(g, 1)) for model, g, group in _random_fp32_groups()]


def random_fp32() -> list[float]:
    """Every random float32 group against full-sequence training, 4 microbatch splits each."""
    errors = []
    for model, g, group in _random_fp32_groups():
        splits = [microbatches(g, g), microbatches(g, 1), microbatches(g, 3), [list(range(g))[::-1]]]
        errors += _flow_vs_full(model, group, splits)
    return errors


def random_fp64(seeds: int = 3) -> list[float]:
    with float64_norm():
        return [e for seed in range(seeds)
                for e in _flow_vs_full(tiny_llama(seed=7 + seed, dtype=torch.float64),
                                       make_group(8, 0.5, loss_in_prefix=True, seed=7 + seed), [microbatches(8, 3)])]


def default_model(model_dir: Path) -> dict[str, float]:
    """The default model, 3 × 32 tokens, loss inside the prefix, in float32 then float64 (norm in float64)."""
    from verbatim.trainer.reference import load_model

    model = load_model(model_dir)
    lm = prefix_lm(model)
    group = make_group(3, 0.75, loss_in_prefix=True, seed=11, seq=32, vocab=model.config.vocab_size)
    loss_fn = rl_like_loss(group)
    everything, split = [[0, 1, 2]], [[2, 0], [1]]
    with float64_norm():
        full_sequence_backward(lm, group, loss_fn, everything)
        full32 = grads_of(model)
        full_sequence_backward(lm, group, loss_fn, split)
        full32_split = grads_of(model)
        prefixflow_backward(lm, group, loss_fn, split)
        flow32 = grads_of(model)
        model.double()
        full_sequence_backward(lm, group, loss_fn, everything)
        full64 = grads_of(model)
        prefixflow_backward(lm, group, loss_fn, split)
        flow64 = grads_of(model)
        fp64_hf = _flow_vs_hf(model, group, split)
    return {"fp64": max_rel_err(flow64, full64), "fp64_hf": fp64_hf, "fp32": max_rel_err(flow32, full32),
            "full32_vs_64": max_rel_err(full32, full64), "flow32_vs_64": max_rel_err(flow32, full64),
            "full32_split": max_rel_err(full32_split, full32)}


def random_bf16(seeds: int = 3) -> tuple[list[float], list[float]]:
    """PrefixFlow bf16 vs full bf16, and full bf16 vs full float32, over seeds × prefix ratios."""
    flow_err, bf16_err = [], []
    for seed in range(seeds):
        for ratio in RATIOS[1:]:
            model = tiny_llama(seed=seed, dtype=torch.bfloat16)
            group = make_group(8, ratio, loss_in_prefix=True, seed=seed)
            lm, loss_fn = prefix_lm(model), rl_like_loss(group)
            full_sequence_backward(lm, group, loss_fn, microbatches(8, 2))
            full_bf16 = grads_of(model)
            prefixflow_backward(lm, group, loss_fn, microbatches(8, 2))
            flow_err.append(max_rel_err(grads_of(model), full_bf16))
            model.float()
            full_sequence_backward(lm, group, loss_fn, microbatches(8, 2))
            bf16_err.append(max_rel_err(full_bf16, grads_of(model)))
    return flow_err, bf16_err


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{high:.1e}" if f"{low:.1e}" == f"{high:.1e}" else f"{low:.1e} – {high:.1e}"


def measure_table(model_dir: Path, command: str) -> str:
    """Every measurement, as the markdown table (and its provenance note) ``--write`` puts in docs/trainer.md."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors gain nothing from threads
    try:
        fp32, fp64, bf16 = random_fp32(), random_fp64(), random_bf16()
        fp32_hf = random_fp32_vs_hf()
        default = default_model(model_dir)
    finally:
        torch.set_num_threads(before)
    rows = [
        ("float32, random 3-layer Llama (tied and untied embeddings), G ∈ {1, 2, 8}, prefix ratios 0.1, 0.5, "
         "0.83, 0.95, uneven suffixes, loss inside and outside the prefix, 4 microbatch splits each",
         f"{_span(fp32)} ({len(fp32)} runs)", "1e-5", "`tests/test_prefixflow.py::test_fp32_gradients_equal_full_"
         "sequence_training`"),
        ("float32, random 3-layer Llama, the same groups, one sequence per microbatch: PrefixFlow vs the plain "
         "Hugging Face forward/backward (`reference_backward`, no code shared with PrefixFlow)",
         f"{_span(fp32_hf)} ({len(fp32_hf)} runs)", "1e-5",
         "`test_fp32_logprobs_and_gradients_equal_the_plain_hf_forward`"),
        ("float64, random Llama (RMSNorm kept in float64), G = 8, prefix ratio 0.5, 3 seeds",
         f"{_span(fp64)} ({len(fp64)} runs)", "1e-12",
         "`test_float64_exact_to_rounding`"),
        ("float64, default model (RMSNorm kept in float64)",
         f"{default['fp64']:.1e} (vs the plain HF forward: {default['fp64_hf']:.1e})", "1e-10",
         "`tests/test_prefixflow_default_model.py` (slow)"),
        ("float32, default model, 3 × 32 tokens, loss inside the prefix: PrefixFlow vs full",
         f"{default['fp32']:.1e} (full fp32 vs float64: {default['full32_vs_64']:.1e}; PrefixFlow fp32 vs "
         f"float64: {default['flow32_vs_64']:.1e}; full fp32 vs itself with another microbatch split: "
         f"{default['full32_split']:.1e})", "5 × full fp32's distance to float64", "same test"),
        ("bfloat16, random Llama, G = 8, prefix ratios 0.5, 0.83, 0.95, 3 seeds: PrefixFlow bf16 vs "
         "full-sequence bf16 (the test: r = 0.83, 2 seeds)",
         f"{_span(bf16[0])} ({len(bf16[0])} cases; full bf16 vs float32: {_span(bf16[1])})", "3e-2",
         "`test_bf16_tolerance_measured`"),
    ]
    lines = ["| setting | measured | test bound | test |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines) + (f"\n\nMeasured by `{command}` ({time.strftime('%Y-%m-%d')}, {model_dir.name} for "
                               "the default-model rows, one thread).")
