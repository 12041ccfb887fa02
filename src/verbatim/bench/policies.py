"""Measure what each cache policy does across a weight update, on a real engine.

One scenario per policy: a rollout's turn 1 under version v, a weight update to
a perturbed checkpoint (version v+1) with that policy, then the rollout's
turn 2 (its whole history + new tokens) and a brand-new rollout's turn 1 with
the same prompt (after turn 2, so it may reuse what turn 2 prefilled).
Recorded: cached tokens of both requests, the KV versions
turn 2 reused, and whether turn 2's greedy output equals a fresh prefill under
the new weights (a hybrid context changes it) or the old weights' output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from verbatim.datamodel import Frozen
from verbatim.engine.protocol import CachePolicy, Engine, Sampling, cache_salt
from verbatim.prefix_cache import computed_tokens, reusable_tokens

GREEDY = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)


class PolicyRow(Frozen):
    policy: str
    reusable_tokens: int
    turn2_cached: int
    new_rollout_cached: int
    new_rollout_kv_versions: tuple[str, ...]
    turn2_kv_versions: tuple[str, ...]
    """'old' / 'new' relative to the update."""
    turn2_matches_fresh_new_weights: bool
    turn2_matches_old_weights: bool


def scenario_prompts(seed: int = 0, prompt_len: int = 300, new_len: int = 64,
                     vocab: tuple[int, int] = (200, 40000)) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return (rng.integers(*vocab, size=prompt_len).tolist(), rng.integers(*vocab, size=new_len).tolist())


async def measure_policy(engine: Engine, policy: CachePolicy, *, base: Path, updated: Path,
                         seed: int = 0) -> PolicyRow:
    """Run the scenario once; leaves the engine on ``updated`` weights."""
    prompt, observation = scenario_prompts(seed)
    start = engine.version + 1
    await engine.update_weights(base, start, CachePolicy.FLUSH)  # a clean cache on known weights
    first = await engine.generate(prompt, GREEDY, cache_salt=cache_salt(policy, start, start))
    history = prompt + first.token_ids.tolist() + observation
    old = await engine.generate(history, GREEDY, cache_salt="reference-old")

    await engine.update_weights(updated, start + 1, policy)
    turn2 = await engine.generate(history, GREEDY, cache_salt=cache_salt(policy, start + 1, start))
    fresh_rollout = await engine.generate(prompt, GREEDY, cache_salt=cache_salt(policy, start + 1, start + 1))
    fresh = await engine.generate(history, GREEDY, cache_salt=f"reference-new-{start}")
    computed = computed_tokens(len(prompt), len(first.token_ids))  # turn 1's KV, all a prefix of ``history``
    reusable = reusable_tokens(computed, len(history), engine.block_size)
    return PolicyRow(
        policy=policy.value,
        reusable_tokens=reusable,
        turn2_cached=turn2.cached_tokens,
        new_rollout_cached=fresh_rollout.cached_tokens,
        new_rollout_kv_versions=tuple(_relative(v, start) for v in fresh_rollout.kv_versions),
        turn2_kv_versions=tuple(_relative(v, start) for v in turn2.kv_versions),
        turn2_matches_fresh_new_weights=turn2.token_ids.tolist() == fresh.token_ids.tolist(),
        turn2_matches_old_weights=turn2.token_ids.tolist() == old.token_ids.tolist(),
    )


def _relative(version: int, start: int) -> str:
    return {start: "old", start + 1: "new"}.get(version, f"v{version}")


def markdown_table(rows: list[PolicyRow]) -> str:
    lines = [
        "| policy | turn 2 cached / reusable | KV reused by turn 2 | new rollout cached | KV reused by new rollout | "
        "turn 2 = fresh prefill, new weights | turn 2 = old weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = ", ".join(r.turn2_kv_versions) or "none"
        kv_new = ", ".join(r.new_rollout_kv_versions) or "none"
        lines.append(f"| `{r.policy}` | {r.turn2_cached} / {r.reusable_tokens} | {kv} | {r.new_rollout_cached} | "
                     f"{kv_new} | "
                     f"{'yes' if r.turn2_matches_fresh_new_weights else 'no'} | "
                     f"{'yes' if r.turn2_matches_old_weights else 'no'} |")
    return "\n".join(lines)
