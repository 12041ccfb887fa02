"""verbatim export: every format reads back with exact tokens, logprobs, masks, rewards and groups."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Completion, Rollout, Source
from verbatim.errors import InputError
from verbatim.harness.export import FORMATS, export_rollouts, export_run
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter, read_run
from verbatim.harness.tracefile import from_json_line, from_table

runner = CliRunner()

# Column names of the split formats: (prompt, response, mask, logprobs, versions, group)
SPLIT_COLUMNS = {
    "verl": ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "rollout_policy_versions", "uid"),
    "trl": ("prompt_ids", "completion_ids", "completion_mask", "logprobs", "policy_versions", "group_id"),
    "prime": ("prompt_ids", "completion_ids", "completion_mask", "completion_logprobs",
              "completion_policy_versions", "group_id"),
}


def build_rollout(rng: np.random.Generator, group: str, rid: str, turns: list[tuple[int, int, int]], *,
                  prompt_len: int = 20, reward: float | None = 1.0, status: str = "ok",
                  error: str | None = None, trailing_obs: int = 0, version: int = 0) -> Rollout:
    """A rollout built the way the harness builds one: (completion len, observation len, version bump) per turn."""
    ledger = Ledger()
    ledger.append_prompt(rng.integers(0, 50_000, prompt_len))
    for k, (n_sampled, n_obs, bump) in enumerate(turns):
        version += bump
        ledger.append_completion(Completion(
            token_ids=rng.integers(0, 50_000, n_sampled), logprobs=-rng.exponential(2.0, n_sampled),
            versions=np.full(n_sampled, version), finish_reason="stop", prompt_tokens=len(ledger),
            cached_tokens=(len(ledger) - 1) // 16 * 16), reward=float(k))
        if k < len(turns) - 1:
            ledger.append_observation(rng.integers(0, 50_000, n_obs))
    if trailing_obs:
        ledger.append_observation(rng.integers(0, 50_000, trailing_obs))
    return ledger.to_rollout(run_id="run-x", group_id=group, rollout_id=rid, task={"id": f"task-{group}"},
                             reward=reward, status=status, error=error)


def sample_rollouts() -> list[Rollout]:
    rng = np.random.default_rng(7)
    out = []
    for g in range(3):
        for i in range(3):
            turns = [(5 + i, 4, 0), (3, 6, 1 if g == 2 else 0), (7, 2, 0)][: 1 + (g + i) % 3]
            out.append(build_rollout(rng, f"g{g}", f"g{g}-r{i}", turns, prompt_len=10 + g, reward=float(i) - 0.5))
    out.append(build_rollout(rng, "g1", "g1-err", [(4, 3, 0)], status="error", error="env raised", trailing_obs=3))
    out.append(build_rollout(rng, "g2", "g2-trunc", [(4, 3, 0), (6, 0, 0)], reward=None, status="truncated",
                             error="context budget", trailing_obs=9))
    empty = Ledger()
    empty.append_prompt(rng.integers(0, 50_000, 30))
    out.append(empty.to_rollout(run_id="run-x", group_id="g0", rollout_id="g0-noturn", status="truncated",
                                error="prompt does not fit"))
    return out


@pytest.fixture(params=["parquet", "jsonl"])
def run_dir(tmp_path: Path, request) -> Path:
    """A run directory in either native batch format, interleaving groups across two batches."""
    rollouts = sample_rollouts()
    writer = TraceWriter(tmp_path / "run", RunManifest(run_id="run-x", format=request.param))
    writer.write_batch(rollouts[::2])
    writer.write_batch(rollouts[1::2])
    return tmp_path / "run"


def by_id(rollouts: list[Rollout]) -> dict[str, Rollout]:
    return {r.rollout_id: r for r in rollouts}


def check_split_rows(table, originals: dict[str, Rollout], fmt: str) -> None:
    """Every row rebuilds its rollout's tokens exactly; masks, logprobs, versions, rewards, groups agree."""
    prompt_col, resp_col, mask_col, lp_col, ver_col, group_col = SPLIT_COLUMNS[fmt]
    rows = table.to_pydict()
    for i, rid in enumerate(rows["rollout_id"]):
        r = originals[rid]
        start, end = r.turns[0].prompt_end, r.turns[-1].completion_end
        prompt = np.asarray(rows[prompt_col][i], np.int32)
        response = np.asarray(rows[resp_col][i], np.int32)
        assert np.array_equal(prompt, r.tokens.token_id[:start])
        assert np.array_equal(np.concatenate([prompt, response]), r.tokens.token_id[:end])
        mask = np.asarray(rows[mask_col][i]).astype(bool)
        assert np.array_equal(mask, r.tokens.source[start:end] == Source.MODEL)
        logprobs = np.asarray(rows[lp_col][i], np.float32)
        assert np.array_equal(logprobs[mask], r.tokens.logprob[start:end][mask])  # bit-exact float32
        assert np.all(logprobs[~mask] == 0.0)
        versions = np.asarray(rows[ver_col][i], np.int32)
        assert np.array_equal(versions[mask], r.tokens.policy_version[start:end][mask])
        assert np.all(versions[~mask] == -1)
        assert rows[group_col][i] == r.group_id
        assert rows["group_size"][i] == rows["group_id"].count(r.group_id)
        assert rows["reward"][i] == r.reward and rows["status"][i] == r.status
        assert json.loads(rows["task"][i]) == r.task
    groups = rows["group_id"]
    for g in set(groups):
        at = [i for i, x in enumerate(groups) if x == g]
        assert at == list(range(at[0], at[0] + len(at))), f"group {g}'s rows are not contiguous"


def test_native_formats_are_lossless(run_dir: Path, tmp_path: Path):
    originals = by_id(read_run(run_dir).rollouts)
    parquet = export_run(run_dir, "parquet", tmp_path / "all.parquet")
    jsonl = export_run(run_dir, "jsonl", tmp_path / "all.jsonl")
    from_parquet = from_table(pq.read_table(parquet))
    from_jsonl = [from_json_line(line) for line in jsonl.read_text().splitlines()]
    for exported in (from_parquet, from_jsonl):
        assert sorted(r.rollout_id for r in exported) == sorted(originals)  # errored ones too
        assert all(r.same_as(originals[r.rollout_id]) for r in exported)
    assert any(math.isnan(x) for x in from_parquet[0].tokens.logprob)  # prompt NaNs survive


@pytest.mark.parametrize("fmt", ["verl", "trl", "prime"])
def test_split_formats_read_back_exactly(run_dir: Path, tmp_path: Path, fmt: str):
    originals = by_id(read_run(run_dir).rollouts)
    table = pq.read_table(export_run(run_dir, fmt, tmp_path / f"{fmt}.parquet"))
    ids = table.column("rollout_id").to_pylist()
    assert "g1-err" not in ids and "g0-noturn" not in ids  # error / nothing sampled: left out
    assert "g2-trunc" in ids and len(ids) == 10  # truncated rollouts stay
    check_split_rows(table, originals, fmt)


def test_verl_rewards_sit_on_the_last_model_token(run_dir: Path, tmp_path: Path):
    originals = by_id(read_run(run_dir).rollouts)
    rows = pq.read_table(export_run(run_dir, "verl", tmp_path / "v.parquet")).to_pylist()
    for row in rows:
        rewards = np.asarray(row["token_level_rewards"])
        mask = np.asarray(row["response_mask"])
        last = np.flatnonzero(mask)[-1]
        expected = originals[row["rollout_id"]].reward or 0.0
        assert rewards[last] == pytest.approx(expected) and np.count_nonzero(np.delete(rewards, last)) == 0
        assert row["uid"] == row["group_id"]
        assert row["response_turns"][-1] == len(originals[row["rollout_id"]].turns) - 1


def test_trailing_env_tokens_and_env_mask(tmp_path: Path):
    rng = np.random.default_rng(1)
    r = build_rollout(rng, "g", "r", [(3, 4, 0), (2, 0, 1)], prompt_len=5, trailing_obs=6)
    row = pq.read_table(export_rollouts([r], "trl", tmp_path / "t.parquet").path).to_pylist()[0]
    assert len(row["prompt_ids"]) == 5 and len(row["completion_ids"]) == 3 + 4 + 2  # trailing 6 dropped
    assert row["completion_mask"] == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert row["policy_versions"] == [0, 0, 0, -1, -1, -1, -1, 1, 1]


def test_prime_example_id_and_prompt_mask(run_dir: Path, tmp_path: Path):
    rows = pq.read_table(export_run(run_dir, "prime", tmp_path / "p.parquet")).to_pylist()
    for row in rows:
        assert row["example_id"] == f"task-{row['group_id']}"
        assert row["prompt_mask"] == [0] * len(row["prompt_ids"])
        assert "advantage" not in row


def test_unknown_format_is_input_error(run_dir: Path):
    with pytest.raises(InputError, match="unknown export format 'csv'"):
        export_run(run_dir, "csv")


def test_default_out_and_folder_out(run_dir: Path, tmp_path: Path):
    assert export_run(run_dir, "trl") == run_dir / "exports" / "trl.parquet"
    assert export_run(run_dir, "jsonl", tmp_path) == tmp_path / "jsonl.jsonl"
    assert len(read_run(run_dir).rollouts) == 12  # the exports folder does not disturb the run


# ---------------------------------------------------------------------------
# Round trip for any harness-built rollout
# ---------------------------------------------------------------------------

turn_specs = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9), st.integers(0, 2)), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(turn_specs, min_size=1, max_size=5), seed=st.integers(0, 2**16),
       trailing=st.integers(0, 5), fmt=st.sampled_from(["verl", "trl", "prime"]))
def test_any_trace_round_trips(specs, seed, trailing, fmt):
    rng = np.random.default_rng(seed)
    rollouts = [build_rollout(rng, f"g{i % 2}", f"r{i}", spec, prompt_len=int(rng.integers(1, 12)),
                              trailing_obs=trailing, reward=float(rng.normal())) for i, spec in enumerate(specs)]
    with tempfile.TemporaryDirectory() as tmp:
        result = export_rollouts(rollouts, fmt, Path(tmp) / "out.parquet")
        assert result.rows == len(rollouts) and result.left_out == {}
        check_split_rows(pq.read_table(result.path), by_id(rollouts), fmt)
        native = export_rollouts(rollouts, "parquet", Path(tmp) / "native.parquet")
        back = by_id(from_table(pq.read_table(native.path)))
        assert all(back[r.rollout_id].same_as(r) for r in rollouts)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_export_every_format(run_dir: Path, tmp_path: Path, fmt: str):
    out = tmp_path / f"out-{fmt}"
    result = runner.invoke(app, ["export", str(run_dir), "--format", fmt, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and str(out) in result.stdout.replace("\n", "")
    if fmt in SPLIT_COLUMNS:
        assert "left out 1 with no sampled token, 1 with status error" in result.stdout.replace("\n", " ")


def test_cli_export_bad_input_exit_2(run_dir: Path, tmp_path: Path):
    bad_format = runner.invoke(app, ["export", str(run_dir), "--format", "csv"])
    not_a_run = runner.invoke(app, ["export", str(tmp_path), "--format", "verl"])
    for result, needle in ((bad_format, "unknown export format 'csv'"), (not_a_run, "is not a verbatim run")):
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]


def test_cli_export_warns_about_damaged_files(run_dir: Path, tmp_path: Path):
    damaged = sorted(run_dir.glob("rollouts-*"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:40])
    result = runner.invoke(app, ["export", str(run_dir), "--format", "parquet", "--out", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert "warning: " + damaged.name in result.stderr
    assert pq.read_table(tmp_path / "x").num_rows == len(read_run(run_dir).rollouts) > 0


# ---------------------------------------------------------------------------
# An export never damages data
# ---------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["manifest.json", "rollouts-000001.parquet", "new.parquet", "."])
def test_cli_export_never_writes_among_a_runs_files(run_dir: Path, target: str):
    before = snapshot(run_dir)
    result = runner.invoke(app, ["export", str(run_dir), "--format", "verl", "--out", str(run_dir / target)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is inside the run directory" in lines[0], result.stderr
    assert snapshot(run_dir) == before  # nothing written, nothing lost
    assert len(read_run(run_dir).rollouts) == 12


def test_cli_export_replaces_an_existing_file_only_with_force(run_dir: Path, tmp_path: Path):
    out = tmp_path / "mine.parquet"
    out.write_bytes(b"someone's data")
    refused = runner.invoke(app, ["export", str(run_dir), "--format", "trl", "--out", str(out)])
    assert refused.exit_code == 2 and "already exists" in refused.stderr and "--force" in refused.stderr
    assert out.read_bytes() == b"someone's data"
    forced = runner.invoke(app, ["export", str(run_dir), "--format", "trl", "--out", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert pq.read_table(out).num_rows > 0
    again = runner.invoke(app, ["export", str(run_dir), "--format", "trl"])  # the default place, twice
    assert again.exit_code == 0, again.output
    assert runner.invoke(app, ["export", str(run_dir), "--format", "trl"]).exit_code == 2
