"""The step's objective: coefficients, the clipped surrogate, and its gradient over any split of the rows.

The gradient tests run a tiny random Llama in float32. Error metric, per parameter (as in
tests/test_prefixflow.py): max |g − g_ref| / max |g_ref|, worst parameter, bound 1e-5.
"""

from __future__ import annotations

import itertools
import math

import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.bench.prefixflow_exactness import VOCAB, grads_of, max_rel_err, tiny_llama
from verbatim.errors import TrainerError
from verbatim.trainer import update
from verbatim.trainer.adapters import prefix_lm
from verbatim.trainer.correction import correct, policy_gradient_loss
from verbatim.trainer.learner_config import CorrectionConfig, LossConfig
from verbatim.trainer.objective import kl_penalty, loss_coefficients, objective_loss, surrogate, update_coefficients
from verbatim.trainer.packing import Microbatching
from verbatim.trainer.reference import reference_logprobs
from verbatim.trainer.update import StepBatch, backward_rows, policy_values

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BOUND = 1e-5
EPS = 0.2



@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


# ---------------------------------------------------------------------------
# A step: 4 groups, 9 rows
# ---------------------------------------------------------------------------

GROUPS = ((0, 1, 2), (3, 4, 5), (6,), (7, 8))
"""Group 0 shares a prompt (rows 0 and 1 also a first model turn); group 1 a prompt, row 5 keeps no
token; group 2 is a single row; group 3's rows share no first token (no prefix to reuse)."""
FLOW_GROUPS = 2  # groups 0 and 1 go through PrefixFlow


def step_rows(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Token ids and the model-token mask (from the prompt on, with some tokens dropped)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (n,), generator=gen)

    prompt0, turn0, prompt1 = ids(16), ids(6), ids(12)
    rows = [torch.cat([prompt0, turn0, ids(14)]), torch.cat([prompt0, turn0, ids(9)]),
            torch.cat([prompt0, ids(20)]),
            torch.cat([prompt1, ids(18)]), torch.cat([prompt1, ids(11)]), torch.cat([prompt1, ids(7)]),
            ids(25),
            torch.cat([torch.tensor([1]), ids(22)]), torch.cat([torch.tensor([2]), ids(19)])]
    prompt_len = [16, 16, 16, 12, 12, 12, 10, 8, 8]
    width = max(int(r.numel()) for r in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompt_len)):
        mask[i, p: row.numel()] = torch.rand(row.numel() - p, generator=gen) > 0.2
    mask[5] = False
    return rows, mask


def step_weights(keep: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Correction weights in [0.5, 2] on the kept tokens."""
    gen = torch.Generator().manual_seed(seed + 1)
    return (0.5 + 1.5 * torch.rand(keep.shape, generator=gen)) * keep


def make_batch(lm, normaliser="token", old_noise=0.4, updates=None, seed=0) -> StepBatch:
    """A StepBatch whose π_old is π perturbed by ±``old_noise`` so that the clip bites on some tokens."""
    sequences, keep = step_rows(seed)
    weights = step_weights(keep, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    noise = old_noise * (2 * torch.rand(keep.shape, generator=gen) - 1)
    logp_old = (policy_values(lm, sequences, keep, microbatching=Microbatching(4)).logprobs + noise) * keep
    advantages = torch.randn(len(sequences), generator=gen)
    updates = updates or [list(range(len(sequences)))]
    coef = update_coefficients(weights, keep, updates, normaliser)
    return StepBatch(sequences=tuple(sequences), keep=keep, coef=coef, logp_old=logp_old,
                     advantages=advantages, groups=GROUPS)


def gradient(model, batch, rows, microbatch: int | Microbatching = 4, **kw) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient and loss of ``rows``; ``microbatch``: rows a microbatch, or a :class:`Microbatching`."""
    model.zero_grad(set_to_none=True)
    kw["microbatching"] = microbatch if isinstance(microbatch, Microbatching) else Microbatching(microbatch)
    loss = backward_rows(prefix_lm(model), batch, rows, EPS, **kw)
    return grads_of(model), loss


def clipped_fraction(lm, batch) -> float:
    """Fraction of kept tokens whose ratio lies outside [1 − ε, 1 + ε]."""
    pi = policy_values(lm, batch.sequences, batch.keep).logprobs
    ratio = torch.exp(pi - batch.logp_old)[batch.keep]
    return float(((ratio < 1 - EPS) | (ratio > 1 + EPS)).float().mean())


# ---------------------------------------------------------------------------
# Gradients over microbatch splits, with and without PrefixFlow
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_every_split_with_and_without_prefixflow_gives_one_gradient(tiny, normaliser):
    lm = prefix_lm(tiny)
    batch = make_batch(lm, normaliser)
    assert 0.1 < clipped_fraction(lm, batch) < 0.9  # the clip is active on a good share of tokens
    rows = list(range(batch.size))
    want, want_loss = gradient(tiny, batch, rows, prefixflow=False, microbatch=batch.size)
    longest = max(int(s.numel()) for s in batch.sequences)
    budgets = [Microbatching(tokens=t) for t in (1, longest, 2 * longest + 1, 10 * longest)]  # 1: a row alone
    for prefixflow, microbatch in itertools.product((True, False), (1, 2, 3, batch.size, *budgets)):
        got, loss = gradient(tiny, batch, rows, prefixflow=prefixflow, microbatch=microbatch)
        assert max_rel_err(got, want) <= BOUND, (prefixflow, microbatch)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)


def test_prefixflow_runs_the_sharing_groups_and_skips_rows_without_kept_tokens(tiny, monkeypatch):
    """Groups 0 and 1 through PrefixFlow; row 5 (nothing kept) never runs a forward."""
    lm = prefix_lm(tiny)
    batch = make_batch(lm)
    flows, calls = [], []
    real_flow, real_hidden = update.prefixflow_backward, lm.hidden_states
    monkeypatch.setattr(update, "prefixflow_backward",
                        lambda lm_, group, *a, **k: flows.append(group.size) or real_flow(lm_, group, *a, **k))
    monkeypatch.setattr(lm, "hidden_states",
                        lambda ids, *a, **k: calls.append(ids.shape[0]) or real_hidden(ids, *a, **k))
    backward_rows(lm, batch, range(batch.size), EPS, microbatching=Microbatching(1))
    assert flows == [3, 2]
    # per PrefixFlow group one prefix forward and one per suffix; rows 6, 7, 8 as whole sequences
    assert calls == [1] * (1 + 3 + 1 + 2 + 3)
    calls.clear()
    backward_rows(lm, batch, range(batch.size), EPS, prefixflow=False, microbatching=Microbatching(1))
    assert len(calls) == batch.size - 1
    calls.clear()
    assert backward_rows(lm, batch, [5], EPS) == 0.0 and calls == []
    tiny.zero_grad(set_to_none=True)


def test_one_update_per_step_is_the_plain_policy_gradient(tiny):
    """logp_old = π detached: the gradient is policy_gradient_loss's, with π from the plain HF forward."""
    lm = prefix_lm(tiny)
    sequences, model_tokens = step_rows(seed=3)
    logp_old = policy_values(lm, sequences, model_tokens, microbatching=Microbatching(3)).logprobs
    gen = torch.Generator().manual_seed(4)
    logp_mu = (logp_old + 0.5 * torch.randn(logp_old.shape, generator=gen)).masked_fill(~model_tokens, float("nan"))
    versions = torch.zeros(model_tokens.shape, dtype=torch.int32).masked_fill(~model_tokens, -1)
    correction = correct(logp_old, logp_mu, model_tokens, versions, 0, CorrectionConfig(token_mask_band=(0.4, 2.5)))
    assert 0 < int((model_tokens & ~correction.keep).sum())  # the band drops some tokens
    advantages = torch.randn(len(sequences), generator=gen)
    batch = StepBatch(sequences=tuple(sequences), keep=correction.keep,
                      coef=loss_coefficients(correction.weights, correction.keep, "token"),
                      logp_old=logp_old, advantages=advantages, groups=GROUPS)
    got, _ = gradient(tiny, batch, range(batch.size), microbatching=Microbatching(2))

    logp_pi = torch.zeros(model_tokens.shape)
    for i, sequence in enumerate(sequences):
        positions = torch.nonzero(model_tokens[i]).flatten()
        if positions.numel():
            logp_pi = logp_pi.index_put((torch.full_like(positions, i), positions),
                                        reference_logprobs(tiny, sequence, positions))
    policy_gradient_loss(logp_pi, advantages, correction).backward()
    assert max_rel_err(got, grads_of(tiny)) <= BOUND


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_two_updates_each_normalised_over_its_own_rows(tiny, normaliser):
    """Rows of groups 0 and 1 are split across the updates; each update's gradient ignores the split."""
    lm = prefix_lm(tiny)
    updates = [[0, 3, 4, 6], [1, 2, 5, 7, 8]]
    batch = make_batch(lm, normaliser, updates=updates)
    _, keep = step_rows()
    weights = step_weights(keep)
    whole = loss_coefficients(weights, keep, normaliser)
    for rows in updates:
        alone = loss_coefficients(weights[rows], keep[rows], normaliser)
        assert torch.equal(batch.coef[rows], alone) and not torch.equal(alone, whole[rows])
    per_update = []
    for rows in updates:
        want, _ = gradient(tiny, batch, rows, prefixflow=False, microbatch=len(rows))
        for prefixflow, microbatch in ((True, 1), (True, 2), (False, 1)):
            got, _ = gradient(tiny, batch, rows, prefixflow=prefixflow, microbatch=microbatch)
            assert max_rel_err(got, want) <= BOUND
        per_update.append(want)
    if normaliser == "token":  # N1·g1 + N2·g2 = N·g over all rows with whole-step coefficients
        one = StepBatch(**{**batch.__dict__, "coef": whole})
        want, _ = gradient(tiny, one, range(batch.size), microbatch=batch.size, prefixflow=False)
        n = [float(keep[rows].sum()) for rows in updates]
        combined = {k: n[0] * per_update[0][k] + n[1] * per_update[1][k] for k in want}
        assert max_rel_err(combined, {k: v * float(keep.sum()) for k, v in want.items()}) <= BOUND


def test_old_logprobs_and_entropy_match_the_plain_forward_and_ignore_the_split(tiny):
    lm = prefix_lm(tiny)
    sequences, mask = step_rows()
    one = policy_values(lm, sequences, mask, microbatching=Microbatching(1))
    for values in (one.logprobs, one.entropy):
        assert values.dtype == torch.float32 and not values.requires_grad and bool((values[~mask] == 0).all())
    assert bool((one.logprobs[mask] < 0).all())
    assert bool((one.entropy[mask] > 0).all()) and bool((one.entropy[mask] <= math.log(VOCAB) + 1e-5).all())
    nine = policy_values(lm, sequences, mask, microbatching=Microbatching(9))
    torch.testing.assert_close(nine.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nine.entropy, one.entropy, rtol=1e-5, atol=1e-5)
    for i in (0, 6):
        positions = torch.nonzero(mask[i]).flatten()
        with torch.no_grad():
            want = reference_logprobs(tiny, sequences[i], positions)
            logits = tiny(input_ids=sequences[i][None]).logits[0, positions - 1].double()
        torch.testing.assert_close(one.logprobs[i, positions], want, rtol=1e-5, atol=1e-5)
        policy = torch.softmax(logits, dim=-1)
        entropy = -(policy * torch.log(policy)).sum(dim=-1)
        torch.testing.assert_close(one.entropy[i, positions].double(), entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [GROUPS, ((0, 1), (2,), (3, 4, 5), (6,), (7, 8))],
                         ids=["prompts shared", "a shared model turn in the prefix"])
@pytest.mark.parametrize("microbatch", [1, 9])
def test_old_logprobs_with_each_groups_prefix_run_once_equal_the_whole_sequences(tiny, groups, microbatch):
    """π_old under PrefixFlow: a group's shared prefix runs once and its suffixes over its keys and values; the
    values equal the whole-sequence pass's to float32 rounding, loss tokens inside the prefix (rows 0 and 1
    share a model turn) included, and the rows no group shares (and the row with no mask) as before."""
    lm = prefix_lm(tiny)
    sequences, mask = step_rows()
    want = policy_values(lm, sequences, mask, microbatching=Microbatching(9))
    got = policy_values(lm, sequences, mask, microbatching=Microbatching(microbatch), groups=groups,
                        prefixflow=True)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    assert bool((got.logprobs[~mask] == 0).all()) and bool((got.logprobs[mask] < 0).all())
    calls = {True: [], False: []}
    real = lm.hidden_states
    for flow in calls:
        lm.hidden_states = lambda ids, *a, flow=flow, **k: calls[flow].append(tuple(ids.shape)) or real(ids, *a, **k)
        try:
            policy_values(lm, sequences, mask, microbatching=Microbatching(1), groups=groups, prefixflow=flow)
        finally:
            del lm.hidden_states
    prefix = 22 if groups[0] == (0, 1) else 16
    assert (1, prefix) in calls[True]  # the shared prefix, once
    fed = {flow: sum(rows * width for rows, width in shapes) for flow, shapes in calls.items()}
    assert fed[True] <= fed[False] - prefix * (len(groups[0]) - 1)  # its other copies never ran


def test_entropy_is_of_the_policy_at_its_temperature_and_a_token_it_cannot_draw_adds_nothing():
    from verbatim.trainer.causal_lm import target_logprobs, target_logprobs_and_entropy

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0], [1.0, 2.0, float("-inf"), 0.5]])
    targets = torch.tensor([0, 1, 1])
    for temperature in (1.0, 0.7):
        logprobs, entropy = target_logprobs_and_entropy(logits, targets, temperature)
        assert torch.equal(logprobs, target_logprobs(logits, targets, temperature))  # the same values
        assert entropy[0].item() == pytest.approx(math.log(4))  # uniform at any temperature
        assert 0 <= entropy[1].item() < 1e-15 and math.isfinite(entropy[2].item())
        p = torch.softmax(torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64) / temperature, dim=0)
        assert entropy[2].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    assert target_logprobs_and_entropy(logits, targets, 2.0)[1][2] > target_logprobs_and_entropy(logits, targets,
                                                                                                 1.0)[1][2]


# ---------------------------------------------------------------------------
# The surrogate and the loss on plain tensors
# ---------------------------------------------------------------------------


def test_the_clip_zeroes_the_gradient_exactly_where_it_bites():
    """Exhaustive over the sign of A and ρ below, inside and above [1 − ε, 1 + ε]."""
    cases = list(itertools.product((1.0, -1.0), (0.5, 0.9, 1.0, 1.1, 1.5)))
    advantages = torch.tensor([a for a, _ in cases], dtype=torch.float64)
    ratios = torch.tensor([[r] for _, r in cases], dtype=torch.float64)
    logp_pi = torch.log(ratios).requires_grad_(True)
    logp_old = torch.zeros_like(ratios)
    coef = torch.full_like(ratios, 0.5)
    keep = torch.ones_like(ratios, dtype=torch.bool)
    loss = objective_loss(logp_pi, logp_old, advantages, coef, keep, EPS)
    loss.backward()
    for k, (a, r) in enumerate(cases):
        clipped = (a > 0 and r > 1 + EPS) or (a < 0 and r < 1 - EPS)
        want = 0.0 if clipped else -0.5 * a * r
        assert float(logp_pi.grad[k, 0]) == pytest.approx(want, abs=1e-12), (a, r)
    values = [min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a) for a, r in cases]
    assert float(loss.detach()) == pytest.approx(-0.5 * sum(values))
    torch.testing.assert_close(surrogate(torch.log(ratios), logp_old, advantages, EPS)[:, 0],
                               torch.tensor(values, dtype=torch.float64))


def test_positions_off_keep_contribute_exactly_zero_even_when_not_finite():
    logp_pi = torch.tensor([[-1.0, float("-inf"), float("nan")], [-2.0, -0.5, float("inf")]], requires_grad=True)
    logp_old = torch.tensor([[-1.0, float("nan"), 0.0], [-2.0, float("-inf"), 1.0]])
    keep = torch.tensor([[True, False, False], [True, False, False]])
    coef = torch.tensor([[1.0, float("nan"), 3.0], [0.5, 2.0, float("inf")]])
    loss = objective_loss(logp_pi, logp_old, torch.tensor([2.0, -1.0]), coef, keep, EPS)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 * 2.0 + 0.5 * -1.0))
    assert torch.equal(logp_pi.grad, torch.tensor([[-2.0, 0.0, 0.0], [0.5, 0.0, 0.0]]))


def test_objective_refuses_mismatched_shapes():
    with pytest.raises(TrainerError, match="objective needs"):
        objective_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3),
                       torch.ones(2, 3, dtype=torch.bool), EPS)


# ---------------------------------------------------------------------------
# Coefficients
# ---------------------------------------------------------------------------


def coefficients_by_hand(weights, keep, normaliser):
    rows, cols = len(keep), len(keep[0])
    kept = [sum(row) for row in keep]
    total, nonempty = max(1, sum(kept)), max(1, sum(1 for n in kept if n))
    out = [[0.0] * cols for _ in range(rows)]
    for i, j in itertools.product(range(rows), range(cols)):
        if keep[i][j]:
            out[i][j] = weights[i][j] / (total if normaliser == "token" else kept[i] * nonempty)
    return out


@pytest.mark.parametrize("normaliser", ["token", "sequence"])
def test_coefficients_over_every_keep_pattern_of_a_2x3_batch(normaliser):
    weights = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    for bits in itertools.product((False, True), repeat=6):
        keep = [list(bits[:3]), list(bits[3:])]
        got = loss_coefficients(torch.tensor(weights, dtype=torch.float64), torch.tensor(keep), normaliser)
        torch.testing.assert_close(got, torch.tensor(coefficients_by_hand(weights, keep, normaliser),
                                                     dtype=torch.float64), rtol=0, atol=1e-15)


def test_coefficients_by_hand_and_detached():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    weights = torch.ones(2, 3, requires_grad=True)
    token = loss_coefficients(weights, keep, "token")
    sequence = loss_coefficients(weights, keep, "sequence")
    assert not token.requires_grad and not sequence.requires_grad
    torch.testing.assert_close(token, torch.tensor([[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))
    torch.testing.assert_close(sequence, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]))


def test_update_coefficients_refuse_overlapping_updates():
    with pytest.raises(TrainerError, match="more than one update"):
        update_coefficients(torch.ones(3, 2), torch.ones(3, 2, dtype=torch.bool), [[0, 1], [1, 2]], "token")


KEEP_AND_WEIGHTS = st.integers(1, 5).flatmap(lambda b: st.integers(1, 6).flatmap(lambda t: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b),
    st.lists(st.lists(st.floats(0, 10), min_size=t, max_size=t), min_size=b, max_size=b))))


@settings(max_examples=150, deadline=None)
@given(KEEP_AND_WEIGHTS)
def test_token_coefficients_sum_to_the_kept_weight_over_the_kept_tokens(case):
    keep, weights = torch.tensor(case[0]), torch.tensor(case[1], dtype=torch.float64)
    n = max(1, int(keep.sum()))
    got = loss_coefficients(weights, keep, "token")
    assert float(got.sum()) == pytest.approx(float(weights[keep].sum()) / n, rel=1e-12, abs=1e-15)
    sequence = loss_coefficients(torch.ones_like(weights), keep, "sequence")  # unit weights: every row counts once
    assert float(sequence.sum()) == pytest.approx(1.0 if keep.any() else 0.0, rel=1e-12)


def test_loss_config_defaults_and_validation():
    cfg = LossConfig()
    assert (cfg.normaliser, cfg.clip_eps) == ("token", 0.2)
    with pytest.raises(pydantic.ValidationError):
        cfg.clip_eps = 0.3
    for bad in (dict(clip_eps=0.0), dict(clip_eps=1.0), dict(normaliser="row"), dict(extra=1)):
        with pytest.raises(pydantic.ValidationError):
            LossConfig(**bad)


# ---------------------------------------------------------------------------
# Bad batches
# ---------------------------------------------------------------------------


def test_bad_step_batches_and_rows_are_clear_errors(tiny):
    sequences, keep = step_rows()
    b, t = keep.shape
    fields = dict(sequences=tuple(sequences), keep=keep, coef=torch.zeros(b, t), logp_old=torch.zeros(b, t),
                  advantages=torch.zeros(b), groups=GROUPS)
    first = keep.clone()
    first[2, 0] = True
    padding = keep.clone()
    padding[5, -1] = True
    for change, message in [
        (dict(keep=first), "row 2: the first token has no logprob"),
        (dict(keep=padding), "row 5: the keep covers padding"),
        (dict(groups=GROUPS[:-1]), "once each"),
        (dict(groups=GROUPS + ((0,),)), "once each"),
        (dict(coef=torch.zeros(b, t + 1)), "coef is"),
        (dict(advantages=torch.zeros(b, 1)), "advantages are"),
        (dict(keep=keep.float()), "must be bool"),
    ]:
        with pytest.raises(TrainerError, match=message):
            StepBatch(**{**fields, **change})
    batch = StepBatch(**fields)
    for rows in ([0, 0], [9], [-1]):
        with pytest.raises(TrainerError, match="distinct rows"):
            backward_rows(prefix_lm(tiny), batch, rows, EPS)
    with pytest.raises(TrainerError, match="microbatch must be at least 1"):
        Microbatching(0)
    assert math.isfinite(backward_rows(prefix_lm(tiny), batch, [0], EPS))
    tiny.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------
# The KL penalty toward the reference policy
# ---------------------------------------------------------------------------


@given(st.floats(-6, 6), st.floats(-6, 6))
def test_each_kl_estimator_is_zero_at_the_reference_and_has_its_gradient(logp, ref):
    for estimator, slope in (("k3", 1 - math.exp(ref - logp)), ("k2", logp - ref)):
        pi = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
        value = kl_penalty(pi, torch.tensor([ref], dtype=torch.float64), estimator)
        value.sum().backward()
        assert value.item() >= 0 and pi.grad.item() == pytest.approx(slope, rel=1e-9, abs=1e-12)
    at = torch.tensor([logp], dtype=torch.float64)
    assert kl_penalty(at, at, "k3").item() == 0 and kl_penalty(at, at, "k2").item() == 0


def test_k3s_value_estimates_kl_pi_ref_and_its_gradient_is_the_other_direction():
    """Exact expectations over a 5-token policy: E_π[k3] = KL(π‖π_ref); E_π[∇k3] = ∇KL(π_ref‖π);
    E_π[∇k2] = ∇KL(π‖π_ref) (the gradients through the logits, as the trainer takes them)."""
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, 0.5, -0.5, 0.2], dtype=torch.float64), dim=0)
    log_pi = torch.log_softmax(logits, dim=0)
    pi = log_pi.exp().detach()

    def expected_grad(estimator: str) -> torch.Tensor:  # Σ_x π(x) ∇ k(log π(x)): the sampled tokens' mean
        return torch.autograd.grad((pi * kl_penalty(log_pi, ref, estimator)).sum(), logits, retain_graph=True)[0]

    def grad(value: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(value, logits, retain_graph=True)[0]

    forward_kl = (pi * (log_pi.detach() - ref)).sum()
    assert float((pi * kl_penalty(log_pi.detach(), ref, "k3")).sum()) == pytest.approx(float(forward_kl))
    torch.testing.assert_close(expected_grad("k3"), grad((ref.exp() * (ref - log_pi)).sum()))  # KL(π_ref‖π)
    torch.testing.assert_close(expected_grad("k2"), grad((log_pi.exp() * (log_pi - ref)).sum()))  # KL(π‖π_ref)


def test_the_penalty_adds_beta_times_its_weighted_gradient_and_nothing_off_keep():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, float("nan"), -0.1], [-0.3, -3.0, -2.5]], dtype=torch.float64)
    keep = torch.tensor([[True, False, True], [True, True, True]])
    coef = torch.tensor([[0.5, 9.0, 0.25], [1.0, 0.5, 2.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    for estimator in ("k3", "k2"):
        plain = objective_loss(logp, logp.detach(), advantages, coef, keep, EPS)
        with_kl = objective_loss(logp, logp.detach(), advantages, coef, keep, EPS, ref, 0.3, estimator)
        (g_plain,), (g_kl,) = torch.autograd.grad(plain, logp), torch.autograd.grad(with_kl, logp)
        d = torch.nan_to_num(ref) - logp.detach()
        slope = 1 - torch.exp(d) if estimator == "k3" else -d
        torch.testing.assert_close(g_kl - g_plain, torch.where(keep, 0.3 * coef * slope, 0.0))
        assert torch.isfinite(with_kl) and g_kl[0, 1] == 0  # the NaN reference sits off keep
    with pytest.raises(TrainerError, match="reference policy"):
        objective_loss(logp, logp.detach(), advantages, coef, keep, EPS, None, 0.3)


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_a_kl_penalty_is_one_gradient_over_every_split_and_the_plain_forwards(tiny, estimator):
    lm = prefix_lm(tiny)
    plain = make_batch(lm)
    noise = 0.5 * torch.randn(plain.keep.shape, generator=torch.Generator().manual_seed(9))
    batch = StepBatch(**{**plain.__dict__, "logp_ref": (plain.logp_old + noise) * plain.keep, "kl_coef": 0.7,
                         "kl_estimator": estimator})
    rows = list(range(batch.size))
    want, _ = gradient(tiny, batch, rows, prefixflow=False, microbatch=batch.size)
    for prefixflow, microbatch in ((True, 1), (True, 3), (False, 2)):
        got, _ = gradient(tiny, batch, rows, prefixflow=prefixflow, microbatch=microbatch)
        assert max_rel_err(got, want) <= BOUND, (prefixflow, microbatch)
    tiny.zero_grad(set_to_none=True)  # the objective on log π from the model's own full forward
    logp_pi = torch.zeros(batch.keep.shape)
    for i, sequence in enumerate(batch.sequences):
        positions = torch.nonzero(batch.keep[i]).flatten()
        if positions.numel():
            logp_pi = logp_pi.index_put((torch.full_like(positions, i), positions),
                                        reference_logprobs(tiny, sequence, positions))
    objective_loss(logp_pi, batch.logp_old, batch.advantages, batch.coef, batch.keep, EPS, batch.logp_ref, 0.7,
                   estimator).backward()
    assert max_rel_err(want, grads_of(tiny)) <= BOUND
    without, _ = gradient(tiny, plain, rows, prefixflow=False, microbatch=batch.size)
    assert max_rel_err(without, want) > 1e-3  # the penalty moved the gradient
