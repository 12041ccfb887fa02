"""One optimizer update's forward and backward, over any split of its rows.

A step's rollouts arrive as a :class:`StepBatch`: the token ids of each row, the kept tokens,
their loss coefficients (:func:`verbatim.trainer.objective.loss_coefficients`, normalised
over the update the row belongs to), π_old's log-probabilities (:func:`policy_values`, with the
policy's entropy at each model token, a step metric) and
each row's advantage, plus the groups of rows that share a task prompt.

:func:`backward_rows` accumulates into the parameters' ``.grad`` the gradient of
:func:`~verbatim.trainer.objective.objective_loss` over an update's rows. The rows of a group
that share a token prefix go through PrefixFlow (the prefix runs once); the others through
ordinary right-padded microbatches. The loss is a sum of per-row terms built from the batch's
precomputed per-row tensors, so every microbatch split, with or without PrefixFlow, gives
the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verbatim.errors import TrainerError
from verbatim.trainer.causal_lm import LearnerLM, PrefixCausalLM, sequence_logprobs
from verbatim.trainer.distributed.lockstep import CallShape
from verbatim.trainer.modes import KlEstimator, Offload
from verbatim.trainer.objective import objective_loss
from verbatim.trainer.packing import Microbatching, padding
from verbatim.trainer.passes import Agree, alone, idle_backward, idle_forward, idle_group
from verbatim.trainer.prefixflow import _pad, group_from_sequences, prefix_cut, prefixflow_backward
from verbatim.trainer.routing_replay import padded_experts


@dataclass(frozen=True, eq=False)
class StepBatch:
    """The rows of one training step, with everything their loss needs precomputed."""

    sequences: tuple[torch.Tensor, ...]
    """1-D int64 token ids per row, unpadded."""
    keep: torch.Tensor
    """(B, T) bool: the trained tokens (T = the longest row)."""
    coef: torch.Tensor
    """(B, T) float: the loss coefficients (0 off ``keep``)."""
    logp_old: torch.Tensor
    """(B, T) float32: π_old's log-probabilities on ``keep`` (detached)."""
    advantages: torch.Tensor
    """(B,): one advantage per row."""
    groups: tuple[tuple[int, ...], ...]
    """The rows of each group (rows sharing a task prompt): disjoint, covering every row."""
    logp_ref: torch.Tensor | None = None
    """(B, T) float32: the reference policy's log-probabilities on ``keep`` (detached), with ``kl_coef`` > 0."""
    kl_coef: float = 0.0
    """β of the penalty toward the reference (:mod:`verbatim.trainer.objective`); 0: none."""
    kl_estimator: KlEstimator = "k3"
    experts: tuple[torch.Tensor, ...] | None = None
    """Each row's routed experts to replay (tokens × MoE layers × k; :mod:`~verbatim.trainer.routing_replay`)."""

    def __post_init__(self) -> None:
        b = len(self.sequences)
        if b < 1:
            raise TrainerError("a step batch needs at least one row")
        lengths = _lengths(self.sequences)
        shape = (b, int(lengths.max()))
        if self.kl_coef > 0 and self.logp_ref is None:
            raise TrainerError("a step batch with a KL penalty needs the reference policy's logprobs")
        for name in ("keep", "coef", "logp_old", *(() if self.logp_ref is None else ("logp_ref",))):
            if tuple(getattr(self, name).shape) != shape:
                raise TrainerError(f"step batch {name} is {tuple(getattr(self, name).shape)}, expected {shape} "
                                   "(rows × longest row)")
        if tuple(self.advantages.shape) != (b,):
            raise TrainerError(f"step batch advantages are {tuple(self.advantages.shape)}, expected ({b},)")
        if self.keep.dtype != torch.bool:
            raise TrainerError(f"step batch keep must be bool, got {self.keep.dtype}")
        _check_mask(self.keep, lengths, "keep")
        covered = sorted(r for group in self.groups for r in group)
        if covered != list(range(b)):
            raise TrainerError(f"step batch groups must hold rows 0..{b - 1} once each, got {list(self.groups)}")

    @property
    def size(self) -> int:
        return len(self.sequences)


@dataclass(frozen=True, eq=False)
class PolicyValues:
    """A policy on a step's rows, without autograd: π_old (what the correction and the objective compare
    against, and how spread it was), or the reference policy of a KL penalty."""

    logprobs: torch.Tensor
    """(B, T) float32 log π of each token of the mask, 0 elsewhere."""
    entropy: torch.Tensor
    """(B, T) float32 entropy (nats) of π at the temperature before each token of the mask, 0 elsewhere."""


def policy_values(lm: PrefixCausalLM, sequences: Sequence[torch.Tensor], loss_mask: torch.Tensor,
                  microbatching: Microbatching = Microbatching(), agree: Agree = alone,
                  groups: Sequence[Sequence[int]] = (), prefixflow: bool = False,
                  experts: Sequence[torch.Tensor] | None = None) -> PolicyValues:
    """The log-probabilities and entropy of ``lm``'s policy where ``loss_mask`` is True, without autograd.

    With ``prefixflow``, the rows of each of ``groups`` that share a token prefix (as the update splits them:
    :func:`split_rows`) run it once, their suffixes in microbatches over its keys and values; the other rows
    go whole, in right-padded microbatches (``microbatching``). Rows without a masked token run no forward; on
    a team, idle forwards keep step with the other ranks (``agree``). The log-probabilities are what
    :meth:`~verbatim.trainer.causal_lm.LearnerLM.token_logprobs` gives (the same chunks of logits, bit for
    bit, on the whole-sequence path); the entropy is taken from those logits. ``experts``: each row's routed
    experts to replay.
    """
    lengths = _lengths(sequences)
    if tuple(loss_mask.shape) != (len(sequences), int(lengths.max())):
        raise TrainerError(f"loss mask is {tuple(loss_mask.shape)}, expected ({len(sequences)}, {int(lengths.max())})")
    _check_mask(loss_mask.bool(), lengths, "loss mask")
    learner_lm = lm if isinstance(lm, LearnerLM) else LearnerLM(lm)
    out = torch.zeros((2, *loss_mask.shape), dtype=torch.float32, device=sequences[0].device)
    masks = [loss_mask[i, : int(lengths[i])].bool() for i in range(len(sequences))]
    masked = [i for i in range(len(sequences)) if bool(masks[i].any())]
    work = split_rows(sequences, groups if prefixflow else [[i] for i in masked], masked, prefixflow, microbatching)
    agreed = agree(work.shape)
    with torch.no_grad():
        for slot, calls in enumerate(agreed.flows):
            mine = slot < len(work.flows)
            if mine:
                _flow_policy(learner_lm, sequences, masks, *work.flows[slot], out, experts)
            for _ in range(calls - len(work.flows[slot][1]) if mine else calls + 1):  # a slot: prefix + suffixes
                idle_forward(learner_lm)
        for slot in range(agreed.plain):
            if slot < len(work.plain):
                picked = list(work.plain[slot])
                values = _row_policy(learner_lm, [sequences[i] for i in picked], [masks[i] for i in picked],
                                     _picked(experts, picked))
                out[:, torch.tensor(picked, device=out.device), : values.shape[2]] = values
            else:
                idle_forward(learner_lm)
    return PolicyValues(logprobs=out[0], entropy=out[1])


def _flow_policy(lm: LearnerLM, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                 members: Sequence[int], splits: Sequence[Sequence[int]], out: torch.Tensor,
                 experts: Sequence[torch.Tensor] | None = None) -> None:
    """π and its entropy on ``members``' masked tokens, their shared prefix run once (into ``out``)."""
    rows = [sequences[r] for r in members]
    cut = prefix_cut(rows)
    prefix = rows[0][:cut][None]
    group = None if experts is None else group_from_sequences(rows, [masks[r] for r in members],
                                                              [experts[r] for r in members])
    hidden, kv = lm.hidden_states(prefix, keep_kv=True, experts=None if group is None else group.prefix_experts())
    own = torch.stack([masks[r][:cut] for r in members])
    positions = torch.nonzero(own.any(dim=0)).flatten()  # loss tokens inside the prefix (shared sampled tokens)
    if positions.numel():
        values = torch.stack(lm.token_logprobs_and_entropy(hidden[0, positions - 1], prefix[0, positions])).float()
        for k, r in enumerate(members):
            mine = own[k, positions]
            out[:, r, positions[mine]] = values[:, mine]
    boundary = hidden[:, -1:]  # predicts every suffix's first token
    for split in splits:
        picked = [members[k] for k in split]
        ids, suffix_masks = _pad([sequences[r][cut:] for r in picked], [masks[r][cut:] for r in picked])
        suffix_experts = None if group is None else group.suffix_experts(split, ids.shape[1])
        suffix_hidden, _ = lm.hidden_states(ids, start=cut, past=kv,  # one prefix copy serves every row
                                            experts=suffix_experts)
        states = torch.cat([boundary.expand(len(picked), 1, -1), suffix_hidden[:, :-1]], dim=1)
        r, s = torch.nonzero(suffix_masks, as_tuple=True)
        values = torch.stack(lm.token_logprobs_and_entropy(states[r, s], ids[r, s])).float()
        out[:, torch.tensor(picked, device=out.device)[r], s + cut] = values


@dataclass(frozen=True)
class RowWork:
    """One rank's calls for an update's rows: its PrefixFlow groups (batch rows, and phase B's microbatches
    as indices into them), most microbatches first, then its plain microbatches (batch rows)."""

    flows: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...] = ()
    plain: tuple[tuple[int, ...], ...] = ()
    padding: int = 0
    """Padded token slots over the microbatches (a PrefixFlow group's prefix counted once, unpadded)."""

    @property
    def shape(self) -> CallShape:
        return CallShape(tuple(len(splits) for _, splits in self.flows), len(self.plain))


def row_work(batch: StepBatch, rows: Sequence[int], prefixflow: bool, microbatching: Microbatching) -> RowWork:
    """Which of ``rows`` go through PrefixFlow and which as whole sequences (:func:`split_rows`), of those with a
    kept token (the others run no forward)."""
    chosen = _check_rows(batch, rows)
    trained = [r for r in sorted(chosen) if bool(batch.keep[r].any())]
    return split_rows(batch.sequences, batch.groups, trained, prefixflow, microbatching)


def split_rows(sequences: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], rows: Sequence[int],
               prefixflow: bool, microbatching: Microbatching) -> RowWork:
    """``rows``' calls: PrefixFlow for at least two rows of a group sharing a prefix that leaves each a suffix
    (``prefixflow``), their suffixes in microbatches; whole sequences in microbatches for the others."""
    wanted = set(rows)
    flows, plain, waste, grouped = [], [], 0, set()
    for group in groups:
        members = [r for r in group if r in wanted]
        grouped.update(members)
        chosen = [sequences[r] for r in members]
        cut = prefix_cut(chosen) if prefixflow and len(members) >= 2 else 0
        if cut >= 1:
            suffixes = [int(s.numel()) - cut for s in chosen]
            splits = microbatching.split(suffixes)
            waste += padding(suffixes, splits)
            flows.append((tuple(members), tuple(tuple(split) for split in splits)))
        else:
            plain += members
    plain += [r for r in rows if r not in grouped]
    lengths = [int(sequences[r].numel()) for r in plain]
    batches = microbatching.split(lengths)
    flows.sort(key=lambda flow: -len(flow[1]))  # stable: the groups' order among equals
    return RowWork(tuple(flows), tuple(tuple(plain[k] for k in b) for b in batches),
                   waste + padding(lengths, batches))


def backward_rows(lm: PrefixCausalLM, batch: StepBatch, rows: Sequence[int], clip_eps: float, *,
                  prefixflow: bool = True, microbatching: Microbatching = Microbatching(),
                  offload: Offload = "keep", agree: Agree = alone) -> float:
    """Add to ``.grad`` the gradient of the objective over ``rows`` (:func:`row_work`'s calls); return the
    summed loss."""
    return run_work(lm, batch, row_work(batch, rows, prefixflow, microbatching), clip_eps, offload, agree)


def run_work(lm: PrefixCausalLM, batch: StepBatch, work: RowWork, clip_eps: float, offload: Offload = "keep",
             agree: Agree = alone) -> float:
    """Make ``work``'s calls, then the idle calls that keep step with the team's agreed shape; return the
    summed loss."""
    agreed = agree(work.shape)
    total = 0.0
    for slot, suffix_calls in enumerate(agreed.flows):
        if slot < len(work.flows):
            members, splits = work.flows[slot]
            total += _flow_backward(lm, batch, list(members), splits, clip_eps, offload, suffix_calls - len(splits))
        else:
            idle_group(lm, suffix_calls, offload)
    for slot in range(agreed.plain):
        if slot < len(work.plain):
            total += _plain_backward(lm, batch, list(work.plain[slot]), clip_eps)
        else:
            idle_backward(lm)
    return total


def _flow_backward(lm: PrefixCausalLM, batch: StepBatch, members: list[int], splits: Sequence[Sequence[int]],
                   clip_eps: float, offload: Offload, idle: int) -> float:
    sequences = [batch.sequences[r] for r in members]
    group = group_from_sequences(sequences, [batch.keep[r, : s.numel()] for r, s in zip(members, sequences)],
                                 _picked(batch.experts, members))
    to_batch = torch.tensor(members, dtype=torch.long, device=batch.keep.device)

    def loss_fn(logprobs: torch.Tensor, group_rows: torch.Tensor) -> torch.Tensor:
        return _rows_loss(batch, to_batch[group_rows.to(to_batch.device)], logprobs, clip_eps)

    return prefixflow_backward(lm, group, loss_fn, splits, offload=offload, idle=idle)


def _plain_backward(lm: PrefixCausalLM, batch: StepBatch, rows: list[int], clip_eps: float) -> float:
    logprobs = _row_logprobs(lm, [batch.sequences[r] for r in rows],
                             [batch.keep[r, : batch.sequences[r].numel()] for r in rows], _picked(batch.experts, rows))
    index = torch.tensor(rows, dtype=torch.long, device=batch.keep.device)
    loss = _rows_loss(batch, index, logprobs, clip_eps)
    loss.backward()
    return float(loss.detach())


def _rows_loss(batch: StepBatch, index: torch.Tensor, logprobs: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """The objective of batch rows ``index`` for (b, w) logprobs in full-sequence coordinates."""
    w = logprobs.shape[1]
    ref = None if batch.logp_ref is None else batch.logp_ref[index, :w]
    return objective_loss(logprobs, batch.logp_old[index, :w], batch.advantages[index],
                          batch.coef[index, :w], batch.keep[index, :w], clip_eps, ref, batch.kl_coef,
                          batch.kl_estimator)


def _row_logprobs(lm: PrefixCausalLM, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                  experts: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """(b, width) log π on ``masks`` (0 elsewhere) of right-padded whole sequences, width = the longest."""
    ids, mask = _pad(sequences, masks)
    hidden, _ = lm.hidden_states(ids, experts=None if experts is None else padded_experts(list(experts), ids.shape[1]))
    r, t = torch.nonzero(mask, as_tuple=True)
    return sequence_logprobs(lm, hidden[r, t - 1], r, t, ids[r, t], mask.shape)


def _row_policy(lm: LearnerLM, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                experts: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """(2, b, width) float32: log π and the entropy of π on ``masks`` (0 elsewhere) of right-padded whole
    sequences, width = the longest."""
    ids, mask = _pad(sequences, masks)
    hidden, _ = lm.hidden_states(ids, experts=None if experts is None else padded_experts(list(experts), ids.shape[1]))
    r, t = torch.nonzero(mask, as_tuple=True)
    logprobs, entropy = lm.token_logprobs_and_entropy(hidden[r, t - 1], ids[r, t])
    out = torch.zeros((2, *mask.shape), dtype=torch.float32, device=ids.device)
    out[0, r, t] = logprobs.float()
    out[1, r, t] = entropy.float()
    return out


def _picked(experts: Sequence[torch.Tensor] | None, rows: Sequence[int]) -> list[torch.Tensor] | None:
    return None if experts is None else [experts[r] for r in rows]


def _lengths(sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    if not sequences:
        raise TrainerError("no sequences")
    for i, s in enumerate(sequences):
        if s.dim() != 1 or s.numel() < 1:
            raise TrainerError(f"row {i} must be a non-empty 1-D tensor of token ids, got shape {tuple(s.shape)}")
    return torch.tensor([int(s.numel()) for s in sequences], dtype=torch.long)


def _check_mask(mask: torch.Tensor, lengths: torch.Tensor, name: str) -> None:
    """Refuse a mask on a row's first token (no logprob) or past its end (padding)."""
    first = torch.nonzero(mask[:, 0]).flatten()
    if first.numel():
        raise TrainerError(f"row {int(first[0])}: the first token has no logprob and cannot be in the {name}")
    past_end = torch.arange(mask.shape[1])[None, :] >= lengths[:, None]
    bad = torch.nonzero((mask.cpu() & past_end).any(dim=1)).flatten()
    if bad.numel():
        raise TrainerError(f"row {int(bad[0])}: the {name} covers padding past the row's {int(lengths[bad[0]])} tokens")


def _check_rows(batch: StepBatch, rows: Sequence[int]) -> set[int]:
    chosen = [int(r) for r in rows]
    if len(set(chosen)) != len(chosen) or any(not 0 <= r < batch.size for r in chosen):
        raise TrainerError(f"update rows must be distinct rows of the batch (0..{batch.size - 1}), got {chosen}")
    return set(chosen)
