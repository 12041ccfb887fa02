"""A pass of the trainer over a step's rows, as its calls through the model, and the idle calls a rank makes
to keep step with the others (:mod:`verbatim.trainer.distributed.lockstep`).

An idle call runs the model on one token (a group of one prefix token and one suffix token for a
PrefixFlow slot) with a loss of zero: every decoder layer's forward, and backward where the slot has one,
so FSDP makes the same collectives a real call makes, and every gradient it adds is 0. In one process
there is nothing to agree on and no idle call runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from verbatim.trainer.causal_lm import PrefixCausalLM, sequence_logprobs
from verbatim.trainer.distributed.lockstep import CallShape
from verbatim.trainer.modes import Offload
from verbatim.trainer.packing import Microbatching
from verbatim.trainer.prefixflow import PrefixGroup, prefixflow_backward, zero_loss

Agree = Callable[[CallShape], CallShape]
"""The team's agreement on a pass's shape (the identity in one process)."""


def alone(shape: CallShape) -> CallShape:
    return shape


def masked_batches(sequences: Sequence[torch.Tensor], loss_mask: torch.Tensor,
                   microbatching: Microbatching) -> list[list[int]]:
    """The rows with a token in ``loss_mask``, in microbatches (indices into ``sequences``)."""
    rows = [i for i in range(len(sequences)) if bool(loss_mask[i].any())]
    return [[rows[k] for k in batch] for batch in microbatching.split([int(sequences[i].numel()) for i in rows])]


def forwards(lm: PrefixCausalLM, batches: Sequence[Sequence[int]], visit: Callable[[list[int]], None],
             agree: Agree) -> None:
    """``visit`` each microbatch without autograd, then as many idle forwards as the team's shape asks."""
    agreed = agree(CallShape(plain=len(batches)))
    with torch.no_grad():
        for batch in batches:
            visit(list(batch))
        for _ in range(agreed.plain - len(batches)):
            idle_forward(lm)


def _one_token(lm: PrefixCausalLM, length: int) -> torch.Tensor:
    device = next(iter(lm.parameters())).device
    return torch.zeros((1, length), dtype=torch.long, device=device)


def idle_forward(lm: PrefixCausalLM) -> None:
    """One token through every layer, nothing kept."""
    lm.hidden_states(_one_token(lm, 1))


def idle_backward(lm: PrefixCausalLM) -> None:
    """A plain microbatch's forward and backward on two tokens with a loss of zero."""
    ids = _one_token(lm, 2)
    hidden, _ = lm.hidden_states(ids)
    rows, cols = torch.zeros(1, dtype=torch.long, device=ids.device), torch.ones(1, dtype=torch.long, device=ids.device)
    logprobs = sequence_logprobs(lm, hidden[0, :1], rows, cols, ids[0, 1:], (1, 2))
    zero_loss(logprobs, rows).backward()


def idle_group(lm: PrefixCausalLM, suffix_calls: int, offload: Offload) -> None:
    """A PrefixFlow slot with ``suffix_calls`` phase-B microbatches, on a prefix and a suffix of one token."""
    ids = _one_token(lm, 1)[0]
    mask = torch.tensor([False, True], device=ids.device)  # the suffix token in the loss: phase B reads the prefix
    group = PrefixGroup(prefix=ids, suffixes=(ids.clone(),), loss_masks=(mask,))
    prefixflow_backward(lm, group, zero_loss, [[0]], offload=offload, idle=suffix_calls - 1)
