"""Run accounting: prompt, cached and prefill tokens, and what the minimum and a re-render would cost.

``min_prefill_tokens`` is a lower bound on what any prefix cache must prefill
(design invariant 5: ``prefill_tokens >= min_prefill_tokens``), computed by
:func:`verbatim.prefix_cache.min_prefill` over the requests in the order sent.
Real prefill exceeds the bound by the partial blocks a block cache cannot
reuse, and by whatever was evicted. ``rerender_prefill_tokens`` is the same
bound for a harness that re-renders each turn's prompt from messages with the
chat template: its prefix cache can reuse only up to the first token where a
re-render departs from what it sent before. ``block_size`` is the engine's, as
the run's manifest records it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import Field

from verbatim.datamodel import FAILED_STATUSES, Frozen, Message, Rollout
from verbatim.errors import VerbatimError
from verbatim.harness.rollout import MAX_TURNS
from verbatim.harness.transcript import solved
from verbatim.prefix_cache import min_prefill


class RunSummary(Frozen):
    rollouts: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    min_prefill_tokens: int = 0
    rerender_prefill_tokens: int | None = None
    generated_tokens: int = 0
    block_size: int = Field(ge=1)
    """The engine's KV block size (the run manifest's ``engine.block_size``)."""
    wall_s: float = 0.0
    """Seconds the rollouts took (from the first start to the last write)."""
    engine_start_s: float = 0.0
    """Seconds the engine took to start before them (0 when the caller did not start it)."""
    statuses: dict[str, int] = Field(default_factory=dict)
    """Rollouts per status: ``ok`` the env ended the episode (solved or not), ``truncated`` --max-turns
    ended it first, ``error`` a failure (its reason in the rollout's ``error``)."""
    mean_reward: float | None = None
    """The mean reward of the rollouts that ended with one; a failed rollout's (error, interrupted) is null."""
    rewards_left_out: int = 0
    """Rollouts the mean leaves out: failed ones, and those that ended without a reward."""
    cut_at_max_turns: int = 0
    """Truncated rollouts that --max-turns cut (an env's episode not done, or an agent that asked for more)."""
    first_error: str | None = None
    """The recorded reason of the first failed rollout (error or interrupted)."""
    solved: int | None = None
    """Rollouts whose env said ``solved`` (its last ``info["solved"]``); None when the env never says."""
    success_rate: float | None = None
    """``solved`` over the rollouts whose env said whether they were solved."""
    admission_wait_s: float = 0.0
    """Time new rollouts were held by the router's admission control, summed."""
    migrations: int = 0
    """Turns the router sent to another replica than the session's previous turn."""
    migration_lost_tokens: int = 0
    """Cached context those migrations gave up (the expected cache loss)."""
    history_breaks: int = 0
    """New segments that agents started by rewriting their history (``lint trace`` says where)."""
    broken_rollouts: int = 0
    """Rollouts holding at least one history break."""
    ignored_request_fields: dict[str, int] = Field(default_factory=dict)
    """Fields agents set on their requests that the run's sampling settings override, and how often."""
    turns_per_replica: dict[str, int] = Field(default_factory=dict)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def solved_flags(rollouts: Sequence[Rollout]) -> list[bool]:
    """Whether each rollout was solved, for those whose env says (``info["env"]["solved"]``, a bool)."""
    said = [solved(r) for r in rollouts]
    return [s for s in said if s is not None]


def request_prompts(rollout: Rollout) -> list[Sequence[int]]:
    ids = rollout.tokens.token_id
    return [ids[turn.prompt_start: turn.prompt_end] for turn in rollout.turns]


def sampled(rollout: Rollout) -> list[Sequence[int]]:
    """Each turn's completion as sampled."""
    ids = rollout.tokens.token_id
    return [ids[turn.prompt_end: turn.completion_end] for turn in rollout.turns]


def recorded_conversation(rollout: Rollout) -> tuple[list[Message], list[dict] | None]:
    """The messages and tools the rollout loop recorded in ``info`` (what a re-rendering harness keeps)."""
    return [Message.model_validate(m) for m in rollout.info.get("messages", [])], rollout.info.get("tools")


def rerendered_prompts(rollout: Rollout, renderer: Any) -> list[Sequence[int]]:
    """Each turn's prompt as a re-rendering harness would send it: the template over the messages so far."""
    messages, tools = recorded_conversation(rollout)
    ours = request_prompts(rollout)
    prompts = []
    for message_end, message in enumerate(messages):
        if message.role != "assistant" or len(prompts) == len(ours):
            continue
        try:
            prompts.append(renderer.render(messages[:message_end], tools=tools,
                                           add_generation_prompt=True).token_ids)
        except VerbatimError:  # the template refuses this history: count the prompt we really sent
            prompts.append(ours[len(prompts)])
    return prompts


def ignored_fields(rollouts: Sequence[Rollout]) -> dict[str, int]:
    """Request fields an agent's endpoint ignored (``info["agent"]["ignored_fields"]``), summed over rollouts."""
    agents = [r.info.get("agent") for r in rollouts]
    return summed(a.get("ignored_fields") for a in agents if isinstance(a, dict))


def summed(counts: Iterable[dict[str, int] | None]) -> dict[str, int]:
    """Counts by name, added up (a missing dict counts nothing), sorted by name."""
    total: dict[str, int] = {}
    for each in counts:
        for name, count in (each or {}).items():
            total[name] = total.get(name, 0) + int(count)
    return dict(sorted(total.items()))


def routing_totals(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """Admission wait, migrations and their lost context, and turns per replica, from the turns and routes."""
    per_replica: dict[str, int] = {}
    migrations = lost = 0
    wait = 0.0
    for rollout in rollouts:
        for turn in rollout.turns:
            wait += turn.admission_wait_s
            if turn.replica is not None:
                per_replica[turn.replica] = per_replica.get(turn.replica, 0) + 1
        for decision in rollout.info.get("routes") or ():
            if isinstance(decision, dict) and decision.get("migrated_from") is not None:
                migrations += 1
                lost += int(decision.get("lost_tokens") or 0)
    return {"admission_wait_s": wait, "migrations": migrations, "migration_lost_tokens": lost,
            "turns_per_replica": dict(sorted(per_replica.items()))}


def cut_by_max_turns(rollout: Rollout) -> bool:
    """Whether --max-turns ended ``rollout`` (an env's episode not done, or an agent that asked for more)."""
    return rollout.status == "truncated" and (rollout.error or "").startswith(MAX_TURNS)


def first_error(rollouts: Sequence[Rollout]) -> str | None:
    return next((r.error for r in rollouts if r.status in FAILED_STATUSES), None)


def outcome_line(statuses: dict[str, int], *, cut: int = 0, breaks: int = 0, first: str | None = None) -> str | None:
    """One line for what went wrong with a run's or a step's rollouts: how many failed (and the first reason),
    how many --max-turns cut, how many history breaks agents made; None when none of it happened."""
    total = sum(statuses.values())
    failed = {status: statuses[status] for status in FAILED_STATUSES if statuses.get(status)}
    parts = []
    if failed:
        kinds = ", ".join(f"{count} {status}" for status, count in failed.items())
        parts.append(f"{sum(failed.values())} of {total} rollouts failed ({kinds}: no reward)"
                     + (f", first: {' '.join(first.split())[:200]}" if first else ""))
    if cut:
        parts.append(f"{cut} of {total} were cut at --max-turns")
    if breaks:
        parts.append(f"{breaks} history breaks (agents rewrote their history; 'verbatim lint trace' says where)")
    return "; ".join(parts) or None


def summarize(rollouts: Sequence[Rollout], *, block_size: int, wall_s: float = 0.0,
              renderer: Any = None) -> RunSummary:
    turns = [t for r in rollouts for t in r.turns]
    prompt = sum(t.prompt_tokens for t in turns)
    breaks = [len(r.segments()) - 1 for r in rollouts]
    cached = sum(t.cached_tokens for t in turns)
    statuses: dict[str, int] = {}
    for r in rollouts:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    rewards = [r.reward for r in rollouts if r.reward is not None]
    flags = solved_flags(rollouts)
    rerender = None
    if renderer is not None:
        rerender = min_prefill(pair for r in rollouts for piece in r.segments()
                               for pair in zip(rerendered_prompts(piece, renderer), sampled(piece)))
    return RunSummary(
        rollouts=len(rollouts), turns=len(turns), prompt_tokens=prompt, cached_tokens=cached,
        prefill_tokens=prompt - cached,
        min_prefill_tokens=min_prefill(pair for r in rollouts for pair in zip(request_prompts(r), sampled(r))),
        rerender_prefill_tokens=rerender,
        generated_tokens=sum(t.completion_tokens for t in turns), block_size=block_size, wall_s=wall_s,
        statuses=statuses, mean_reward=sum(rewards) / len(rewards) if rewards else None,
        rewards_left_out=len(rollouts) - len(rewards),
        cut_at_max_turns=sum(cut_by_max_turns(r) for r in rollouts), first_error=first_error(rollouts),
        solved=sum(flags) if flags else None, success_rate=sum(flags) / len(flags) if flags else None,
        history_breaks=sum(breaks), broken_rollouts=sum(1 for b in breaks if b),
        ignored_request_fields=ignored_fields(rollouts),
        **routing_totals(rollouts),
    )
