"""Importance-ratio correction: every mode and edge, on hand-computed small cases."""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
import torch

from verbatim.datamodel import Source, TokenColumns
from verbatim.errors import TrainerError
from verbatim.trainer.batch import behaviour_batch
from verbatim.trainer.correction import correct, policy_gradient_loss
from verbatim.trainer.learner_config import CorrectionConfig

OFF = dict(token_tis_cap=None, token_mask_band=None, sequence_tis=None, sequence_mask_band=None,
           max_version_lag=None)
MU = -1.5  # every behaviour logprob in these cases; π = μ + log(ratio)


def batch(ratios, mask=None, versions=None, mu=MU):
    """(B, T) tensors with π/μ = ``ratios`` exactly representable through log space."""
    r = torch.tensor(ratios, dtype=torch.float64)
    logp_mu = torch.full(r.shape, mu, dtype=torch.float64)
    logp_pi = logp_mu + torch.log(r)
    loss_mask = torch.ones(r.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    logp_mu = logp_mu.masked_fill(~loss_mask, float("nan"))
    v = torch.zeros(r.shape, dtype=torch.int32) if versions is None else torch.tensor(versions, dtype=torch.int32)
    v = v.masked_fill(~loss_mask, -1)
    return logp_pi, logp_mu, loss_mask, v


def run(ratios, mask=None, versions=None, trainer_version=0, **config):
    cfg = CorrectionConfig(**{**OFF, **config})
    return correct(*batch(ratios, mask, versions), trainer_version=trainer_version, config=cfg)


def close(tensor, expected):
    torch.testing.assert_close(tensor.double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-6, atol=1e-9)


def test_all_modes_off_weights_are_the_loss_mask():
    c = run([[0.3, 1.0, 7.0]], mask=[[True, False, True]])
    close(c.weights, [[1.0, 0.0, 1.0]])
    assert c.keep.tolist() == [[True, False, True]]
    assert not any(m.any() for m in c.dropped.values())


def test_token_tis_caps_the_ratio():
    c = run([[0.25, 1.0, 3.0]], token_tis_cap=2.0)
    close(c.weights, [[0.25, 1.0, 2.0]])
    assert c.keep.all()


def test_token_band_drops_outside_tokens_and_keeps_the_edge():
    c = run([[0.25, 1.0, 3.0, 1.5]], token_mask_band=(1.0, 2.0))
    assert c.dropped["token_band"].tolist() == [[True, False, True, False]]
    close(c.weights, [[0.0, 1.0, 0.0, 1.0]])


def test_sequence_tis_product_and_geo_mean():
    ratios = [[2.0, 2.0, 1.0], [0.5, 2.0, 1.0], [2.0, 8.0, 1.0]]
    mask = [[True, True, False], [True, True, True], [True, True, False]]
    product = run(ratios, mask, sequence_tis="product", sequence_tis_cap=3.0)
    # products 4 -> 3 (capped), 1, 16 -> 3
    close(product.weights, [[3.0, 3.0, 0.0], [1.0, 1.0, 1.0], [3.0, 3.0, 0.0]])
    geo = run(ratios, mask, sequence_tis="geo_mean", sequence_tis_cap=3.0)
    # geometric means 2, 1, 4 -> 3 (capped)
    close(geo.weights, [[2.0, 2.0, 0.0], [1.0, 1.0, 1.0], [3.0, 3.0, 0.0]])


def test_sequence_band_drops_whole_sequences_by_geo_mean():
    # geometric means: 2, 1, sqrt(0.1 * 0.4) = 0.2
    c = run([[2.0, 2.0], [0.5, 2.0], [0.1, 0.4]], sequence_mask_band=(0.5, 1.5))
    assert c.dropped["sequence_band"].tolist() == [[True, True], [False, False], [True, True]]
    close(c.weights, [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])


def test_version_lag_drops_stale_tokens():
    c = run([[1.0, 1.0, 1.0, 1.0]], versions=[[5, 4, 3, 2]], trainer_version=5, max_version_lag=2)
    assert c.dropped["version_lag"].tolist() == [[False, False, False, True]]
    assert sorted(c.metrics.by_lag) == [0, 1, 2, 3]
    assert c.metrics.by_lag[3].dropped["version_lag"] == 1.0
    assert c.metrics.by_lag[2].dropped["version_lag"] == 0.0


G0 = 0.75 ** 0.25  # geometric mean of row 0 below: (0.25 * 3 * 1 * 1)^(1/4) = 0.9306


@pytest.mark.parametrize("tis, row0", [
    (dict(token_tis_cap=2.5), [0.0, 2.5, 1.0, 0.0]),
    (dict(sequence_tis="geo_mean", sequence_tis_cap=1.5), [0.0, G0, G0, 0.0]),
], ids=["token_tis", "sequence_tis"])
def test_tis_combines_with_the_masks_and_masks_overlap(tis, row0):
    ratios = [[0.25, 3.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]
    versions = [[1, 1, 1, 0], [1, 1, 1, 1]]
    c = run(ratios, versions=versions, trainer_version=1, token_mask_band=(0.5, 5.0),
            sequence_mask_band=(0.1, 1.9), max_version_lag=0, **tis)
    # row 0: token 0 out of band; token 3 too stale; row 1: geo mean 2 > 1.9
    close(c.weights, [row0, [0.0, 0.0, 0.0, 0.0]])
    assert c.dropped["token_band"].tolist()[0] == [True, False, False, False]
    assert c.dropped["version_lag"].tolist()[0] == [False, False, False, True]
    assert c.dropped["sequence_band"].tolist() == [[False] * 4, [True] * 4]
    assert c.metrics.all.dropped["any"] == pytest.approx(6 / 8)


def test_token_and_sequence_tis_together_are_refused():
    with pytest.raises(pydantic.ValidationError, match="replaces token-level TIS") as info:
        CorrectionConfig(sequence_tis="product")  # the token cap is on by default
    assert "token_tis_cap=None" in str(info.value)
    assert CorrectionConfig(token_tis_cap=None, sequence_tis="product").sequence_tis == "product"


def test_mu_minus_inf_is_capped_and_dropped_never_nan():
    logp_pi = torch.tensor([[-1.0, -2.0]])
    logp_mu = torch.tensor([[float("-inf"), -2.0]])
    mask = torch.tensor([[True, True]])
    versions = torch.zeros((1, 2), dtype=torch.int32)
    token = correct(logp_pi, logp_mu, mask, versions, 0, CorrectionConfig(token_tis_cap=2.0, token_mask_band=None))
    close(token.weights, [[2.0, 1.0]])  # inf ratio capped at 2, ratio-1 token 1
    assert token.log_ratio[0, 0].item() == math.inf
    sequence = correct(logp_pi, logp_mu, mask, versions, 0,
                       CorrectionConfig(token_tis_cap=None, token_mask_band=None, sequence_tis="product",
                                        sequence_tis_cap=4.0))
    close(sequence.weights, [[4.0, 4.0]])  # inf product capped at 4, on every token of the sequence
    banded = correct(logp_pi, logp_mu, mask, versions, 0, CorrectionConfig())
    assert banded.dropped["token_band"].tolist() == [[True, False]]
    close(banded.weights, [[0.0, 1.0]])
    stats = banded.metrics.all
    assert stats.nonfinite == 1 and stats.k1 == 0.0 and stats.k3 == 0.0
    assert stats.ratio_quantiles["p99"] == math.inf and stats.mean_abs_log_ratio == math.inf


def test_empty_sequences_and_empty_batches():
    for tis in (dict(token_tis_cap=2.0), dict(sequence_tis="product", sequence_tis_cap=10.0)):
        c = run([[1.0, 2.0], [3.0, 4.0]], mask=[[False, False], [True, False]], sequence_mask_band=(0.5, 2.0), **tis)
        close(c.weights, [[0.0, 0.0], [0.0, 0.0]])  # row 0 empty; row 1 geo mean 3 out of band
        close(c.sequence_log_ratio, [0.0, math.log(3.0)])
    empty = correct(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool),
                    torch.zeros(3, 0, dtype=torch.int32), 0)
    assert empty.weights.shape == (3, 0) and empty.metrics.all.tokens == 0
    assert empty.metrics.all.dropped["any"] == 0.0 and empty.metrics.by_lag == {}


def test_all_masked_gives_zero_loss_and_zero_gradient():
    logp_pi, logp_mu, mask, versions = batch([[0.1, 9.0], [0.1, 0.1]])
    logp_pi = logp_pi.clone().requires_grad_(True)
    c = correct(logp_pi, logp_mu, mask, versions, 0, CorrectionConfig(token_mask_band=(0.5, 2.0)))
    assert not c.keep.any() and c.metrics.all.dropped["any"] == 1.0
    loss = policy_gradient_loss(logp_pi, torch.tensor([1.0, -1.0], dtype=torch.float64), c)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp_pi.grad, torch.zeros_like(logp_pi))


def test_gradient_flows_only_through_pi():
    logp_pi, logp_mu, mask, versions = batch([[0.5, 4.0, 1.0]], mask=[[True, True, False]])
    logp_pi = logp_pi.clone().requires_grad_(True)
    logp_mu = logp_mu.clone().requires_grad_(True)
    c = correct(logp_pi, logp_mu, mask, versions, 0, CorrectionConfig(token_tis_cap=2.0, token_mask_band=None))
    assert not c.weights.requires_grad
    loss = policy_gradient_loss(logp_pi, torch.tensor([3.0], dtype=torch.float64), c)
    loss.backward()
    assert logp_mu.grad is None
    close(logp_pi.grad, [[-0.5 * 3.0 / 2, -2.0 * 3.0 / 2, 0.0]])  # -w*A / kept tokens


def test_per_token_advantages():
    logp_pi, logp_mu, mask, versions = batch([[1.0, 1.0]])
    logp_pi = logp_pi.clone().requires_grad_(True)
    c = correct(logp_pi, logp_mu, mask, versions, 0, CorrectionConfig(**OFF))
    policy_gradient_loss(logp_pi, torch.tensor([[2.0, -4.0]], dtype=torch.float64), c).backward()
    close(logp_pi.grad, [[-1.0, 2.0]])


@pytest.mark.parametrize("change, message", [
    (lambda mu, v: mu.__setitem__((0, 1), float("nan")), "no behaviour logprob"),
    (lambda mu, v: v.__setitem__((0, 1), -1), "no policy version"),
    (lambda mu, v: v.__setitem__((0, 1), 9), "newer than the trainer"),
])
def test_bad_inputs_are_clear_errors(change, message):
    logp_pi, logp_mu, mask, versions = batch([[1.0, 1.0]])
    change(logp_mu, versions)
    with pytest.raises(TrainerError, match=message):
        correct(logp_pi, logp_mu, mask, versions, 3)


def test_shape_mismatch_is_an_error():
    with pytest.raises(TrainerError, match="one shape"):
        correct(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2, dtype=torch.bool),
                torch.zeros(1, 2, dtype=torch.int32), 0)


def test_config_is_frozen_validated_and_documented_defaults():
    cfg = CorrectionConfig()
    assert (cfg.token_tis_cap, cfg.token_mask_band, cfg.sequence_tis, cfg.sequence_mask_band,
            cfg.max_version_lag, cfg.hybrid_window) == (2.0, (0.5, 5.0), None, None, None, 32)
    with pytest.raises(pydantic.ValidationError):
        cfg.token_tis_cap = 3.0
    for bad in (dict(token_mask_band=(2.0, 1.0)), dict(sequence_mask_band=(-1.0, 1.0)),
                dict(token_tis_cap=0.0), dict(max_version_lag=-1), dict(unknown=1),
                dict(sequence_tis="mean")):
        with pytest.raises(pydantic.ValidationError):
            CorrectionConfig(**bad)


def test_behaviour_batch_from_trace_columns():
    a = TokenColumns(token_id=[5, 6, 7], source=[Source.PROMPT, Source.MODEL, Source.MODEL],
                     logprob=[np.nan, -0.5, -0.25], policy_version=[-1, 3, 4], turn=[0, 0, 0])
    b = TokenColumns(token_id=[9], source=[Source.MODEL], logprob=[-1.0], policy_version=[4], turn=[0])
    got = behaviour_batch([a, b])
    assert got.token_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert got.loss_mask.tolist() == [[False, True, True], [True, False, False]]
    assert got.versions.tolist() == [[-1, 3, 4], [4, -1, -1]]
    assert got.lengths.tolist() == [3, 1]
    assert torch.isnan(got.logp_mu[0, 0]) and torch.isnan(got.logp_mu[1, 1:]).all()
    # the trace columns go straight into the correction
    pi = torch.nan_to_num(got.logp_mu, nan=0.0)
    c = correct(pi, got.logp_mu, got.loss_mask, got.versions, 4)
    assert sorted(c.metrics.by_lag) == [0, 1] and c.metrics.all.tokens == 3
