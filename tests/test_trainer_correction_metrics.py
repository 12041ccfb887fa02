"""Correction metrics: KL estimates, quantiles, breakdown by version lag and hybrid tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from verbatim.trainer.correction import correct
from verbatim.trainer.correction_metrics import hybrid_tokens, ratio_quantiles
from verbatim.trainer.learner_config import CorrectionConfig


def test_k1_k3_and_mean_abs_log_ratio_by_hand():
    ratios = [0.5, 1.0, 2.0, 4.0]
    logp_mu = torch.full((1, 4), -2.0, dtype=torch.float64)
    logp_pi = logp_mu + torch.log(torch.tensor([ratios], dtype=torch.float64))
    c = correct(logp_pi, logp_mu, torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.int32), 0,
                CorrectionConfig(token_mask_band=(0.75, 3.0)))
    s = c.metrics.all
    logs = [math.log(r) for r in ratios]
    assert s.tokens == 4 and s.nonfinite == 0
    assert s.k1 == pytest.approx(-sum(logs) / 4)
    assert s.k3 == pytest.approx(sum(r - 1 - lr for r, lr in zip(ratios, logs)) / 4)
    assert s.mean_abs_log_ratio == pytest.approx(sum(abs(x) for x in logs) / 4)
    assert s.dropped == {"token_band": 0.5, "sequence_band": 0.0, "version_lag": 0.0, "any": 0.5}


def test_nearest_rank_quantiles_are_ratios_of_actual_tokens():
    log_ratio = torch.log(torch.arange(1, 102, dtype=torch.float64))  # ratios 1..101
    q = ratio_quantiles(log_ratio)
    assert q == pytest.approx({"p01": 2.0, "p10": 11.0, "p50": 51.0, "p90": 91.0, "p99": 100.0})
    assert ratio_quantiles(torch.tensor([0.0])) == {k: 1.0 for k in ("p01", "p10", "p50", "p90", "p99")}


def test_hybrid_tokens_follow_version_changes_within_the_window():
    versions = torch.tensor([[3, 3, 3, 4, 4, 4, 4, 5], [-1, 2, -1, 3, 3, 3, 3, 3]], dtype=torch.int32)
    mask = torch.tensor([[True] * 8, [False, True, False, True, True, True, True, True]])
    got = hybrid_tokens(versions, mask, window=2)
    assert got.tolist() == [
        [False, False, False, True, True, False, False, True],
        [False, False, False, True, True, False, False, False],
    ]
    # a single model token, or none, is never hybrid
    assert not hybrid_tokens(torch.tensor([[1, 2]]), torch.tensor([[True, False]]), 4).any()


def test_breakdown_by_lag_and_hybrid_window():
    ratios = torch.tensor([[1.0, 1.0, 2.0, 2.0, 8.0]], dtype=torch.float64)
    versions = torch.tensor([[1, 1, 2, 2, 2]], dtype=torch.int32)
    logp_mu = torch.full((1, 5), -3.0, dtype=torch.float64)
    c = correct(logp_mu + torch.log(ratios), logp_mu, torch.ones(1, 5, dtype=torch.bool), versions, 2,
                CorrectionConfig(hybrid_window=2))
    m = c.metrics
    assert m.by_lag[1].tokens == 2 and m.by_lag[1].ratio_quantiles["p50"] == 1.0
    assert m.by_lag[0].tokens == 3 and m.by_lag[0].dropped["token_band"] == pytest.approx(1 / 3)
    assert m.hybrid.tokens == 2 and m.hybrid.ratio_quantiles["p99"] == pytest.approx(2.0)
    assert m.non_hybrid.tokens == 3 and m.non_hybrid.dropped["any"] == pytest.approx(1 / 3)
    data = m.as_dict()
    assert set(data) == {"all", "by_lag", "hybrid", "non_hybrid"} and set(data["by_lag"]) == {"0", "1"}
    json.dumps(data)
