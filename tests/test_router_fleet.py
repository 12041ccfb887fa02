"""The router on a real fleet: two ``vllm serve`` replicas on 127.0.0.1 with a small KV cache each.

The replicas serve the tiny SmolLM2 (tests/conftest.py: ``tiny_smollm2_dir``, the default model's architecture,
tied output layer, tokenizer and template at 13 MB): routing, admission and the KV space are counted in tokens
and blocks, which the model's size does not change, so it starts, prefills, samples, trains and reloads in a
fraction of the default model's time.

Workload: 2 groups × 4 rollouts × 3 turns of ``longdoc`` (a shared document, three questions).
The tests run in order; the last one kills a replica.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from subprocess_cli import cli

from verbatim.datamodel import Source
from verbatim.engine.fleet import kill_replica, read_fleet
from verbatim.engine.http import HttpEngine
from verbatim.engine.protocol import Sampling
from verbatim.engine.router import Router
from verbatim.engine.routing import RouteConfig
from verbatim.envs.registry import load_env
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run
from verbatim.harness.summary import RunSummary
from verbatim.lint.trace import lint_run
from verbatim.renderers.registry import get_renderer
from verbatim.sim.replay import replay_check

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 1024
KV_BLOCKS = 40  # 1,280 tokens per replica: room for two or three live rollouts of this workload, not eight
BLOCK = 32


@pytest.fixture(scope="module")
def fleet(tiny_smollm2_dir, tmp_path_factory):
    """Started and stopped through the CLI: `verbatim fleet up` / `verbatim fleet down`."""
    file = tmp_path_factory.mktemp("fleet") / "fleet.json"
    up = cli("fleet", "up", "--replicas", "2", "--file", str(file), "--model", str(tiny_smollm2_dir),
             "--kv-blocks", str(KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN))
    assert up.returncode == 0, up.stderr
    record = read_fleet(file)
    try:
        assert len(record.replicas) == 2 and all(r.url.startswith("http://127.0.0.1:") for r in record.replicas)
        yield record
    finally:
        down = cli("fleet", "down", "--file", str(file))
        assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
        assert not file.exists()
        assert all(not Path(f"/proc/{r.pid}").exists() or b"vllm" not in Path(f"/proc/{r.pid}/cmdline").read_bytes()
                   for r in record.replicas)


@pytest.fixture(scope="module")
def renderer(tiny_smollm2_dir):
    return get_renderer("smollm2", model_dir=tiny_smollm2_dir)


async def _reset(urls: list[str]) -> None:
    for url in urls:
        async with HttpEngine(url) as engine:
            await engine.reset_prefix_cache()


def play(urls: list[str], route: str, renderer, out: Path, *, seed: int, words: int = 120, groups: int = 2,
         group_size: int = 4, admission: bool = True, high_water: float = 0.9, max_tokens: int = 24,
         on_turn=None) -> tuple[RunSummary, Router]:
    """One run through a fresh Router over the fleet (prefix caches emptied first)."""
    factory = load_env("longdoc", words=words, questions=3)
    plan = RunPlan(run_id=out.name, groups=groups, group_size=group_size, seed=seed, concurrency=16)
    loop = LoopConfig(max_turns=3, context_budget=MAX_MODEL_LEN, step_timeout_s=60,
                      sampling=Sampling(max_tokens=max_tokens, temperature=1.0))
    router = Router([HttpEngine(u, retries=1, backoff_s=0.2) for u in urls],
                    RouteConfig.parse(route, admission=admission, high_water=high_water))
    manifest = RunManifest(run_id=out.name, model="tiny-smollm2", renderer="smollm2",
                           engine={"kind": "http", "block_size": BLOCK, "cache_policy": "keep", "route": route},
                           config={"plan": plan.model_dump(exclude={"run_id"}),
                                   "options": {"routing": {"high_water": high_water, "admission": admission},
                                               "concurrency": 16}})
    run = Run(plan, loop, router, renderer, factory, factory.tasks(groups, seed), out, manifest)

    async def go() -> RunSummary:
        await _reset(urls)
        await router.start()
        if on_turn is not None:
            on_turn(router)
        try:
            return await run.play()
        finally:
            await router.aclose()

    return asyncio.run(go()), router


def check_simulator(out: Path, route: str | None = None, *, within: float | None = 0.05) -> None:
    """The simulator, replaying this real run (same policy, workload, block size and KV space), agrees on hits.

    ``within=None`` only reports: when the cache thrashes, what is evicted depends on the exact interleaving
    of requests, which the simulator's timing model does not reproduce.
    """
    check = replay_check(out, kv_blocks=KV_BLOCKS, route=route)
    print(f"\nsimulator replay of {out.name} ({check.route}): real hit rate {check.real_hit_rate:.1%}, "
          f"simulated {check.sim_hit_rate:.1%}; same cached tokens on {check.same_cached_turns}/{check.turns} turns")
    if within is not None:
        assert abs(check.real_hit_rate - check.sim_hit_rate) <= within


def floor_block(n: int) -> int:
    return n // BLOCK * BLOCK


@pytest.fixture(scope="module")
def sticky(fleet, renderer, tmp_path_factory) -> tuple[RunSummary, Path]:
    """The workload under ``sticky_least_loaded+group``, played once for the tests that read it."""
    out = tmp_path_factory.mktemp("sticky") / "sticky"
    summary, _ = play(fleet.urls, "sticky_least_loaded+group", renderer, out, seed=3)
    return summary, out


def test_sticky_group_routing_reuses_every_context_and_prefills_each_group_prompt_once(sticky):
    summary, out = sticky
    trace = read_run(out)
    assert len(trace.rollouts) == 8 and all(r.status != "error" for r in trace.rollouts), trace.rollouts
    for rollout in trace.rollouts:
        assert len({t.replica for t in rollout.turns}) == 1  # pinned
        for previous, turn in zip(rollout.turns, rollout.turns[1:]):
            assert turn.cached_tokens >= floor_block(previous.completion_end - 1), (rollout.rollout_id, turn)
    for group in ("g0000", "g0001"):
        members = sorted((r for r in trace.rollouts if r.group_id == group), key=lambda r: r.rollout_id)
        assert len({m.turns[0].replica for m in members}) == 1  # co-routed
        prompt = members[0].turns[0].prompt_end
        first_turn_prefill = sum(m.turns[0].prompt_end - m.turns[0].cached_tokens for m in members)
        assert first_turn_prefill <= prompt + (len(members) - 1) * BLOCK, first_turn_prefill  # prefilled once
    assert summary.migrations == 0 and set(summary.turns_per_replica) == {"r0", "r1"}
    assert lint_run(out).ok
    check_simulator(out)
    print(f"\nsticky_least_loaded+group: cached {summary.cache_hit_rate:.1%}, prefill {summary.prefill_tokens} "
          f"(minimum {summary.min_prefill_tokens}), turns per replica {summary.turns_per_replica}")


def test_round_robin_misses_are_measured_and_attributed_to_the_replica(fleet, renderer, tmp_path, sticky):
    summary, _ = play(fleet.urls, "round_robin", renderer, tmp_path / "rr", seed=3)
    routed, _ = sticky  # the same workload, routed sticky
    assert summary.migrations > 0 and summary.migration_lost_tokens > 0
    assert summary.prefill_tokens > routed.prefill_tokens
    check_simulator(tmp_path / "rr")
    report = lint_run(tmp_path / "rr")
    causes = [p.cause for v in report.verdicts for p in v.problems if getattr(p, "cause", None)]
    assert "replica" in causes, causes
    print(f"\nround_robin: cached {summary.cache_hit_rate:.1%}, prefill {summary.prefill_tokens}, "
          f"{summary.migrations} migrations losing {summary.migration_lost_tokens} cached tokens; "
          f"sticky+group on the same workload: cached {routed.cache_hit_rate:.1%}, prefill {routed.prefill_tokens}")


def test_verbatim_run_routes_over_several_urls(fleet, tiny_smollm2_dir, tmp_path):
    out, summary_file = tmp_path / "cli-run", tmp_path / "summary.json"
    urls = [arg for url in fleet.urls for arg in ("--url", url)]
    done = cli("run", "--env", "guess", "--engine", "http", *urls, "--model", str(tiny_smollm2_dir), "--route",
               "sticky_least_loaded+group", "--groups", "2", "--group-size", "2", "--max-turns", "2", "--max-tokens",
               "16", "--max-model-len", str(MAX_MODEL_LEN), "--out", str(out), "--summary-json", str(summary_file))
    assert done.returncode == 0, done.stderr
    summary = json.loads(summary_file.read_text())
    assert summary["rollouts"] == 4 and sum(summary["turns_per_replica"].values()) == summary["turns"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"]["route"] == "sticky_least_loaded+group" and manifest["engine"]["urls"] == fleet.urls
    assert all(t.replica in ("r0", "r1") for r in read_run(out).rollouts for t in r.turns)


def full_reuse(out: Path) -> tuple[int, int]:
    """Turns after the first that found their whole previous context cached, and all such turns."""
    pairs = [(turn, previous) for r in read_run(out).rollouts for previous, turn in zip(r.turns, r.turns[1:])]
    return sum(t.cached_tokens >= floor_block(p.completion_end - 1) for t, p in pairs), len(pairs)


def test_admission_keeps_the_cache_when_the_kv_space_cannot_hold_every_rollout(fleet, renderer, tmp_path):
    # 8 rollouts of ~300–500 tokens each with distinct documents: ~3,500 tokens of live context against
    # 2 × 1,280 tokens of KV. Without admission they evict each other's history between turns.
    settings = dict(seed=5, words=200, groups=8, group_size=1, high_water=0.75, max_tokens=24)
    without, _ = play(fleet.urls, "sticky_least_loaded", renderer, tmp_path / "off", admission=False, **settings)
    with_, _ = play(fleet.urls, "sticky_least_loaded", renderer, tmp_path / "on", admission=True, **settings)
    reused_off, reused_on = full_reuse(tmp_path / "off"), full_reuse(tmp_path / "on")
    print(f"\nKV too small for all rollouts: without admission cached {without.cache_hit_rate:.1%} "
          f"(whole previous context reused on {reused_off[0]}/{reused_off[1]} turns); with admission "
          f"cached {with_.cache_hit_rate:.1%} ({reused_on[0]}/{reused_on[1]}), held {with_.admission_wait_s:.0f} s")
    check_simulator(tmp_path / "off", route="sticky_least_loaded", within=None)
    check_simulator(tmp_path / "on", route="sticky_least_loaded")
    assert with_.admission_wait_s > 0 and without.admission_wait_s == 0
    assert with_.statuses == {"ok": 8} and without.statuses == {"ok": 8}
    assert reused_on[0] == reused_on[1]  # every live rollout kept its history
    assert with_.cache_hit_rate > without.cache_hit_rate + 0.15


def test_a_group_sharing_its_prompt_is_admitted_together(fleet, renderer, tmp_path):
    """Admission counts a co-routed group's shared document once: its 4 members, whose whole first prompts
    would fill more than the high-water mark of one replica, play together and keep every history."""
    summary, _ = play(fleet.urls, "sticky_least_loaded+group", renderer, tmp_path / "group", seed=11, words=150,
                      high_water=0.75)
    trace = read_run(tmp_path / "group")
    members = [r for r in trace.rollouts if r.group_id == "g0000"]
    leader_context = members[0].turns[0].completion_end
    per_member = sum(m.turns[0].prompt_end for m in members[1:]) + leader_context
    naive = per_member / (KV_BLOCKS * BLOCK)  # every member's whole context, as admission counted before
    reused = full_reuse(tmp_path / "group")
    print(f"\ngroups of 4 over one document: whole contexts would project {naive:.0%} of a replica; held "
          f"{summary.admission_wait_s:.1f} s; cached {summary.cache_hit_rate:.1%}; whole previous context "
          f"reused on {reused[0]}/{reused[1]} turns")
    assert naive >= 0.75, "the workload no longer tests what it should: raise words"
    assert summary.admission_wait_s == 0 and summary.statuses == {"ok": 8}
    assert reused[0] == reused[1]
    check_simulator(tmp_path / "group")


def test_verbatim_train_pushes_every_step_to_every_replica_and_keeps_groups_together(
        fleet, tiny_smollm2_dir, default_tokenizer, tmp_path):
    """`verbatim train` over both replicas: each step's tokens carry the version that every replica serves,
    a group plays on one replica, and after the run both replicas sample with the trained weights."""
    import numpy as np
    import torch

    from verbatim.engine.protocol import CachePolicy
    from verbatim.trainer.checkpoint import load_checkpoint
    from verbatim.trainer.reference import load_model, reference_logprobs

    out = tmp_path / "train"
    urls = [arg for url in fleet.urls for arg in ("--url", url)]
    # an env whose rewards are graded by length: a group's rewards differ, so the weights surely move
    # (a step whose groups all have equal rewards trains nothing, and would prove nothing)
    done = cli("train", "--env", "graded_env:GradedFactory", "--engine", "http", *urls, "--model",
               str(tiny_smollm2_dir), "--route", "sticky_least_loaded+group", "--steps", "2", "--groups", "2",
               "--group-size", "4", "--max-turns", "1", "--max-tokens", "8", "--lr", "1e-3", "--seed", "3",
               "--max-model-len", str(MAX_MODEL_LEN), "--out", str(out))
    assert done.returncode == 0, done.stderr
    rollouts = read_run(out).rollouts
    assert len(rollouts) == 2 * 2 * 4
    for rollout in rollouts:
        assert len({t.replica for t in rollout.turns}) == 1, rollout.rollout_id  # pinned
        model = rollout.tokens.policy_version[rollout.tokens.source == Source.MODEL]
        assert set(model.tolist()) == {rollout.info["step"] - 1}, rollout.rollout_id  # step n samples version n - 1
    groups = {(r.info["step"], r.group_id): set() for r in rollouts}
    for r in rollouts:
        groups[(r.info["step"], r.group_id)].add(r.turns[0].replica)
    assert all(len(replicas) == 1 for replicas in groups.values()), groups  # a group is co-routed
    assert set().union(*groups.values()) == {"r0", "r1"}, groups  # and the groups were spread over both
    trained = load_model(tiny_smollm2_dir)
    assert load_checkpoint(out / "checkpoints" / "step-000002", trained, None)["version"] == 2
    # the tiny SmolLM2's tokenizer is the default model's (tests/conftest.py)
    prompt = default_tokenizer.apply_chat_template([{"role": "user", "content": "Guess a number from 1 to 5."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)

    async def sample_and_restore(url: str):
        async with HttpEngine(url) as engine:
            got = await engine.generate(prompt, Sampling(max_tokens=12, temperature=1.0, seed=5))
            await engine.update_weights(tiny_smollm2_dir, 1, CachePolicy.FLUSH)  # the next test plays the base
        return got

    base = load_model(tiny_smollm2_dir).eval()
    for url in fleet.urls:
        got = asyncio.run(sample_and_restore(url))
        ids = list(prompt) + got.token_ids.tolist()
        at = range(len(prompt), len(ids))
        with torch.no_grad():
            want = reference_logprobs(trained.eval(), ids, at).numpy()
            before = reference_logprobs(base, ids, at).numpy()
        assert np.abs(want - got.logprobs).max() < 1e-3, url  # the replica serves the trained weights
        assert np.abs(before - got.logprobs).max() > 1e-2, "training did not move the weights: no proof"


def test_a_replica_killed_mid_run_moves_its_sessions_and_loses_nothing(fleet, renderer, tmp_path):
    victim = fleet.replicas[1]
    calls = {"n": 0}

    def arm(router: Router) -> None:
        engine = router.replicas[1].engine
        forward = engine.generate

        async def generate(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 6:  # some turns done, others in flight: the replica dies
                await asyncio.to_thread(kill_replica, victim)
            return await forward(*args, **kwargs)

        engine.generate = generate

    summary, router = play(fleet.urls, "sticky_least_loaded+group", renderer, tmp_path / "kill", seed=7, on_turn=arm)
    trace = read_run(tmp_path / "kill")
    ids = [r.rollout_id for r in trace.rollouts]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 8  # none lost, none duplicated
    assert trace.problems == [] and all(r.status == "ok" for r in trace.rollouts), [r.error for r in trace.rollouts]
    assert not router.replicas[1].healthy and calls["n"] >= 6
    moved = [d for r in trace.rollouts for d in r.info.get("routes", []) if d.get("migrated_from") == "r1"]
    assert moved and all(d["reason"] == "migrate:replica down" and d["lost_tokens"] > 0 for d in moved)
    assert summary.migrations == len(moved) and summary.migration_lost_tokens == sum(d["lost_tokens"] for d in moved)
    after = [t for r in trace.rollouts for t in r.turns if t.replica == "r0"]
    assert len(after) > 12  # r0 took over r1's share
    print(f"\nreplica r1 killed: {len(moved)} sessions moved to r0, {summary.migration_lost_tokens} cached tokens "
          f"lost; {summary.turns_per_replica}")
