"""PrefixFlow: train a group of G sequences that share a token prefix, running the prefix once.

For sequences ``prefix + suffix_i`` (prefix length P, suffix lengths S_i ≥ 1), the
gradient of a loss that is a sum of per-sequence terms equals full-sequence training's,
computed in three phases (arXiv 2606.01143):

* **A** (:func:`encode_prefix`): one forward of the prefix, for one copy, keeping its
  per-layer keys/values, the final hidden state at position P−1 (the *boundary*: it
  predicts every suffix's first token) and the log-probabilities of loss tokens inside
  the prefix. Autograd keeps the graph; its dormant activations can wait on CPU or disk, or
  not be kept at all (``"recompute"``: phase A runs without a graph, phase C runs the prefix
  forward again with one, so during phase B the prefix holds only its keys/values).
* **B** (:func:`suffix_backward`): the suffixes in ordinary microbatches (any split),
  positions P.., attending to the prefix keys/values through *leaf* tensors that require
  grad. Each microbatch's backward fills the parameters' gradients for the suffix tokens
  and accumulates dK, dV, the boundary-state gradient and the prefix-logprob gradient
  on the leaves.
* **C** (:func:`prefix_backward`): one backward through the prefix graph with those
  accumulated gradients, adding the prefix's share to the parameters' gradients.

The loss is supplied as ``loss_fn(logprobs, rows)``: ``logprobs`` is (b, T) float32 in
full-sequence coordinates (column t = log π(token_t | tokens_<t), 0 outside the loss mask,
T = the longest sequence of the microbatch) and ``rows`` the (b,) group indices of the
microbatch's sequences. It must be a **sum of per-row terms** (normalise by group-wide
constants, never by microbatch statistics); then every split gives the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verbatim.errors import TrainerError
from verbatim.prefix_cache import common_prefix
from verbatim.trainer.causal_lm import KV, PrefixCausalLM, sequence_logprobs
from verbatim.trainer.modes import Offload
from verbatim.trainer.prefix_offload import DormantStore
from verbatim.trainer.routing_replay import padded_experts

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class PrefixGroup:
    """G sequences ``prefix + suffixes[i]`` with per-sequence loss masks of length P + S_i."""

    prefix: torch.Tensor
    suffixes: tuple[torch.Tensor, ...]
    loss_masks: tuple[torch.Tensor, ...]
    experts: tuple[torch.Tensor, ...] | None = None
    """Each sequence's routed experts to replay (``P + S_i`` × MoE layers × k): the prefix's are the first
    sequence's, once, for every sequence (:meth:`sequence_experts`)."""

    def __post_init__(self) -> None:
        if self.prefix.numel() < 1 or not self.suffixes:
            raise TrainerError("a prefix group needs a prefix of at least one token and one suffix")
        if len(self.loss_masks) != len(self.suffixes):
            raise TrainerError(f"{len(self.suffixes)} suffixes but {len(self.loss_masks)} loss masks")
        for i, (suffix, mask) in enumerate(zip(self.suffixes, self.loss_masks)):
            if suffix.numel() < 1:
                raise TrainerError(f"suffix {i} is empty: the prefix must leave every sequence a token")
            if mask.numel() != self.prefix_len + suffix.numel():
                raise TrainerError(f"loss mask {i} has {mask.numel()} entries for "
                                   f"{self.prefix_len + suffix.numel()} tokens")
            if bool(mask[0]):
                raise TrainerError(f"sequence {i}: the first token has no logprob and cannot be in the loss")

    @property
    def size(self) -> int:
        return len(self.suffixes)

    @property
    def prefix_len(self) -> int:
        return int(self.prefix.numel())

    def sequence(self, i: int) -> torch.Tensor:
        return torch.cat([self.prefix, self.suffixes[i]])

    def prefix_experts(self) -> torch.Tensor | None:
        """(1, P, layers, k): the prefix's experts to replay."""
        return None if self.experts is None else self.experts[0][None, :self.prefix_len]

    def suffix_experts(self, rows: Sequence[int], width: int) -> torch.Tensor | None:
        """(b, width, layers, k): ``rows``' suffixes' experts, padded."""
        if self.experts is None:
            return None
        return padded_experts([self.experts[i][self.prefix_len:] for i in rows], width)

    def sequence_experts(self, i: int) -> torch.Tensor | None:
        """Sequence ``i``'s experts as PrefixFlow replays them: the prefix's, then its own suffix's."""
        if self.experts is None:
            return None
        return torch.cat([self.experts[0][:self.prefix_len], self.experts[i][self.prefix_len:]])


def shared_prefix_len(sequences: Sequence[torch.Tensor]) -> int:
    """Length of the longest token-for-token common prefix of ``sequences`` (token ids, any device)."""
    return common_prefix([s.detach().cpu().numpy() for s in sequences])


def prefix_cut(sequences: Sequence[torch.Tensor]) -> int:
    """Where PrefixFlow splits ``sequences`` (at least one): their shared prefix, short of the shortest one's
    last token so every suffix keeps a token; below 1, they cannot be a prefix group."""
    return min(shared_prefix_len(sequences), min(int(s.numel()) for s in sequences) - 1)


def group_from_sequences(sequences: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor],
                         experts: Sequence[torch.Tensor] | None = None) -> PrefixGroup:
    """Split sequences at their shared prefix, leaving every suffix at least one token (with their routed
    experts to replay, where given)."""
    if not sequences:
        raise TrainerError("a prefix group needs at least one sequence")
    p = prefix_cut(sequences)
    if p < 1:
        raise TrainerError("the sequences share no prefix (or a sequence has a single token)")
    return PrefixGroup(prefix=sequences[0][:p].clone(), suffixes=tuple(s[p:].clone() for s in sequences),
                       loss_masks=tuple(m.bool() for m in loss_masks),
                       experts=None if experts is None else tuple(experts))


# ---------------------------------------------------------------------------
# Reference: full-sequence training
# ---------------------------------------------------------------------------


def full_sequence_backward(lm: PrefixCausalLM, group: PrefixGroup, loss_fn: LossFn,
                           splits: Sequence[Sequence[int]]) -> float:
    """Ordinary training of the G whole sequences (right-padded microbatches); returns the loss."""
    total = 0.0
    for rows in splits:
        ids, masks = _pad([group.sequence(i) for i in rows], [group.loss_masks[i] for i in rows])
        experts = None if group.experts is None else padded_experts([group.sequence_experts(i) for i in rows],
                                                                      ids.shape[1])
        hidden, _ = lm.hidden_states(ids, experts=experts)
        r, t = torch.nonzero(masks, as_tuple=True)
        logprobs = sequence_logprobs(lm, hidden[r, t - 1], r, t, ids[r, t], masks.shape)
        loss = loss_fn(logprobs, torch.tensor(rows))
        loss.backward()
        total += float(loss.detach())
    return total


# ---------------------------------------------------------------------------
# PrefixFlow
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class PrefixState:
    """Phase A's output: the prefix graph's outputs and the leaves phase B reads."""

    outputs: list[torch.Tensor]
    """Graph-connected: K and V per layer, the boundary state, the prefix-token logprobs (empty where
    phase C recomputes them)."""
    leaves: list[torch.Tensor]
    """Detached copies of ``outputs`` that require grad, in the same order."""
    loss_positions: torch.Tensor
    """Prefix positions (1..P−1) in any sequence's loss mask, in order."""
    store: DormantStore
    reach: torch.Tensor | None = None
    """Graph-connected: the sum of the prefix's last hidden states, which every layer feeds. Phase C's backward
    always runs through it (with a gradient of 0), so every layer's backward runs whichever leaves phase B
    reached: the same calls on every rank of a team (:mod:`verbatim.trainer.distributed.lockstep`)."""
    recompute: Callable[[], list[torch.Tensor]] | None = None
    """Phase A again, with its graph: how phase C gets ``outputs`` (and ``reach``) when phase A kept none."""

    @property
    def kv(self) -> KV:
        n = (len(self.leaves) - 2) // 2
        return [(self.leaves[2 * i], self.leaves[2 * i + 1]) for i in range(n)]

    @property
    def boundary(self) -> torch.Tensor:
        return self.leaves[-2]

    @property
    def prefix_logprobs(self) -> torch.Tensor:
        return self.leaves[-1]


def encode_prefix(lm: PrefixCausalLM, group: PrefixGroup, offload: Offload = "keep",
                  offload_min_bytes: int = 1 << 16) -> PrefixState:
    """Phase A: one forward of the prefix (one copy), graph kept.

    Its saved activations wait per ``offload`` (tensors under ``offload_min_bytes`` stay); with
    ``"recompute"`` the forward runs without a graph and :func:`prefix_backward` runs it again with one.
    """
    store = DormantStore(offload, lm.parameters(), min_bytes=offload_min_bytes)
    in_loss = torch.stack([m[: group.prefix_len] for m in group.loss_masks]).any(dim=0)
    positions = torch.nonzero(in_loss).flatten()

    def forward() -> list[torch.Tensor]:
        prefix = group.prefix[None]
        with store.saving():
            hidden, kv = lm.hidden_states(prefix, keep_kv=True, experts=group.prefix_experts())
            prefix_lp = sequence_logprobs(lm, hidden[0, positions - 1], torch.zeros_like(positions),
                                          positions, prefix[0, positions], (1, group.prefix_len))
        return [t for pair in kv for t in pair] + [hidden[0, -1], prefix_lp[0], hidden.sum()]

    if store.recomputes:
        with torch.no_grad():
            leaves = [t.requires_grad_(True) for t in forward()[:-1]]
        return PrefixState(outputs=[], leaves=leaves, loss_positions=positions, store=store, recompute=forward)
    outputs = forward()
    reach = outputs.pop()
    leaves = [t.detach().requires_grad_(True) for t in outputs]
    return PrefixState(outputs=outputs, leaves=leaves, loss_positions=positions, store=store, reach=reach)


def suffix_backward(lm: PrefixCausalLM, group: PrefixGroup, state: PrefixState, loss_fn: LossFn,
                    rows: Sequence[int]) -> float:
    """Phase B for one microbatch: forward + backward of its suffixes over the prefix leaves."""
    p, b = group.prefix_len, len(rows)
    suffix_ids, suffix_masks = _pad([group.suffixes[i] for i in rows],
                                    [group.loss_masks[i][p:] for i in rows])
    hidden, _ = lm.hidden_states(suffix_ids, start=p, past=state.kv,  # one prefix copy serves every row
                                 experts=group.suffix_experts(rows, suffix_ids.shape[1]))
    # predictor states: column 0 of a suffix is predicted by the boundary (position P-1)
    states = torch.cat([state.boundary.expand(b, 1, -1), hidden[:, :-1]], dim=1)
    r, s = torch.nonzero(suffix_masks, as_tuple=True)
    width = p + suffix_ids.shape[1]
    logprobs = sequence_logprobs(lm, states[r, s], r, s + p, suffix_ids[r, s], (b, width))
    prefix_masks = torch.stack([group.loss_masks[i][:p] for i in rows])[:, state.loss_positions]
    shared = state.prefix_logprobs[state.loss_positions].expand(b, -1) * prefix_masks
    if state.loss_positions.numel():
        every_row = torch.arange(b, device=shared.device)[:, None]
        logprobs = logprobs.index_put((every_row, state.loss_positions[None, :]), shared, accumulate=True)
    loss = loss_fn(logprobs, torch.tensor(list(rows)))
    # + 0 × every suffix state: the backward runs through every layer of this call even when the loss reads
    # only the boundary (the same calls on every rank of a team); it adds 0 to every gradient
    (loss + hidden.sum() * 0.0).backward()
    return float(loss.detach())


def prefix_backward(state: PrefixState) -> None:
    """Phase C: one backward through the prefix with the gradients accumulated on the leaves (and 0 through
    :attr:`PrefixState.reach`)."""
    try:
        if state.recompute is not None:
            state.outputs[:] = state.recompute()
            state.reach = state.outputs.pop()
        pairs = [(out, leaf.grad) for out, leaf in zip(state.outputs, state.leaves) if leaf.grad is not None]
        if state.reach is not None:
            pairs.append((state.reach, torch.zeros_like(state.reach)))
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
    finally:
        state.store.close()
        state.outputs.clear()
        state.leaves.clear()
        state.reach = None


def prefixflow_backward(lm: PrefixCausalLM, group: PrefixGroup, loss_fn: LossFn,
                        splits: Sequence[Sequence[int]], offload: Offload = "keep",
                        offload_min_bytes: int = 1 << 16, idle: int = 0) -> float:
    """Phases A, B (one call per microbatch in ``splits``, then ``idle`` suffix calls of the first row with a
    loss of zero, for a rank that keeps step with a team) and C; returns the summed loss."""
    rows_seen = sorted(i for rows in splits for i in rows)
    if rows_seen != list(range(group.size)):
        raise TrainerError(f"microbatches must cover rows 0..{group.size - 1} once each, got {list(splits)}")
    state = encode_prefix(lm, group, offload, offload_min_bytes)
    try:
        total = sum(suffix_backward(lm, group, state, loss_fn, rows) for rows in splits)
        for _ in range(idle):
            suffix_backward(lm, group, state, zero_loss, [0])
    except BaseException:
        state.store.close()
        raise
    prefix_backward(state)
    return total


def zero_loss(logprobs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A loss of zero that still reaches every logprob's graph (an idle call's)."""
    return logprobs.sum() * 0.0


def _pad(ids: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token ids (with 0) and loss masks (with False) to one (b, width) batch."""
    width = max(int(x.numel()) for x in ids)
    device = ids[0].device
    out_ids = torch.zeros(len(ids), width, dtype=torch.long, device=device)
    out_masks = torch.zeros(len(ids), width, dtype=torch.bool, device=device)
    for i, (x, m) in enumerate(zip(ids, masks)):
        out_ids[i, : x.numel()] = x
        out_masks[i, : m.numel()] = m.bool()
    return out_ids, out_masks
