"""Run directories for tests/test_view.py and scripts/view_screenshots.py: real SmolLM2 tokens, no engine.

Each rollout is rendered with the smollm2 renderer and grown by the Ledger as the harness
grows it (prompt, completion, observation bridged onto the history, completion…).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from verbatim.datamodel import Completion, Message, Rollout, Source
from verbatim.harness.ledger import Ledger
from verbatim.harness.metrics_log import append_metrics
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.trainer.logprob_files import RolloutLogprobs, step_file, write_logprobs

BLOCK = 16
HOSTILE = '<img src=x onerror="window.__pwned=1">'
CLOSER = "</script><script>window.__pwned=2</script>"
QUESTION = "Guess my number between 1 and 100. Reply with one number."


def _completion(renderer, text: str, prompt_len: int, cached: int, versions: list[int] | None = None,
                rng: np.random.Generator | None = None) -> Completion:
    ids = renderer.encode(text) + [renderer.stop_token_ids[0]]
    rng = rng or np.random.default_rng(len(text))
    vers = versions if versions is not None else [0] * len(ids)
    vers = (vers + [vers[-1]] * len(ids))[:len(ids)]
    return Completion(token_ids=ids, logprobs=-rng.exponential(0.8, len(ids)), versions=vers, finish_reason="stop",
                      prompt_tokens=prompt_len, cached_tokens=cached)


def _reusable(n: int) -> int:
    """What a block cache can serve of an n-token prompt: whole blocks, never the last token."""
    return (n - 1) // BLOCK * BLOCK


def play(renderer, rid: str, group: str, answers: list[str], replies: list[str], *, miss_at: int | None = None,
         versions: dict[int, list[int]] | None = None, first_cached: int = 0, reward: float = 0.0,
         info: dict | None = None, **fields) -> Rollout:
    """A rollout of len(answers) turns; turn ``miss_at`` finds nothing in the cache (a miss)."""
    ledger = Ledger()
    ledger.append_prompt(renderer.render([Message(role="user", content=QUESTION)],
                                         add_generation_prompt=True).token_ids)
    for k, answer in enumerate(answers):
        n = len(ledger)
        cached = first_cached if k == 0 else (0 if k == miss_at else _reusable(n))
        ledger.append_completion(_completion(renderer, answer, n, cached, (versions or {}).get(k)))
        if k < len(answers) - 1:
            ledger.append_observation(renderer.bridge(ledger.columns().token_id.tolist(),
                                                      [Message(role="user", content=replies[k])]))
    return ledger.to_rollout(run_id="run", group_id=group, rollout_id=rid, reward=reward, info=info or {}, **fields)


def rollouts(renderer) -> list[Rollout]:
    r0 = play(renderer, "g0-r0", "g0", ["50", "25", "37"], ["Lower.", "Higher."], miss_at=2, reward=1.0,
              info={"step": 0})
    r1 = play(renderer, "g0-r1", "g0", ["75 is my guess", "60"], ["Lower."], reward=0.0,
              versions={1: [0, 1, 1]}, first_cached=_reusable(30), info={"step": 0})
    evil = play(renderer, "g1-evil", "g1", [HOSTILE, CLOSER], [f"{HOSTILE} {CLOSER}"], reward=0.5,
                info={"step": 1}, status="error", error=f"env said {HOSTILE}", task={"q": CLOSER})
    return [r0, r1, evil]


def segmented(renderer) -> Rollout:
    """An agent's rollout that dropped its first exchange before its third request: two segments."""
    first = play(renderer, "a0-r0", "a0", ["50", "25"], ["Lower."], reward=0.5)
    ledger = Ledger()
    ledger.append_prompt(first.tokens.token_id[:first.turns[0].prompt_end])
    for k, turn in enumerate(first.turns):
        ledger.append_completion(_completion(renderer, ["50", "25"][k], turn.prompt_end, turn.cached_tokens))
        if k == 0:
            ledger.append_observation(first.tokens.token_id[turn.completion_end:first.turns[1].prompt_end])
    fresh = renderer.render([Message(role="user", content="Lower."), Message(role="assistant", content="25"),
                             Message(role="user", content="Higher.")], add_generation_prompt=True).token_ids
    start = ledger.start_segment(fresh)
    ledger.append_completion(_completion(renderer, "37", len(fresh), 0))
    brk = {"message": 0, "role": "user", "field": "content", "what": "message 0 (user): content differs",
           "turn": 2, "start": start, "tools_changed": False, "messages": []}
    return ledger.to_rollout(run_id="run", group_id="a0", rollout_id="a0-r0", reward=0.5,
                             info={"segments": [brk]})


def trainer_logprobs(rollout: Rollout) -> RolloutLogprobs:
    """log π off from μ by +2 on every third token (the correction masks those: e² > 5), by 0.001 elsewhere; a
    MoE's routing flipped in one layer on every 7th token, two on every 14th (:func:`routing_flips`)."""
    mu = rollout.tokens.logprob.astype(np.float64)
    shift = np.where(np.arange(len(mu)) % 3 == 0, 2.0, 0.001)
    model = rollout.tokens.source == Source.MODEL
    return RolloutLogprobs(rollout.rollout_id, np.where(model, mu + shift, np.nan).astype(np.float32),
                           model & (shift < 1.0), routing_flips(len(mu)))


def routing_flips(length: int) -> np.ndarray:
    positions = np.arange(length)
    return ((positions % 7 == 6).astype(np.int8) + (positions % 14 == 13)).astype(np.int8)


def write_run(path: Path, renderer, model_dir: str, batches: list[list[Rollout]], *, status: str = "completed",
              metrics: list[dict] | None = None, trainer: list[Rollout] = ()) -> Path:
    manifest = RunManifest(run_id="view-test", model=model_dir, renderer="smollm2",
                           engine={"block_size": BLOCK, "cache_policy": "keep"})
    writer = TraceWriter(path, manifest)
    for batch in batches:
        writer.write_batch(batch)
    if trainer:
        write_logprobs(step_file(path, 0), [trainer_logprobs(r) for r in trainer],
                       {"writer": "train", "step": 0, "trainer_version": 0, "model": model_dir})
    for record in metrics or []:
        append_metrics(path, record)
    writer.write_manifest(manifest.model_copy(update={"status": status}))
    return path


def step_metrics(steps: int = 4, evaluated: tuple[int, ...] = (0, 3)) -> list[dict]:
    """Lines of metrics.jsonl; those of ``evaluated`` steps with an evaluation's figures (--eval-every)."""
    return [{"step": k, "version": k + 1, "reward_mean": 0.2 + 0.15 * k, "mismatch_mean_abs": 0.01 / (k + 1),
             "cache_hit_rate": 0.5 + 0.1 * k, "rollout_s": 3.0 + k, "train_s": 2.0, "weight_sync_s": 0.4,
             "checkpoint_s": 0.2, "entropy": 1.5 - 0.2 * k,
             **({"eval": {"version": k + 1, "tasks": 4, "samples": 2, "mean_reward": 0.1 * k,
                          "success_rate": 0.1 * k, "pass_at_k": {"1": 0.1 * k, "2": 0.15 * k}}}
                if k in evaluated else {})} for k in range(steps)]
