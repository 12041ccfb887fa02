"""The mismatch report: π recomputed over the trace's exact tokens, compared with μ, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verbatim.datamodel import Completion
from verbatim.errors import InputError, TraceError
from verbatim.harness.ledger import Ledger
from verbatim.trainer.mismatch import check_vocabulary, mismatch, usable_rollouts
from verbatim.trainer.reference import reference_logprobs


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def _rollout(model, rng, *, shift: float = 0.0, version: int = 0, rollout_id: str = "r"):
    """A two-turn rollout whose μ is the model's own logprob (plus ``shift``)."""
    ledger = Ledger()
    ledger.append_prompt(rng.integers(0, 64, 6))
    for turn in range(2):
        sampled = rng.integers(0, 64, 5)
        full = np.concatenate([ledger.view(), sampled])
        with torch.no_grad():
            lp = reference_logprobs(model, full)[-5:].numpy() + shift
        ledger.append_completion(Completion(token_ids=sampled, logprobs=lp, versions=[version] * 5,
                                            finish_reason="length", prompt_tokens=len(ledger), cached_tokens=0))
        if turn == 0:
            ledger.append_observation(rng.integers(0, 64, 3))
    return ledger.to_rollout(run_id="x", group_id="g", rollout_id=rollout_id)


def test_identical_policies_agree_and_nothing_is_masked(tiny_model):
    rng = np.random.default_rng(0)
    rollouts = [_rollout(tiny_model, rng, rollout_id=f"r{i}") for i in range(3)]
    report = mismatch(rollouts, tiny_model)
    assert report.model_tokens == 30 and report.rollouts == 3
    assert report.mean_abs_log_ratio < 1e-5
    assert report.metrics["all"]["dropped"]["any"] == 0.0


def test_a_shifted_sampler_is_measured_and_masked_by_lag(tiny_model):
    rng = np.random.default_rng(1)
    fresh = _rollout(tiny_model, rng, version=5, rollout_id="fresh")
    stale = _rollout(tiny_model, rng, shift=-2.0, version=1, rollout_id="stale")  # μ lower: ratio e^2
    report = mismatch([fresh, stale], tiny_model)
    assert report.trainer_version == 5
    assert abs(report.mean_abs_log_ratio - 1.0) < 1e-4  # half the tokens off by exactly 2
    by_lag = report.metrics["by_lag"]
    assert set(by_lag) == {"0", "4"}
    assert by_lag["0"]["mean_abs_log_ratio"] < 1e-5
    assert abs(by_lag["4"]["mean_abs_log_ratio"] - 2.0) < 1e-4
    assert by_lag["4"]["dropped"]["any"] == 1.0 and by_lag["0"]["dropped"]["any"] == 0.0


def test_traces_without_logprobs_and_foreign_vocabularies_are_clear_errors(tiny_model):
    ledger = Ledger()
    ledger.append_prompt([1, 2, 3])
    no_samples = ledger.to_rollout(run_id="x", group_id="g", rollout_id="r")
    with pytest.raises(TraceError, match="no sampled tokens with logprobs"):
        usable_rollouts([no_samples])
    rollout = _rollout(tiny_model, np.random.default_rng(2))
    with pytest.raises(InputError, match="outside tiny's vocabulary of 10") as info:
        check_vocabulary([rollout], 10, "tiny")
    assert "pass the --model the trace was sampled with" in info.value.one_line()
