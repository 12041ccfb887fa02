"""Checks a run's trace can be trusted: ``verbatim lint trace``.

Pure checks over :class:`~verbatim.datamodel.Rollout` records plus the cache
settings from the manifest; only :func:`lint_run` touches the disk. For every
rollout:

* **layout** — turn indices run 0, 1, …; each turn's prompt extends the
  previous turn's full sequence (``prompt_end`` ≥ the previous ``completion_end``);
  the tokens before the first completion are prompt tokens, those between turns
  env tokens, completions model tokens; the ``turn`` column names the turn each
  token belongs to.
* **sampling** — every model token has a finite logprob ≤ 0 and a version ≥ 0;
  every other token has logprob NaN and version −1.
* **version order** — the versions of model tokens never decrease.
* **cache** — turn k (k ≥ 1) should find in the prefix cache what turn k−1
  computed (:func:`verbatim.prefix_cache.reusable_prefix`, with the engine block
  size the manifest records); a shortfall names its likely cause
  (:func:`verbatim.lint.findings.miss_cause`).
* **routing** — in a run that recorded routed experts (``--record-routing``), every token before a sequence's
  last model token has them (what ``--routing-replay`` replays), and they were recorded under the version of
  the KV they were computed with: a cached prompt token's under one the KV provenance names for it, a computed
  prompt token's under the version that sampled the turn's first token.
* **duplicates** — a rollout id appears once in the run.
* **episodes** (findings, not token problems) — a rollout that failed (``error``, ``interrupted``: no reward)
  or was cut (``truncated``, by ``--max-turns`` or the context) is listed with its recorded reason; a failed
  one makes ``lint trace`` exit 1 (``--tokens-only`` judges the tokens alone).
* **history breaks** — an agent that rewrote its history left a rollout of several segments
  (:meth:`~verbatim.datamodel.Rollout.segments`): each break is a ``history_break`` naming the message,
  its role and the first field that changed, and what it cost (the new segment's first request prefilled
  its prompt again); every check above then runs within each segment.

First turns are not checked against other rollouts of their group: a group's
first requests run concurrently and the engine cannot reuse blocks that a
concurrent request is still computing, so a shortfall there is not a defect.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from verbatim.datamodel import Rollout, Source
from verbatim.lint.completeness import run_state
from verbatim.lint.findings import (
    CacheSettings,
    Problem,
    RolloutVerdict,
    TraceReport,
    episode_findings,
    miss_cause,
    sampled_version,
    turn_replicas,
)
from verbatim.lint.group import check_groups
from verbatim.prefix_cache import reusable_prefix

POSITIVE_LOGPROB_TOLERANCE = 1e-3


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def lint_run(run_dir: str | os.PathLike[str], *, groups: bool = False) -> TraceReport:
    """Read a run directory and lint it (raises TraceFormatError for a path that is not a trace, or
    whose manifest does not record the engine's block size).

    ``groups`` adds the opt-in group check of :mod:`verbatim.lint.group`.
    """
    from verbatim.harness.store import read_run

    trace = read_run(run_dir)
    settings = CacheSettings.from_manifest(trace.manifest, run_dir)
    report = lint_rollouts(trace.rollouts, settings)
    if groups:
        report.verdicts.extend(check_groups(trace.rollouts, settings))
    for problem in trace.problems:
        report.verdicts.append(RolloutVerdict(None, None, (Problem("damaged_file", None, problem),)))
    report.run = run_state(trace.manifest, trace.rollouts)
    return report


def lint_rollouts(rollouts: list[Rollout], settings: CacheSettings) -> TraceReport:
    seen: set[str] = set()
    report = TraceReport()
    for rollout in rollouts:
        problems = list(lint_rollout(rollout, settings))
        if rollout.rollout_id in seen:
            problems.append(Problem("duplicate", None, f"rollout id {rollout.rollout_id!r} appears more than "
                                    "once in the run (a resumed run redid it?)"))
        seen.add(rollout.rollout_id)
        report.verdicts.append(RolloutVerdict(rollout.rollout_id, rollout.group_id, tuple(problems),
                                              rollout.status, len(rollout.turns), episode_findings(rollout)))
    return report


def lint_rollout(rollout: Rollout, settings: CacheSettings) -> list[Problem]:
    """Every problem of one rollout, in check order (each segment's in turn, after its history breaks)."""
    pieces = rollout.segments()
    problems = check_breaks(rollout, pieces) if len(pieces) > 1 else []
    for piece in pieces:
        problems += _lint_sequence(piece, settings)
    return problems


def _lint_sequence(rollout: Rollout, settings: CacheSettings) -> list[Problem]:
    problems = check_extension(rollout)
    if not problems:  # spans are only meaningful when the offsets are
        problems += check_spans(rollout)
    problems += check_sampling(rollout)
    problems += check_version_order(rollout)
    if not any(p.kind == "extension" for p in problems):
        problems += check_cache(rollout, settings)
    problems += check_routing(rollout, settings.routing)
    return problems


def check_routing(rollout: Rollout, recorded: bool) -> list[Problem]:
    """In a run that recorded routed experts, every token a loss token reads (each before the last model token)
    has them: what ``--routing-replay`` needs, and the trainer refuses a row without."""
    experts, tokens = rollout.tokens.routed_experts, rollout.tokens
    model = np.flatnonzero(tokens.source == Source.MODEL)
    if not (recorded or experts is not None) or not len(model):
        return []
    if experts is None:
        return [Problem("routing", None, "the run recorded routed experts, but this sequence has none")]
    missing = np.flatnonzero((experts[:int(model[-1])] < 0).any(axis=(1, 2)))
    problems = []
    if len(missing):
        at = int(missing[0])
        problems.append(Problem("routing", int(tokens.turn[at]), f"{len(missing)} token(s) without routed experts "
                                f"before the last sampled one, the first at token {at}"))
    return problems + check_routing_versions(rollout)


def check_routing_versions(rollout: Rollout) -> list[Problem]:
    """The experts of a sequence come with its last turn's request: those of the prompt tokens it read from the
    cache were computed with that KV (the versions the KV provenance names), those it computed by the version
    that sampled its first token."""
    tokens, last = rollout.tokens, rollout.turns[-1] if rollout.turns else None
    if last is None or not last.completion_tokens or tokens.experts_version is None:
        return []
    versions, start, cached = tokens.experts_version, last.prompt_start, last.cached_tokens
    problems = []
    read = set(versions[start:start + cached].tolist()) - set(last.kv_versions)
    if cached and last.kv_versions and read:
        problems.append(Problem("routing_version", last.index, f"the experts of its {cached} cached prompt tokens "
                                f"were recorded under version(s) {sorted(read)}, its KV under "
                                f"{list(last.kv_versions)}"))
    sampled_by = int(tokens.policy_version[last.prompt_end])
    computed = set(versions[start + cached:last.prompt_end].tolist()) - {sampled_by}
    if computed:
        problems.append(Problem("routing_version", last.index, f"the experts of the prompt tokens it computed were "
                                f"recorded under version(s) {sorted(computed)}, its first token sampled by "
                                f"{sampled_by}"))
    return problems


def check_breaks(rollout: Rollout, pieces: tuple[Rollout, ...]) -> list[Problem]:
    """One ``history_break`` per later segment: where the agent's history changed, and the prefill it cost."""
    records = list(rollout.info.get("segments") or ())
    problems = []
    for k, piece in enumerate(pieces[1:]):
        record = records[k] if k < len(records) and isinstance(records[k], dict) else {}
        first = piece.turns[0] if piece.turns else None
        what = record.get("what") or "the trace does not say what changed"
        cost = (f"; its first request prefilled {first.prompt_tokens - first.cached_tokens} of its "
                f"{first.prompt_tokens} prompt tokens again" if first is not None else "")
        start = rollout.turns[first.index].prompt_start if first is not None else record.get("start", "?")
        problems.append(Problem("history_break", first.index if first else None,
                                f"the agent rewrote its history: {what}; segment {k + 1} starts at token "
                                f"{start}{cost}"))
    return problems


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def check_extension(rollout: Rollout) -> list[Problem]:
    """Turn indices in order; each prompt extends the previous turn's full sequence."""
    problems = []
    previous_end = 0
    first = rollout.turns[0].index if rollout.turns and rollout.info.get("segment") else 0
    for position, turn in enumerate(rollout.turns):
        if turn.index != first + position:
            problems.append(Problem("extension", turn.index, f"turn at position {position} has index "
                                    f"{turn.index}; turns must be numbered {first}, {first + 1}, … in order"))
        if position == 0 and turn.prompt_end == 0:
            problems.append(Problem("extension", turn.index, "the first turn has an empty prompt"))
        if turn.prompt_end < previous_end:
            problems.append(Problem("extension", turn.index, f"prompt ends at token {turn.prompt_end}, inside "
                                    f"the previous turn's sequence (which ends at {previous_end}): the "
                                    "history was rewritten, not extended"))
        previous_end = max(previous_end, turn.completion_end)
    return problems


def expected_spans(rollout: Rollout) -> list[tuple[int, int, Source, int, str]]:
    """(start, end, source, turn column value, label) for every span of a well-formed rollout."""
    turns, n = rollout.turns, len(rollout.tokens)
    if not turns:
        return [(0, n, Source.PROMPT, 0, "the prompt")]
    first = turns[0].index  # a later segment's turns go on counting from the rollout's
    spans = [(0, turns[0].prompt_end, Source.PROMPT, first, "the prompt")]
    for k, turn in enumerate(turns):
        if k:
            spans.append((turns[k - 1].completion_end, turn.prompt_end, Source.ENV, turn.index,
                          f"the env tokens before turn {turn.index}"))
        spans.append((turn.prompt_end, turn.completion_end, Source.MODEL, turn.index,
                      f"turn {turn.index}'s completion"))
    spans.append((turns[-1].completion_end, n, Source.ENV, turns[-1].index + 1, "the env tokens after the last turn"))
    return spans


def check_spans(rollout: Rollout) -> list[Problem]:
    """Sources and the turn column agree with the turn offsets."""
    problems = []
    source, turn_column = rollout.tokens.source, rollout.tokens.turn
    for start, end, expected, turn_value, label in expected_spans(rollout):
        where = min(turn_value, rollout.turns[-1].index if rollout.turns else 0)
        wrong = np.flatnonzero(source[start:end] != expected)
        if len(wrong):
            at = start + int(wrong[0])
            problems.append(Problem("source", where, f"{len(wrong)} token(s) in {label} have the wrong source "
                                    f"(token {at} is {_source_name(source[at])}, expected {expected.name.lower()})"))
        misplaced = np.flatnonzero(turn_column[start:end] != turn_value)
        if len(misplaced):
            at = start + int(misplaced[0])
            problems.append(Problem("turn_column", where, f"{len(misplaced)} token(s) in {label} carry the wrong "
                                    f"turn (token {at} says {int(turn_column[at])}, expected {turn_value})"))
    return problems


def _source_name(value: Any) -> str:
    try:
        return Source(int(value)).name.lower()
    except ValueError:
        return f"unknown source {int(value)}"


# ---------------------------------------------------------------------------
# Sampling columns
# ---------------------------------------------------------------------------


def check_sampling(rollout: Rollout) -> list[Problem]:
    """Model tokens: finite logprob ≤ 0 and version ≥ 0. Other tokens: NaN and −1."""
    tokens = rollout.tokens
    model = tokens.source == Source.MODEL
    other = ~model
    finite = np.isfinite(tokens.logprob)
    rules = [
        ("logprob", model & ~finite, "model token(s) without a finite logprob"),
        ("logprob", model & finite & (tokens.logprob > POSITIVE_LOGPROB_TOLERANCE),
         "model token(s) with a positive logprob"),
        ("version", model & (tokens.policy_version < 0), "model token(s) without a policy version (< 0)"),
        ("logprob", other & ~np.isnan(tokens.logprob), "prompt/env token(s) carrying a logprob (expected NaN)"),
        ("version", other & (tokens.policy_version != -1), "prompt/env token(s) carrying a version (expected -1)"),
    ]
    problems = []
    for kind, bad, what in rules:
        for turn, positions in _by_turn(tokens.turn, np.flatnonzero(bad)):
            problems.append(Problem(kind, turn, f"{len(positions)} {what}, first at token {positions[0]}"))
    return problems


def _by_turn(turn_column: np.ndarray, positions: np.ndarray) -> list[tuple[int, list[int]]]:
    grouped: dict[int, list[int]] = {}
    for at in positions.tolist():
        grouped.setdefault(int(turn_column[at]), []).append(at)
    return sorted(grouped.items())


def check_version_order(rollout: Rollout) -> list[Problem]:
    """Policy versions of model tokens never decrease along the rollout."""
    tokens = rollout.tokens
    positions = np.flatnonzero(tokens.source == Source.MODEL)
    versions = tokens.policy_version[positions]
    drops = np.flatnonzero(np.diff(versions) < 0)
    problems = []
    for d in drops.tolist():
        at = int(positions[d + 1])
        problems.append(Problem("version_order", int(tokens.turn[at]),
                                f"policy version drops from {int(versions[d])} to {int(versions[d + 1])} "
                                f"at token {at}"))
    return problems


# ---------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------


def check_cache(rollout: Rollout, settings: CacheSettings) -> list[Problem]:
    problems = []
    for k in range(1, len(rollout.turns)):
        previous, turn = rollout.turns[k - 1], rollout.turns[k]
        reusable = reusable_prefix(previous, turn, settings.block_size)
        if turn.cached_tokens < reusable:
            problems.append(Problem(
                "cache_shortfall", turn.index,
                f"{turn.cached_tokens} of {reusable} reusable prompt tokens came from the cache "
                f"({reusable - turn.cached_tokens} prefilled again; block size {settings.block_size})",
                shortfall_cause(rollout, k, settings)))
    return problems


def shortfall_cause(rollout: Rollout, k: int, settings: CacheSettings) -> str:
    """Why turn k missed what turn k−1 computed (see :func:`~verbatim.lint.findings.miss_cause`)."""
    previous, turn = rollout.turns[k - 1], rollout.turns[k]
    replicas = turn_replicas(rollout)
    return miss_cause(replicas[k - 1: k + 1] if replicas is not None else None,
                      [previous.cache_salt, turn.cache_salt],
                      [sampled_version(rollout, previous, last=True), sampled_version(rollout, turn, last=False)],
                      settings)
