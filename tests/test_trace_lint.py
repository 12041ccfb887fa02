"""verbatim lint trace: a clean trace passes; every kind of defect is found, with the cache miss's cause."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Completion, Rollout, Source, TokenColumns, Turn
from verbatim.errors import TraceFormatError
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.lint.trace import CacheSettings, lint_rollout, lint_rollouts, lint_run, reusable_prefix

runner = CliRunner()
BLOCK = 16
KEEP = CacheSettings(block_size=BLOCK, cache_policy="keep")


def engine_max_cached(prompt_len: int) -> int:
    """The most an engine with BLOCK-token blocks can serve from cache: whole blocks, never the last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


def make_rollout(rid: str = "r0", group: str = "g0", *, turns: int = 3, prompt_len: int = 40, sampled: int = 10,
                 obs: int = 7, cached: dict[int, int] | None = None, salts: list | None = None,
                 versions: list[int] | None = None, info: dict | None = None, seed: int = 0) -> Rollout:
    """A rollout built by the Ledger, each turn served as much from cache as the engine can (unless ``cached``)."""
    rng = np.random.default_rng(seed)
    ledger = Ledger()
    ledger.append_prompt(rng.integers(0, 50_000, prompt_len))
    for k in range(turns):
        n = len(ledger)
        ledger.append_completion(Completion(
            token_ids=rng.integers(0, 50_000, sampled), logprobs=-rng.exponential(1.0, sampled),
            versions=np.full(sampled, versions[k] if versions else 0), finish_reason="stop", prompt_tokens=n,
            cached_tokens=(cached or {}).get(k, engine_max_cached(n) if k else 0),
            cache_salt=salts[k] if salts else None))
        if k < turns - 1:
            ledger.append_observation(rng.integers(0, 50_000, obs))
    return ledger.to_rollout(run_id="run", group_id=group, rollout_id=rid, reward=1.0, info=info or {})


def with_columns(rollout: Rollout, **changes: dict[int, float]) -> Rollout:
    """A copy with single token values changed: column name → {position: value}."""
    columns = {name: np.array(values) for name, values in rollout.tokens.as_dict().items()}
    for name, edits in changes.items():
        for at, value in edits.items():
            columns[name][at] = value
    return rollout.model_copy(update={"tokens": TokenColumns(**columns)})


def kinds(problems) -> list[tuple[str, int | None]]:
    return [(p.kind, p.turn) for p in problems]


def write_run(path: Path, batches: list[list[Rollout]], status: str = "completed", config: dict | None = None,
              **engine) -> Path:
    manifest = RunManifest(run_id="run", engine={"block_size": BLOCK, **engine}, config=config or {})
    writer = TraceWriter(path, manifest)
    for batch in batches:
        writer.write_batch(batch)
    writer.write_manifest(manifest.model_copy(update={"status": status}))
    return path


def json_lines(stdout: str) -> tuple[list[dict], dict]:
    """``lint trace --json``: one line per rollout or file, then the run's line."""
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines[-1]["kind"] == "run", lines[-1]
    return lines[:-1], lines[-1]


# ---------------------------------------------------------------------------
# Clean traces
# ---------------------------------------------------------------------------


def test_clean_trace_passes(tmp_path: Path):
    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", turns=1 + i % 3, seed=i) for i in range(6)]
    run = write_run(tmp_path / "run", [rollouts[:3], rollouts[3:]], cache_policy="keep")
    report = lint_run(run)
    assert report.ok and len(report.verdicts) == 6 and report.exit_code() == 0
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    assert result.exit_code == 0, result.output
    lines, whole = json_lines(result.stdout)
    assert whole["complete"] is True and whole["written"] == 6 and whole["status"] == "completed"
    assert [line["rollout_id"] for line in lines] == [f"r{i}" for i in range(6)]
    assert all(line["ok"] is True and line["problems"] == [] and line["group_id"] for line in lines)
    table = runner.invoke(app, ["lint", "trace", str(run)])
    assert table.exit_code == 0 and "6/6 rollouts' tokens clean" in table.stdout


def test_first_turn_without_cache_hits_is_not_a_problem():
    assert lint_rollout(make_rollout(cached={0: 0}), KEEP) == []


versions = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(sorted)


@settings(max_examples=40, deadline=None)
@given(versions=versions, prompt_len=st.integers(1, 60), sampled=st.integers(1, 20), obs=st.integers(0, 20),
       salt=st.none() | st.text(max_size=4), seed=st.integers(0, 99))
def test_any_ledger_trace_served_from_cache_is_clean(versions, prompt_len, sampled, obs, salt, seed):
    rollout = make_rollout(turns=len(versions), prompt_len=prompt_len, sampled=sampled, obs=obs, seed=seed,
                           versions=versions, salts=[salt] * len(versions))
    assert lint_rollout(rollout, CacheSettings(block_size=BLOCK, cache_policy="flush")) == []


# ---------------------------------------------------------------------------
# Layout and sampling defects
# ---------------------------------------------------------------------------


def test_broken_extension_is_found():
    rollout = make_rollout()
    turns = list(rollout.turns)
    turns[1] = turns[1].model_copy(update={"prompt_end": turns[0].completion_end - 3})
    problems = lint_rollout(rollout.model_copy(update={"turns": tuple(turns)}), KEEP)
    assert ("extension", 1) in kinds(problems)
    assert "history was rewritten" in problems[0].detail
    assert not any(p.kind == "cache_shortfall" for p in problems)


def test_misnumbered_turns_are_found():
    rollout = make_rollout()
    turns = list(rollout.turns)
    turns[2] = turns[2].model_copy(update={"index": 5})
    assert ("extension", 5) in kinds(lint_rollout(rollout.model_copy(update={"turns": tuple(turns)}), KEEP))


def test_wrong_source_between_turns_is_found():
    rollout = make_rollout()
    env_at = rollout.turns[0].completion_end + 2  # an observation token before turn 1
    problems = lint_rollout(with_columns(rollout, source={env_at: Source.PROMPT}), KEEP)
    assert kinds(problems) == [("source", 1)]
    assert f"token {env_at} is prompt, expected env" in problems[0].detail


def test_model_token_outside_a_completion_is_found():
    rollout = make_rollout()
    prompt_at = 3
    problems = lint_rollout(with_columns(rollout, source={prompt_at: Source.MODEL}), KEEP)
    assert ("source", 0) in kinds(problems)
    assert ("logprob", 0) in kinds(problems) and ("version", 0) in kinds(problems)  # a "model" token without μ


def test_wrong_turn_column_is_found():
    rollout = make_rollout()
    at = rollout.turns[2].prompt_end + 1
    assert kinds(lint_rollout(with_columns(rollout, turn={at: 1}), KEEP)) == [("turn_column", 2)]


@pytest.mark.parametrize("value,needle", [(np.nan, "without a finite logprob"), (np.inf, "without a finite logprob"),
                                          (0.5, "positive logprob")])
def test_bad_logprob_on_a_model_token_is_found(value, needle):
    rollout = make_rollout()
    at = rollout.turns[1].prompt_end + 4
    problems = lint_rollout(with_columns(rollout, logprob={at: value}), KEEP)
    assert kinds(problems) == [("logprob", 1)] and needle in problems[0].detail and f"token {at}" in problems[0].detail


def test_missing_version_on_a_model_token_is_found():
    rollout = make_rollout()
    at = rollout.turns[2].completion_end - 1
    problems = lint_rollout(with_columns(rollout, policy_version={at: -1}), KEEP)
    assert ("version", 2) in kinds(problems)


def test_env_token_with_logprob_or_version_is_found():
    rollout = make_rollout()
    at = rollout.turns[0].completion_end  # first observation token
    problems = lint_rollout(with_columns(rollout, logprob={at: -0.3}, policy_version={at: 0}), KEEP)
    assert sorted(kinds(problems)) == [("logprob", 1), ("version", 1)]


def test_version_decrease_is_found():
    problems = lint_rollout(make_rollout(versions=[0, 2, 1]), KEEP)
    assert kinds(problems) == [("version_order", 2)]
    assert "drops from 2 to 1" in problems[0].detail


# ---------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("prev,prompt_end,expected", [
    ((100, 150), 170, 144),   # KV of 149 tokens (the last sampled one never computed) → 9 blocks
    ((100, 145), 150, 144),   # 144 computed tokens fill exactly 9 blocks
    ((100, 144), 150, 128),   # 143 computed tokens: the 9th block is incomplete
    ((100, 100), 120, 96),    # an empty completion: the whole previous prompt was computed
    ((100, 150), 150, 144),   # no observation: capped by prompt - 1 = 149
    ((10, 12), 13, 0),        # less than one block
])
def test_reusable_prefix(prev, prompt_end, expected):
    previous = Turn(index=0, prompt_end=prev[0], completion_end=prev[1])
    turn = Turn(index=1, prompt_end=prompt_end, completion_end=prompt_end + 5)
    assert reusable_prefix(previous, turn, BLOCK) == expected


def test_shortfall_boundary_is_exact():
    rollout = make_rollout(turns=2, prompt_len=40, sampled=10, obs=7)  # turn 0: 40 + 10 tokens → 49 computed
    assert reusable_prefix(*rollout.turns, BLOCK) == 48
    assert lint_rollout(make_rollout(turns=2, cached={1: 48}), KEEP) == []
    problems = lint_rollout(make_rollout(turns=2, cached={1: 32}), KEEP)
    assert kinds(problems) == [("cache_shortfall", 1)] and "32 of 48 reusable" in problems[0].detail


@pytest.mark.parametrize("policy,kwargs,cause", [
    ("keep", {}, "eviction"),
    ("keep", {"versions": [0, 1, 1]}, "eviction"),           # keep: a weight update does not clear the cache
    ("flush", {}, "eviction"),                               # flush, but no update between the turns
    ("flush", {"versions": [0, 1, 1]}, "flush"),
    ("keep", {"salts": ["a", "b", "b"]}, "salt"),
    ("salt", {"salts": ["v0", "v1", "v1"], "versions": [0, 1, 1]}, "salt"),
    ("keep", {"info": {"replicas": ["r0", "r1", "r1"]}}, "replica"),
    ("keep", {"info": {"replicas": ["r0", "r0", "r0"]}}, "eviction"),
])
def test_cache_shortfall_cause(policy, kwargs, cause):
    rollout = make_rollout(cached={1: 0}, **kwargs)
    problems = lint_rollout(rollout, CacheSettings(block_size=BLOCK, cache_policy=policy))
    assert kinds(problems) == [("cache_shortfall", 1)]
    assert problems[0].cause == cause


def test_cause_comes_from_the_manifest(tmp_path: Path):
    run = write_run(tmp_path / "run", [[make_rollout(cached={2: 16}, versions=[0, 0, 3])]], cache_policy="flush")
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    assert result.exit_code == 1, result.output
    (line,), _ = json_lines(result.stdout)
    assert line["ok"] is False
    assert line["problems"] == [{"kind": "cache_shortfall", "turn": 2, "cause": "flush",
                                 "detail": line["problems"][0]["detail"]}]
    table = runner.invoke(app, ["lint", "trace", str(run)])
    text = " ".join(table.stdout.split())
    assert table.exit_code == 1 and "[cause: flush]" in text and "0/1 rollouts' tokens clean" in text


def test_block_size_comes_from_the_manifest(tmp_path: Path):
    # turn 0 computed 40 + 10 - 1 = 49 tokens: turn 1 can reuse 48 with 16-token blocks, 32 with 32, 0 with 128
    partial, none = make_rollout("a", turns=2, cached={1: 32}), make_rollout("b", turns=2, cached={1: 0})
    writer = TraceWriter(tmp_path / "b32", RunManifest(run_id="run", engine={"block_size": 32}))
    writer.write_batch([partial, none])
    a, b = lint_run(tmp_path / "b32").verdicts
    assert a.ok and kinds(b.problems) == [("cache_shortfall", 1)]
    assert "0 of 32 reusable" in b.problems[0].detail and "block size 32" in b.problems[0].detail
    a, b = lint_run(write_run(tmp_path / "b16", [[partial, none]])).verdicts
    assert kinds(a.problems) == [("cache_shortfall", 1)] and "32 of 48 reusable" in a.problems[0].detail


@pytest.mark.parametrize("engine,said", [({}, "does not record the engine's block size"),
                                         ({"block_size": "32"}, "records an invalid ('32') engine block size"),
                                         ({"block_size": 0}, "records an invalid (0) engine block size")])
def test_a_manifest_without_the_engine_block_size_is_refused_in_one_line(tmp_path: Path, engine, said):
    writer = TraceWriter(tmp_path / "run", RunManifest(run_id="run", engine=engine))
    writer.write_batch([make_rollout(turns=2, cached={1: 0})])
    with pytest.raises(TraceFormatError, match="engine.block_size"):
        lint_run(tmp_path / "run")
    result = runner.invoke(app, ["lint", "trace", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0]
    assert '"block_size": N' in lines[0] and "manifest.json" in lines[0]


# ---------------------------------------------------------------------------
# The run as a whole
# ---------------------------------------------------------------------------

PLAN = {"plan": {"groups": 2, "group_size": 2}}


@pytest.mark.parametrize("status,written,why", [
    ("running", 4, "still says running"),          # killed: the manifest was never finished
    ("interrupted", 2, "the run ended interrupted"),
    ("failed", 4, "the run ended failed"),
    ("completed", 3, "1 of 4 planned rollouts were never written"),
])
def test_a_clean_but_incomplete_run_is_not_called_clean(tmp_path: Path, status, written, why):
    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", seed=i) for i in range(written)]
    run = write_run(tmp_path / "run", [rollouts], status=status, config=PLAN)
    table = runner.invoke(app, ["lint", "trace", str(run)])
    text = " ".join(table.stdout.split())
    assert table.exit_code == 1, text
    assert f"{written}/{written} rollouts' tokens clean" in text
    assert f"run {status}, {written}/4 planned rollouts" in text
    assert why in text
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    _, whole = json_lines(result.stdout)
    assert result.exit_code == 1 and whole["complete"] is False and whole["planned"] == 4
    only = runner.invoke(app, ["lint", "trace", str(run), "--tokens-only"])
    assert only.exit_code == 0, only.output  # asked about the written tokens only: they are clean


@pytest.mark.parametrize("field", ["config", "status"])
def test_a_manifest_without_the_fields_the_verdict_reads_is_not_called_complete(tmp_path: Path, field):
    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", seed=i) for i in range(4)]
    run = write_run(tmp_path / "run", [rollouts], config=PLAN)
    raw = json.loads((run / "manifest.json").read_text())
    del raw[field]  # a manifest edited, or written by another tool
    (run / "manifest.json").write_text(json.dumps(raw))
    table = runner.invoke(app, ["lint", "trace", str(run)])
    text = " ".join(table.stdout.split())
    assert table.exit_code == 1, text
    assert f"incomplete: the manifest records no {field}" in text
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    _, whole = json_lines(result.stdout)
    assert result.exit_code == 1 and whole["complete"] is False and whole["missing"] == [field]


def test_errors_are_counted_and_a_training_runs_plan_is_steps_of_groups(tmp_path: Path):
    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", seed=i) for i in range(8)]
    rollouts[5] = rollouts[5].model_copy(update={"status": "error", "error": "EnvError: the sandbox died"})
    config = {"train": {"plan": {"steps": 2, "groups": 2, "group_size": 2}}}
    run = write_run(tmp_path / "run", [rollouts], config=config)
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    _, whole = json_lines(result.stdout)
    assert (whole["planned"], whole["written"], whole["errors"]) == (8, 8, 1)
    assert whole["first_error"] == "EnvError: the sandbox died" and whole["complete"] is True


def test_damaged_file_is_a_problem(tmp_path: Path):
    run = write_run(tmp_path / "run", [[make_rollout("a")], [make_rollout("b")]])
    damaged = run / "rollouts-000002.parquet"
    damaged.write_bytes(damaged.read_bytes()[:50])
    result = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    assert result.exit_code == 1
    lines, _ = json_lines(result.stdout)
    assert lines[0] == {"rollout_id": "a", "group_id": "g0", "ok": True, "status": "ok", "problems": [],
                        "findings": []}
    assert lines[1]["rollout_id"] is None and lines[1]["ok"] is False
    assert lines[1]["problems"][0]["kind"] == "damaged_file" and damaged.name in lines[1]["problems"][0]["detail"]


def test_duplicate_rollout_is_a_problem():
    report = lint_rollouts([make_rollout("a"), make_rollout("b"), make_rollout("a")], KEEP)
    assert [v.ok for v in report.verdicts] == [True, True, False]
    assert kinds(report.verdicts[2].problems) == [("duplicate", None)]


def test_errored_and_truncated_rollouts_are_findings_with_sound_tokens():
    """Their tokens are checked like any others'; the failed one makes lint exit 1, the cut one is listed."""
    ledger = Ledger()
    ledger.append_prompt([1, 2, 3])
    errored = ledger.to_rollout(run_id="run", group_id="g", rollout_id="e", status="error", error="env raised")
    cut = make_rollout("t").model_copy(update={"status": "truncated", "error": "max turns (2) reached",
                                               "reward": None})
    report = lint_rollouts([errored, cut], KEEP)
    assert report.ok and report.failed == 1 and report.exit_code() == 1 and report.exit_code(tokens_only=True) == 0
    assert [f.as_json() for f in report.verdicts[0].findings] == [
        {"kind": "failed", "turn": None, "detail": "error: env raised; no reward"}]
    assert [f.detail for f in report.verdicts[1].findings] == ["max turns (2) reached; no reward"]
    assert lint_rollouts([cut], KEEP).exit_code() == 0  # a cut episode is an ordinary outcome
    nan_model = with_columns(make_rollout("x"), logprob={45: np.nan}).model_copy(update={"status": "error",
                                                                                          "error": "boom"})
    assert not lint_rollouts([nan_model], KEEP).ok


def test_not_a_trace_is_exit_2(tmp_path: Path):
    result = runner.invoke(app, ["lint", "trace", str(tmp_path)])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a verbatim run" in lines[0]


# ---------------------------------------------------------------------------
# Opt-in group check: the shared prompt is prefilled once per group
# ---------------------------------------------------------------------------


def group_of(first_cached: list[int], *, salts: list | None = None, same_prompt: bool = True) -> list[Rollout]:
    """Members of one group with the same 40-token prompt (seed 0) and different completions."""
    members = []
    for i, cached in enumerate(first_cached):
        r = make_rollout(f"m{i}", "g", turns=2, prompt_len=40, cached={0: cached},
                         salts=[salts[i]] * 2 if salts else None, seed=0 if same_prompt else 100 + i)
        members.append(r)
    return members


def test_group_check_numbers():
    from verbatim.lint.group import group_reusable
    from verbatim.prefix_cache import shared_prefix

    a, b = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 9, 4])
    assert shared_prefix(a, b) == 2 and shared_prefix(a, a) == 5 and shared_prefix(a, a[:0]) == 0
    members = group_of([0, 32])
    assert group_reusable(members[0], members[1:], BLOCK) == 32  # 40-token prompt: min(40, 39) → 2 blocks


@pytest.mark.parametrize("first_cached,salts,expected", [
    ([0, 32, 32, 32], None, None),                      # the group's first request alone prefilled the prompt
    ([0, 0, 32, 32], None, "eviction"),
    ([0, 16, 32, 32], None, "eviction"),                # a partial hit is a miss too
    ([0, 0, 32, 32], ["a", "b", "a", "a"], "salt"),
])
def test_group_prefilled_more_than_once(first_cached, salts, expected):
    from verbatim.lint.group import check_groups

    verdicts = check_groups(group_of(first_cached, salts=salts), KEEP)
    if expected is None:
        assert verdicts == []
    else:
        (verdict,) = verdicts
        assert verdict.rollout_id is None and verdict.group_id == "g" and not verdict.ok
        (problem,) = verdict.problems
        assert problem.kind == "group_prefill" and problem.cause == expected
        assert f"{sum(c < 32 for c in first_cached)} of 4 rollouts" in problem.detail


def test_group_without_a_shared_prompt_is_not_flagged():
    from verbatim.lint.group import check_groups

    assert check_groups(group_of([0, 0, 0], same_prompt=False), KEEP) == []


def test_group_check_is_opt_in(tmp_path: Path):
    run = write_run(tmp_path / "run", [group_of([0, 0, 32])])
    plain = runner.invoke(app, ["lint", "trace", str(run), "--json"])
    assert plain.exit_code == 0, plain.output
    strict = runner.invoke(app, ["lint", "trace", str(run), "--json", "--groups"])
    assert strict.exit_code == 1
    last = json_lines(strict.stdout)[0][-1]
    assert last["rollout_id"] is None and last["group_id"] == "g" and last["problems"][0]["kind"] == "group_prefill"


def test_a_run_called_completed_that_holds_interrupted_rollouts_is_incomplete(tmp_path: Path):
    """A run folder written before a resume played interrupted rollouts again: its manifest's word is not taken."""
    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", seed=i) for i in range(4)]
    rollouts[1] = rollouts[1].model_copy(update={"status": "interrupted", "error": "interrupted by SIGINT",
                                                 "reward": None})
    run = write_run(tmp_path / "run", [rollouts], status="completed", config=PLAN)
    table = runner.invoke(app, ["lint", "trace", str(run)])
    text = " ".join(table.stdout.split())
    assert table.exit_code == 1, text
    assert "1 interrupted" in text and "1 rollouts were interrupted (a resume plays them again)" in text
    lines, whole = json_lines(runner.invoke(app, ["lint", "trace", str(run), "--json"]).stdout)
    assert lines[1]["findings"] == [{"kind": "failed", "turn": None, "detail": "interrupted: interrupted by SIGINT; "
                                                                               "no reward"}]
    assert whole["interrupted"] == 1 and whole["complete"] is False
