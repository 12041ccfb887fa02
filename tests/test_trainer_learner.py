"""The learner's step on synthetic traced rows of a tiny random Llama: what it moves, and by how much.

μ is the model's own log π (the plain Hugging Face forward), so each step is on-policy: every
model token is kept and the engine/trainer mismatch is rounding. The step's update is checked
against a hand-built one (AdamW on the gradient of ``policy_gradient_loss`` through
``reference_logprobs``), and PrefixFlow and the microbatch size must not change it.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from verbatim.bench.prefixflow_exactness import VOCAB, tiny_llama
from verbatim.datamodel import Source, TokenColumns
from verbatim.errors import InputError
from verbatim.trainer.advantages import group_advantages
from verbatim.trainer.batch import behaviour_batch
from verbatim.trainer.correction import correct, policy_gradient_loss
from verbatim.trainer.learner import Learner, scheduled_lr
from verbatim.trainer.learner_config import LearnerConfig, LossConfig
from verbatim.trainer.reference import reference_logprobs
from verbatim.trainer.step_input import StepInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR = 1e-3
NO_CLIP = 1e6  # a gradient-norm cap far above the tiny model's norms: clipping never bites



@pytest.fixture(scope="module")
def untied():
    return tiny_llama(tied=False, seed=0)


@pytest.fixture(scope="module")
def tied():
    return tiny_llama(tied=True, seed=1)


def segments(rng: np.random.Generator, prompt: np.ndarray, turns: int) -> list[tuple[np.ndarray, Source, int]]:
    """A multi-turn row: the group's prompt, then model and env segments of varied lengths."""
    out = [(prompt, Source.PROMPT, 0)]
    for turn in range(turns):
        out.append((rng.integers(0, VOCAB, int(rng.integers(2, 6))), Source.MODEL, turn))
        if turn + 1 < turns:
            out.append((rng.integers(0, VOCAB, 3), Source.ENV, turn + 1))
    return out


def traced(model: torch.nn.Module, parts: list[tuple[np.ndarray, Source, int]], version: int) -> TokenColumns:
    """Token columns as the harness writes them, with μ = the model's own log π on model tokens."""
    ids = np.concatenate([p for p, _, _ in parts]).astype(np.int64)
    source = np.concatenate([np.full(len(p), int(s)) for p, s, _ in parts])
    turn = np.concatenate([np.full(len(p), t) for p, _, t in parts])
    model_tokens = source == Source.MODEL
    with torch.no_grad():
        mu = reference_logprobs(model, ids).numpy()
    return TokenColumns(token_id=ids, source=source, logprob=np.where(model_tokens, mu, np.nan),
                        policy_version=np.where(model_tokens, version, -1), turn=turn)


def step_rows(model: torch.nn.Module, groups: int = 2, size: int | list[int] = 3, seed: int = 0, version: int = 0,
              rewards: list[list[float]] | None = None, prompt: int | list[int] = 7,
              apart: frozenset[int] = frozenset()) -> StepInput:
    """``groups`` groups of ``size`` rows (or each group's own size); each group's rows share a prompt of
    ``prompt`` tokens (or each group's own length), so PrefixFlow applies to a group of two or more, except the
    groups in ``apart``, whose rows draw a prompt each (trained as whole sequences)."""
    rng = np.random.default_rng(seed)
    columns, advantages, members = [], [], []
    sizes = size if isinstance(size, list) else [size] * groups
    prompts = prompt if isinstance(prompt, list) else [prompt] * groups
    for g in range(groups):
        prompt_ids = rng.integers(0, VOCAB, prompts[g])
        start = len(columns)
        for i in range(sizes[g]):
            own = rng.integers(0, VOCAB, prompts[g]) if g in apart else prompt_ids
            columns.append(traced(model, segments(rng, own, turns=1 + i % 2), version))
        group_rewards = rewards[g] if rewards is not None else rng.normal(size=sizes[g]).tolist()
        advantages += group_advantages(group_rewards, "grpo").tolist()
        members.append(list(range(start, len(columns))))
    return StepInput(columns=columns, advantages=np.asarray(advantages), groups=members)


def mean_entropy(model: torch.nn.Module, rows: StepInput) -> float:
    """The mean over the rows' model tokens of the entropy of ``model``'s policy (T = 1) before each."""
    values = []
    for columns in rows.columns:
        positions = torch.as_tensor(np.flatnonzero(columns.source == Source.MODEL))
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(columns.token_id)[None]).logits[0, positions - 1].double()
        policy = torch.softmax(logits, dim=-1)
        values.append(-(policy * policy.log()).sum(dim=-1))
    return float(torch.cat(values).mean())


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def stepped(model: torch.nn.Module, rows: StepInput, **config) -> tuple[Learner, dict]:
    learner = Learner(copy.deepcopy(model), LearnerConfig(**{"lr": LR, **config}))
    return learner, learner.train_step(rows)


def recording(model: torch.nn.Module, **config) -> tuple[Learner, list[dict[str, torch.Tensor]]]:
    """A learner on a copy of ``model`` and the gradients AdamW steps on (after clipping), per update."""
    learner = Learner(copy.deepcopy(model), LearnerConfig(**{"lr": LR, **config}))
    names = {id(p): n for n, p in learner.model.named_parameters()}
    updates: list[dict[str, torch.Tensor]] = []
    learner.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: updates.append({names[id(p)]: p.grad.clone() for g in opt.param_groups
                                                  for p in g["params"] if p.grad is not None}))
    return learner, updates


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Per parameter, max |a − b| within ``rel`` of max |b| (float32 sums in another order)."""
    assert set(a) == set(b)
    for name, expected in b.items():
        scale = float(expected.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(a[name], expected, rtol=0, atol=rel * scale, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


# -- one step ------------------------------------------------------------------------------------


def test_one_on_policy_step_moves_the_parameters(untied):
    rows = step_rows(untied)
    learner, metrics = stepped(untied, rows)
    before = params(untied)
    moved = [name for name, p in learner.model.named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) == len(before)  # every parameter is on the path of some kept model token
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    mask = behaviour_batch(rows.columns).loss_mask
    assert metrics["model_tokens"] == int(mask.sum()) > 0
    assert metrics["kept_tokens"] == metrics["model_tokens"]
    assert metrics["entropy"] == pytest.approx(mean_entropy(untied, rows), rel=1e-5)  # π_old's, per model token
    assert 0 < metrics["entropy"] < math.log(learner.vocab_size)
    assert (metrics["rows"], metrics["updates"], learner.version) == (6, 1, 1)
    every = metrics["correction"]["all"]
    assert every["tokens"] == metrics["model_tokens"]
    assert every["mean_abs_log_ratio"] < 1e-5
    assert every["dropped"]["any"] == 0.0
    assert list(metrics["correction"]["by_lag"]) == ["0"]


def test_a_step_with_no_rows_only_counts():
    learner = Learner(tiny_llama(), LearnerConfig(), version=3)
    before = params(learner.model)
    metrics = learner.train_step(StepInput(columns=[], advantages=np.zeros(0), groups=[]))
    assert (metrics["rows"], metrics["updates"], learner.version) == (0, 0, 4)
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())


@pytest.mark.parametrize("model_name", ["untied", "tied"])
def test_prefixflow_and_microbatch_do_not_change_the_step(model_name, request):
    """The same gradient reaches AdamW whichever way the rows run (AdamW's first step, about
    lr·g/(|g| + eps), magnifies rounding in entries with |g| near eps, so the gradients are compared)."""
    model = request.getfixturevalue(model_name)
    rows = step_rows(model, seed=2)
    base, base_grads = recording(model, prefixflow=True, microbatch=4, max_grad_norm=NO_CLIP)
    base.train_step(rows)
    for prefixflow, microbatch in ((False, 4), (True, 1), (False, 1), (True, 2)):
        other, grads = recording(model, prefixflow=prefixflow, microbatch=microbatch, max_grad_norm=NO_CLIP)
        other.train_step(rows)
        assert len(grads) == 1
        assert_same_grads(grads[0], base_grads[0])


@pytest.mark.parametrize("model_name", ["untied", "tied"])
def test_one_update_is_adamw_on_the_policy_gradient_through_the_plain_forward(model_name, request):
    """The hand-built step: π_old against μ gives the correction; −Σ w·A·log π / kept; AdamW; no clipping."""
    model = request.getfixturevalue(model_name)
    rows = step_rows(model, seed=3)
    learner, grads = recording(model, weight_decay=0.01, max_grad_norm=NO_CLIP, updates_per_step=1)
    learner.train_step(rows)

    reference = copy.deepcopy(model).train()
    batch = behaviour_batch(rows.columns)
    logp = torch.zeros(batch.loss_mask.shape)
    for i, n in enumerate(batch.lengths.tolist()):
        positions = torch.nonzero(batch.loss_mask[i]).flatten()
        logp = logp.index_put((torch.full_like(positions, i), positions),
                              reference_logprobs(reference, batch.token_ids[i, :n], positions))
    fix = correct(logp.detach(), batch.logp_mu, batch.loss_mask, batch.versions, 0, LearnerConfig().correction)
    policy_gradient_loss(logp, torch.as_tensor(rows.advantages, dtype=torch.float32), fix).backward()
    assert len(grads) == 1
    assert_same_grads(grads[0], {n: p.grad for n, p in reference.named_parameters()})
    # and the learner's parameters are AdamW(lr, weight decay) on the gradient it had: nothing else moved them
    for name, p in reference.named_parameters():
        p.grad = grads[0][name].clone()
    torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01).step()
    assert_same_params(learner.model, reference)


# -- the learning-rate schedule -------------------------------------------------------------------


@pytest.mark.parametrize("schedule,final,expected", [
    ("constant", 0.1, [1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", 0.0, [1.0, 0.75, 0.5, 0.25, 0.0]),
    ("linear", 0.2, [1.0, 0.8, 0.6, 0.4, 0.2]),
    ("cosine", 0.0, [1.0, 0.5 + 0.5 ** 1.5, 0.5, 0.5 - 0.5 ** 1.5, 0.0]),
    ("cosine", 0.1, [1.0, 0.1 + 0.9 * (0.5 + 0.5 ** 1.5), 0.55, 0.1 + 0.9 * (0.5 - 0.5 ** 1.5), 0.1]),
])
def test_the_schedule_goes_from_lr_at_the_first_step_to_lr_final_at_the_last(schedule, final, expected):
    config = LearnerConfig(lr=2.0, lr_schedule=schedule, lr_final=final)
    got = [scheduled_lr(config, k, 5) for k in range(5)]
    np.testing.assert_allclose(got, [2.0 * e for e in expected], rtol=1e-12, atol=1e-15)
    assert scheduled_lr(config, 0, 1) == 2.0  # a one-step run trains at lr


def test_each_step_trains_at_its_scheduled_rate(untied):
    rows = step_rows(untied, seed=5)
    learner = Learner(copy.deepcopy(untied), LearnerConfig(lr=LR, lr_schedule="linear", lr_final=0.5))
    seen = []
    learner.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    rates = [learner.train_step(rows, at=(k, 3))["lr"] for k in range(3)]
    np.testing.assert_allclose(rates, [LR, 0.75 * LR, 0.5 * LR], rtol=1e-12)
    assert seen == rates


# -- several updates per step ----------------------------------------------------------------------


def test_two_updates_take_two_optimizer_steps_over_consecutive_rows(untied):
    rows = step_rows(untied, seed=4)
    learner, metrics = stepped(untied, rows, updates_per_step=2)
    assert metrics["updates"] == 2 and learner.version == 1
    assert {int(state["step"]) for state in learner.optimizer.state.values()} == {2}
    assert metrics["grad_norm_max"] >= metrics["grad_norm"] > 0
    assert learner.update_splits(6) == [[0, 1, 2], [3, 4, 5]]
    assert learner.update_splits(5) == [[0, 1, 2], [3, 4]]
    assert learner.update_splits(2) == [[0], [1]]


def test_a_truncated_step_counts_the_sampled_tokens_outside_pis_mask(untied):
    """Top-k 1 keeps π's argmax only: random traced tokens mostly lie outside it, and none under top-k = vocab."""
    rows = step_rows(untied, seed=7)
    import dataclasses

    tight = Learner(copy.deepcopy(untied), LearnerConfig()).train_step(dataclasses.replace(rows, truncation=(1.0, 1)))
    loose = Learner(copy.deepcopy(untied), LearnerConfig()).train_step(
        dataclasses.replace(rows, truncation=(1.0, VOCAB)))
    assert tight["model_tokens"] > tight["outside_support"] > tight["model_tokens"] // 2
    assert loose["outside_support"] == 0
    assert "outside_support" not in Learner(copy.deepcopy(untied), LearnerConfig()).train_step(rows)


def test_a_step_with_fewer_rows_than_updates_takes_one_update_per_row(untied):
    """Errors may leave a step fewer rows than --updates-per-step: it trains (a --resume must get past it),
    one update per row, and its metrics say how many it took."""
    learner = Learner(copy.deepcopy(untied), LearnerConfig(updates_per_step=7))
    metrics = learner.train_step(step_rows(untied))
    assert metrics["rows"] == 6 and metrics["updates"] == 6
    assert {int(state["step"]) for state in learner.optimizer.state.values()} == {6}
    assert learner.update_splits(6) == [[0], [1], [2], [3], [4], [5]]
    assert learner.version == 1


# -- refusals and no-ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1000, -1])
def test_a_token_outside_the_vocabulary_is_refused_in_one_line(untied, bad_id):
    rows = step_rows(untied)
    first = rows.columns[0]
    ids = first.token_id.copy()
    ids[2] = bad_id  # a prompt token: no behaviour logprob to check, only the id
    columns = [TokenColumns(**{**first.as_dict(), "token_id": ids}), *rows.columns[1:]]
    learner = Learner(copy.deepcopy(untied), LearnerConfig())
    before = params(learner.model)
    with pytest.raises(InputError, match="vocabulary of 97") as caught:
        learner.train_step(StepInput(columns=columns, advantages=rows.advantages, groups=rows.groups))
    assert str(bad_id) in caught.value.one_line() and "\n" not in caught.value.one_line()
    assert learner.version == 0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equal_rewards_leave_every_parameter_where_it_was(untied, weight_decay):
    """All advantages 0: no row runs a backward, no parameter has a .grad, AdamW (decay included) skips them."""
    rows = step_rows(untied, rewards=[[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert not np.any(rows.advantages)
    learner, metrics = stepped(untied, rows, weight_decay=weight_decay)
    assert all(torch.equal(p, untied.get_parameter(n)) for n, p in learner.model.named_parameters())
    assert all(p.grad is None for p in learner.model.parameters())
    assert (metrics["loss"], metrics["grad_norm"], learner.version) == (0.0, 0.0, 1)
    assert metrics["kept_tokens"] == metrics["model_tokens"] > 0


def test_a_zero_advantage_group_changes_nothing_but_the_normaliser(untied):
    """Its rows run no forward, but their kept tokens count in the update's token normaliser."""
    rows = step_rows(untied, seed=5, rewards=[[0.0, 1.0, 3.0], [2.0, 2.0, 2.0]])
    only = StepInput(columns=rows.columns[:3], advantages=rows.advantages[:3], groups=[[0, 1, 2]])
    both, both_grads = recording(untied, max_grad_norm=NO_CLIP)
    metrics = both.train_step(rows)
    alone, alone_grads = recording(untied, max_grad_norm=NO_CLIP)
    kept_alone = alone.train_step(only)["kept_tokens"]
    scale = kept_alone / metrics["kept_tokens"]
    assert 0 < scale < 1
    assert_same_grads(both_grads[0], {n: g * scale for n, g in alone_grads[0].items()})


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_a_kl_penalty_pulls_toward_the_starting_weights_which_a_resume_keeps(untied, tmp_path, estimator):
    """From the reference's own weights the penalty is 0 and so is its pull; once the weights moved, a step
    of equal rewards (every advantage 0) still trains; the reference stays the starting model, also in a
    learner restored from a checkpoint of moved weights."""
    loss = LossConfig(kl_coef=0.5, kl_estimator=estimator)
    learner, grads = recording(untied, loss=loss, max_grad_norm=NO_CLIP)
    plain, plain_grads = recording(untied, max_grad_norm=NO_CLIP)
    first = learner.train_step(step_rows(untied))
    plain.train_step(step_rows(untied))
    assert first["kl_ref"] == 0.0  # π_old is the reference, token for token
    assert_same_grads(grads[0], plain_grads[0])  # the penalty's pull: β·(1 − e^d) or β·d, d ≈ 0 (rounding)
    equal = step_rows(untied, seed=7, rewards=[[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    second = learner.train_step(equal)
    assert second["kl_ref"] > 0 and second["grad_norm"] > 0 and second["loss"] > 0
    assert "kl_ref" not in plain.train_step(equal) and all(p.grad is None for p in plain.model.parameters())
    assert all(torch.equal(p, untied.get_parameter(n)) for n, p in learner.reference.named_parameters())
    assert all(not p.requires_grad for p in learner.reference.parameters()) and not learner.reference.training
    saved = learner.save(tmp_path, 2, {"version": learner.version})
    resumed = Learner(copy.deepcopy(untied), LearnerConfig(lr=LR, loss=loss))
    resumed.restore(saved)
    assert_same_params(resumed.model, learner.model)
    assert all(torch.equal(p, untied.get_parameter(n)) for n, p in resumed.reference.named_parameters())
    assert Learner(copy.deepcopy(untied), LearnerConfig(lr=LR)).reference is None  # no penalty, no copy


def test_tokens_past_the_version_lag_limit_are_dropped_and_not_trained(untied):
    rows = step_rows(untied, seed=6)  # sampled by version 0
    correction = {"max_version_lag": 1}
    learner = Learner(copy.deepcopy(untied), LearnerConfig(correction=correction), version=2)
    metrics = learner.train_step(rows)
    assert metrics["kept_tokens"] == 0 < metrics["model_tokens"]
    assert list(metrics["correction"]["by_lag"]) == ["2"] and metrics["correction"]["all"]["dropped"]["any"] == 1.0
    assert all(torch.equal(p, untied.get_parameter(n)) for n, p in learner.model.named_parameters())
    assert learner.version == 3
    behind, _ = stepped(untied, rows, correction=correction)  # the same rows at version 0 train
    assert behind.version == 1 and not torch.equal(behind.model.lm_head.weight, untied.lm_head.weight)


# -- weights for the engine ------------------------------------------------------------------------


def test_engine_weights_of_a_tied_model_leave_the_output_layer_to_the_embedding(tied):
    weights = Learner(copy.deepcopy(tied), LearnerConfig()).engine_weights()
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    state = tied.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(weights[n], state[n]) and not weights[n].requires_grad for n in weights)


def test_engine_weights_of_an_untied_model_hold_both(untied):
    learner = Learner(copy.deepcopy(untied), LearnerConfig())
    weights = learner.engine_weights()
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights)
    assert set(weights) == set(untied.state_dict())
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_weights_kept_in_one_shared_buffer_stay_the_optimizers_and_are_pushed_each_once(tied):
    """The engine's shared buffer (engine/weight_push.py): every parameter a view of one storage. The optimizer
    steps them in place (the buffer sees the step), and engine_weights still names each once."""
    from verbatim.engine.weight_push import WeightChannel

    learner = Learner(copy.deepcopy(tied), LearnerConfig(lr=LR))
    before = {n: t.clone() for n, t in learner.engine_weights().items()}
    channel = WeightChannel()
    try:
        views = channel.share(learner.engine_weights())
        params = list(learner.model.parameters())
        assert learner.keep_weights_in(views) == len(params)
        assert list(learner.model.parameters()) == params  # the same objects: the optimizer's state still fits
        weights = learner.engine_weights()
        assert set(weights) == set(before)  # one storage, yet every weight is there (tied output layer once)
        assert all(weights[n].data_ptr() == views[n].data_ptr() and torch.equal(weights[n], before[n])
                   for n in before)
        for p in params:
            p.grad = torch.ones_like(p)
        learner.optimizer.step()
        assert not torch.equal(views["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
        assert learner.model.lm_head.weight.data_ptr() == views["model.embed_tokens.weight"].data_ptr()
    finally:
        channel.close()


def test_a_shared_view_unlike_its_parameter_is_refused(untied):
    from verbatim.errors import TrainerError

    learner = Learner(copy.deepcopy(untied), LearnerConfig())
    views = {n: t.clone() for n, t in learner.engine_weights().items()}
    views["model.norm.weight"] = views["model.norm.weight"] + 1
    with pytest.raises(TrainerError, match="model.norm.weight"):
        learner.keep_weights_in(views)
