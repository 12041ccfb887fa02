"""Rollout Routing Replay in the trainer, on a small random Qwen3-MoE: replaying the router's own choice changes
nothing; PrefixFlow with replay gives full-sequence training's (and the plain Hugging Face forward's) log-probs
and gradients at the float32 tolerance of docs/trainer.md; other experts change them; activation checkpointing
recomputes under the same replay; flips are counted; a MoE router it does not know is refused."""

from __future__ import annotations

import pytest
import torch
from test_adapters import TOLERANCE, family_model

from verbatim.bench.prefixflow_exactness import grads_of, make_group, max_rel_err, rl_like_loss
from verbatim.errors import TrainerError
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.causal_lm import PlainCausalLM
from verbatim.trainer.prefixflow import PrefixGroup, full_sequence_backward, prefixflow_backward
from verbatim.trainer.reference import reference_backward
from verbatim.trainer.routing_replay import counting_flips, padded_experts, replayed, routers

LAYERS, K, EXPERTS = 3, 2, 4


@pytest.fixture(scope="module")
def moe():
    return family_model("qwen3_moe", seed=1)


def own_experts(model, ids: torch.Tensor) -> torch.Tensor:
    """(rows, tokens, layers, k): what the model's routers choose for ``ids``."""
    seen = []
    hooks = [gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2].clone())) for gate in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(seen, dim=1).reshape(*ids.shape, LAYERS, K)


def other_experts(length: int, seed: int) -> torch.Tensor:
    """(length, layers, k): a random choice of k distinct experts per token-layer."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(length, LAYERS, EXPERTS, generator=gen).argsort(dim=-1)[..., :K]


def with_experts(group: PrefixGroup, seed: int) -> PrefixGroup:
    experts = tuple(other_experts(group.prefix_len + s.numel(), seed + i) for i, s in enumerate(group.suffixes))
    return PrefixGroup(prefix=group.prefix, suffixes=group.suffixes, loss_masks=group.loss_masks, experts=experts)


def test_replaying_the_routers_own_choice_changes_nothing(moe):
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    lm = PlainCausalLM(moe)
    with torch.no_grad():
        plain, _ = lm.hidden_states(ids)
        again, _ = lm.hidden_states(ids, experts=own_experts(moe, ids))
    assert torch.equal(plain, again)


@pytest.mark.parametrize("group_size,ratio", [(2, 0.5), (4, 0.83), (3, 0.1)])
def test_prefixflow_with_replay_equals_full_sequence_training_with_replay(moe, group_size, ratio):
    group = with_experts(make_group(group_size, ratio, loss_in_prefix=True, seed=group_size), seed=7)
    lm, loss_fn = prefix_lm(moe), rl_like_loss(group)
    moe.zero_grad(set_to_none=True)
    full_sequence_backward(lm, group, loss_fn, [list(range(group.size))])
    full = grads_of(moe)
    prefixflow_backward(lm, group, loss_fn, [[i] for i in range(group.size)])
    flow = grads_of(moe)
    assert max_rel_err(flow, full) <= TOLERANCE
    assert max_rel_err(flow, replayed_hf_grads(moe, group, loss_fn)) <= TOLERANCE
    unreplayed = PrefixGroup(prefix=group.prefix, suffixes=group.suffixes, loss_masks=group.loss_masks)
    prefixflow_backward(lm, unreplayed, loss_fn, [[i] for i in range(group.size)])
    assert max_rel_err(grads_of(moe), flow) > 1e-3  # other experts: another gradient (the check can fail)


def replayed_hf_grads(model, group: PrefixGroup, loss_fn) -> dict[str, torch.Tensor]:
    """The plain Hugging Face forward/backward of each sequence (trainer/reference.py), under the same replay."""
    for i in range(group.size):
        one = PrefixGroup(prefix=group.sequence(i)[:1], suffixes=(group.sequence(i)[1:],),
                          loss_masks=(group.loss_masks[i],))
        with replayed(model, group.sequence_experts(i)[None]):
            reference_backward(model, one, lambda logprobs, rows, i=i: loss_fn(logprobs, torch.tensor([i])))
    return grads_of(model)


def test_checkpointed_layers_recompute_under_the_same_replay(moe):
    group = with_experts(make_group(3, 0.5, loss_in_prefix=True, seed=4), seed=11)
    loss_fn = rl_like_loss(group)
    moe.train()
    try:
        prefixflow_backward(prefix_lm(moe), group, loss_fn, [[0, 1], [2]])
        plain = grads_of(moe)
        prefixflow_backward(prefix_lm(moe, checkpoint_layers=True), group, loss_fn, [[0, 1], [2]])
        assert max_rel_err(grads_of(moe), plain) <= TOLERANCE
    finally:
        moe.eval()


def test_flips_count_the_token_layers_routed_elsewhere(moe):
    ids = torch.randint(0, 97, (1, 25), generator=torch.Generator().manual_seed(3))
    own = own_experts(moe, ids)
    lm = PlainCausalLM(moe)
    with counting_flips() as same, torch.no_grad():
        lm.hidden_states(ids, experts=own)
    assert (same.replayed, same.flipped) == (25 * LAYERS, 0)
    forced = own.clone()
    forced[0, :10, 0] = (own[0, :10, 0] + 1) % EXPERTS  # layer 0, 10 tokens: one expert changed
    forced[0, :10, 0, 1] = torch.where(forced[0, :10, 0, 1] == forced[0, :10, 0, 0],
                                       (forced[0, :10, 0, 1] + 1) % EXPERTS, forced[0, :10, 0, 1])
    changed = int((forced[0, :, 0].sort(-1).values != own[0, :, 0].sort(-1).values).any(-1).sum())
    with counting_flips() as flips, torch.no_grad():
        lm.hidden_states(ids, experts=forced)
    assert flips.replayed == 25 * LAYERS and flips.flipped == changed > 0


def test_tokens_without_recorded_experts_keep_the_routers_choice(moe):
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    lm = PlainCausalLM(moe)
    none = padded_experts([other_experts(4, 1)], 12)  # 8 tokens padded with NO_EXPERT
    mixed = own_experts(moe, ids)
    mixed[0, :4] = none[0, :4]
    with torch.no_grad():
        a, _ = lm.hidden_states(ids, experts=none)
        b, _ = lm.hidden_states(ids, experts=mixed)
    assert torch.equal(a, b)


def test_replay_of_the_wrong_shape_and_unknown_routers_are_refused(moe):
    ids = torch.zeros((1, 5), dtype=torch.long)
    with pytest.raises(TrainerError, match="expected rows × tokens × 3 MoE layers"):
        PlainCausalLM(moe).hidden_states(ids, experts=torch.zeros((1, 5, 2, K), dtype=torch.long))

    class MixtralSparseMoeBlock(torch.nn.Module):
        pass

    other = torch.nn.Sequential(MixtralSparseMoeBlock())
    with pytest.raises(TrainerError, match="routing replay knows the routers Qwen3MoeTopKRouter"):
        routers(other)
    assert routers(family_model("llama")) == []


def test_the_mismatch_report_names_the_tokens_the_models_router_sends_elsewhere(moe):
    import numpy as np

    from verbatim.datamodel import Rollout, Source, TokenColumns, Turn
    from verbatim.trainer.mismatch import mismatch
    from verbatim.trainer.reference import reference_logprobs

    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(8))
    recorded = own_experts(moe, ids)
    recorded[0, 12, 1] = (recorded[0, 12, 1] + 1) % EXPERTS  # token 12, layer 1: another expert
    recorded[0, 12, 1, 1] = torch.where(recorded[0, 12, 1, 1] == recorded[0, 12, 1, 0],
                                        (recorded[0, 12, 1, 1] + 1) % EXPERTS, recorded[0, 12, 1, 1])
    with torch.no_grad(), replayed(moe, recorded):
        mu = reference_logprobs(moe, ids[0]).numpy()  # what an engine that routed so sampled with
    source = np.array([Source.PROMPT] * 10 + [Source.MODEL] * 10)
    tokens = TokenColumns(token_id=ids[0].numpy(), source=source, logprob=np.where(source == Source.MODEL, mu, np.nan),
                          policy_version=np.where(source == Source.MODEL, 0, -1), turn=np.zeros(20),
                          routed_experts=recorded[0].numpy())
    rollout = Rollout(run_id="r", group_id="g", rollout_id="x", tokens=tokens,
                      turns=(Turn(index=0, prompt_end=10, completion_end=20),))
    report = mismatch([rollout], moe)
    routing = report.routing
    assert routing["flipped_tokens"] == [["x", 12, 1]] and routing["flipped_token_layers"] == 1
    assert routing["token_layers"] == 20 * LAYERS
    assert routing["mean_abs_log_ratio_replayed"] < 1e-6 < report.mean_abs_log_ratio  # the replay closes the gap
    flips = report.per_rollout[0].flips  # what --save writes, and verbatim view colours
    assert flips[12] == 1 and flips.sum() == 1


def test_a_row_without_experts_for_a_token_its_loss_reads_is_refused_naming_it():
    import numpy as np

    from verbatim.datamodel import NO_EXPERT, Source, TokenColumns
    from verbatim.trainer.routing_replay import row_experts

    source = np.array([Source.PROMPT] * 4 + [Source.MODEL] * 3)
    experts = np.zeros((7, LAYERS, K), np.int16)
    experts[-1] = NO_EXPERT  # the last sampled token: never fed, read by no loss token
    columns = TokenColumns(token_id=np.arange(7), source=source, logprob=np.where(source == 2, -1.0, np.nan),
                           policy_version=np.where(source == 2, 0, -1), turn=np.zeros(7), routed_experts=experts)
    (replayed,) = row_experts([columns], torch.device("cpu"))
    assert replayed.shape == (7, LAYERS, K)
    holed = experts.copy()
    holed[2] = NO_EXPERT
    with pytest.raises(TrainerError, match=r"row 0 has no routed experts for token 2 \(of 6 its loss reads\)"):
        row_experts([TokenColumns(**columns.as_dict(), routed_experts=holed)], torch.device("cpu"))
    with pytest.raises(TrainerError, match="row 0 has no routed experts recorded"):
        row_experts([TokenColumns(**columns.as_dict())], torch.device("cpu"))
