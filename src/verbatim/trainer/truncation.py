"""Sampled tokens π would not sample: the check of a run sampled under top-p/top-k masks.

Under top-k, or top-p < 1, vLLM samples from π at temperature T restricted to its k most likely
tokens, then to the smallest set of those whose probability reaches p, renormalised. The trainer
computes π on the whole vocabulary, so the importance ratio π/μ of such a step is off for every
token, and a sampled token outside what the mask would keep under the trainer's π is one π and μ
disagree about entirely (a changed weight, a rounding difference at the mask's edge). This module
counts those tokens; it does not correct for the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verbatim.trainer.causal_lm import PrefixCausalLM
from verbatim.trainer.packing import Microbatching
from verbatim.trainer.passes import Agree, alone, forwards, masked_batches
from verbatim.trainer.prefixflow import _pad
from verbatim.trainer.routing_replay import padded_experts


def outside_mask(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float,
                 top_k: int) -> torch.Tensor:
    """(n,) bool: whether each target lies outside the top-k / top-p set of softmax(logits / T) (per row)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    chosen = probs.gather(-1, targets[:, None].long())
    above = probs > chosen  # the tokens a mask keeps before the target
    outside = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    if top_k > 0:
        outside |= above.sum(dim=-1) >= top_k
        kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[:, -1:]
        kept = probs >= kth
    else:
        kept = torch.ones_like(probs, dtype=torch.bool)
    if top_p < 1:
        mass = (probs * kept).sum(dim=-1)
        outside |= (probs * above * kept).sum(dim=-1) / mass >= top_p
    return outside


def outside_support(lm: PrefixCausalLM, sequences: Sequence[torch.Tensor], loss_mask: torch.Tensor,
                    top_p: float, top_k: int, microbatching: Microbatching = Microbatching(), logit_rows: int = 0,
                    agree: Agree = alone, experts: Sequence[torch.Tensor] | None = None) -> int:
    """How many tokens of ``loss_mask`` lie outside the mask of π at ``lm.temperature`` (no autograd), the
    logits of ``logit_rows`` tokens at a time (0: a microbatch's at once); on a team, idle forwards keep
    step with the other ranks (``agree``); ``experts``: each row's routed experts to replay."""
    count = 0

    def visit(picked: list[int]) -> None:
        nonlocal count
        ids, mask = _pad([sequences[i] for i in picked], [loss_mask[i, : sequences[i].numel()] for i in picked])
        replay = None if experts is None else padded_experts([experts[i] for i in picked], ids.shape[1])
        hidden, _ = lm.hidden_states(ids, experts=replay)
        r, t = torch.nonzero(mask, as_tuple=True)
        count += _count_outside(lm, hidden[r, t - 1], ids[r, t], top_p, top_k, logit_rows)

    forwards(lm, masked_batches(sequences, loss_mask, microbatching), visit, agree)
    return count


def _count_outside(lm: PrefixCausalLM, states: torch.Tensor, targets: torch.Tensor, top_p: float, top_k: int,
                   logit_rows: int) -> int:
    n = int(targets.numel())
    step = logit_rows if logit_rows > 0 else max(1, n)
    return sum(int(outside_mask(lm.logits(states[i:i + step]), targets[i:i + step], lm.temperature, top_p,
                                top_k).sum()) for i in range(0, n, step))
