"""verbatim export: every format reads back with exact tokens, logprobs, masks, rewards and groups."""

from __future__ import annotations

import json
import math
import re
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
from verbatim.harness.export import EXPORT_VERSION, FORMATS, TRAINERS, export_rollouts, export_run
from verbatim.harness.ledger import Ledger
from verbatim.harness.store import RunManifest, TraceWriter, read_run
from verbatim.harness.tracefile import from_json_line, from_table

runner = CliRunner()

DOCS = Path(__file__).resolve().parents[1] / "docs" / "traces.md"


def whole_sequence(row: dict, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(token ids, model-token mask, logprobs, versions, prompt length) of one exported row, over the
    whole sequence: the prompt (mask 0, logprob 0.0, version -1) followed by the response."""
    if fmt == "prime":
        ids = np.asarray(row["token_ids"], np.int32)
        mask = np.asarray(row["mask"], bool)
        return ids, mask, np.asarray(row["logprobs"], np.float32), np.asarray(row["policy_versions"]), -1
    names = {"verl": ("response_ids", "response_mask", "response_logprobs", "response_policy_versions"),
             "trl": ("completion_ids", "env_mask", "logprobs", "policy_versions")}[fmt]
    prompt = np.asarray(row["prompt_ids"], np.int32)
    response, mask, logprobs, versions = (row[name] for name in names)
    n = len(prompt)
    return (np.concatenate([prompt, np.asarray(response, np.int32)]),
            np.concatenate([np.zeros(n, bool), np.asarray(mask).astype(bool)]),
            np.concatenate([np.zeros(n, np.float32), np.asarray(logprobs, np.float32)]),
            np.concatenate([np.full(n, -1), np.asarray(versions)]), n)


def last_sampled(r: Rollout) -> int:
    """One past the rollout's last model token: where every split format's sequence ends."""
    return int(np.flatnonzero(r.tokens.source == Source.MODEL)[-1]) + 1


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
    rows = table.to_pylist()
    for row in rows:
        r = originals[row["rollout_id"]]
        end = last_sampled(r)
        ids, mask, logprobs, versions, prompt_len = whole_sequence(row, fmt)
        assert np.array_equal(ids, r.tokens.token_id[:end])
        if prompt_len >= 0:
            assert prompt_len == r.turns[0].prompt_end
        assert np.array_equal(mask, r.tokens.source[:end] == Source.MODEL)
        assert np.array_equal(logprobs[mask], r.tokens.logprob[:end][mask])  # bit-exact float32
        assert np.all(logprobs[~mask] == 0.0)
        assert np.array_equal(versions[mask], r.tokens.policy_version[:end][mask])
        assert np.all(versions[~mask] == -1)
        assert row["reward_score" if fmt == "verl" else "reward"] == r.reward
        assert row["group_size"] == sum(x["group_id"] == r.group_id for x in rows)
        assert row["status"] == r.status and row["model_turns"] == len(r.turns)
        assert json.loads(row["task"]) == r.task
    groups = [row["group_id"] for row in rows]
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


def test_split_formats_name_their_version_and_trainer(run_dir: Path, tmp_path: Path):
    for fmt in ("verl", "trl", "prime"):
        metadata = pq.read_schema(export_run(run_dir, fmt, tmp_path / f"{fmt}.parquet")).metadata
        note = json.loads(metadata[b"verbatim.export"])
        assert note == {"format": fmt, "version": EXPORT_VERSION, "follows": TRAINERS[fmt]} and EXPORT_VERSION == 2


def test_no_column_means_padding_or_mixes_verl_batch_keys(run_dir: Path, tmp_path: Path):
    """TRL builds ``completion_mask`` (padding) itself; verl builds its batch keys from the agent-loop fields."""
    columns = {fmt: set(pq.read_schema(export_run(run_dir, fmt, tmp_path / f"{fmt}.parquet")).names)
               for fmt in ("verl", "trl", "prime")}
    assert "completion_mask" not in columns["trl"] and "env_mask" in columns["trl"]
    batch_keys = {"prompts", "responses", "input_ids", "attention_mask", "rollout_log_probs", "rm_scores",
                  "token_level_rewards", "token_level_scores", "uid"}
    assert not columns["verl"] & batch_keys
    assert {"prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score",
            "num_turns"} <= columns["verl"]
    assert {"token_ids", "mask", "logprobs", "reward"} <= columns["prime"]
    assert not columns["prime"] & {"completion_mask", "prompt_mask", "advantage", "advantages"}


def test_response_ends_on_the_last_sampled_token(tmp_path: Path):
    rng = np.random.default_rng(1)
    r = build_rollout(rng, "g", "r", [(3, 4, 0), (2, 0, 1)], prompt_len=5, trailing_obs=6)
    row = pq.read_table(export_rollouts([r], "trl", tmp_path / "t.parquet").path).to_pylist()[0]
    assert len(row["prompt_ids"]) == 5 and len(row["completion_ids"]) == 3 + 4 + 2  # trailing 6 dropped
    assert row["env_mask"] == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert row["policy_versions"] == [0, 0, 0, -1, -1, -1, -1, 1, 1]
    # an empty last completion: its context is not part of the response either
    ledger = Ledger()
    ledger.append_prompt(rng.integers(0, 50_000, 4))
    for n in (3, 0):
        ledger.append_completion(Completion(
            token_ids=rng.integers(0, 50_000, n), logprobs=-rng.exponential(2.0, n), versions=np.zeros(n, int),
            finish_reason="length", prompt_tokens=len(ledger), cached_tokens=0))
        if n:
            ledger.append_observation(rng.integers(0, 50_000, 5))
    empty_last = ledger.to_rollout(run_id="run-x", group_id="g", rollout_id="e", reward=1.0)
    row = pq.read_table(export_rollouts([empty_last], "verl", tmp_path / "v.parquet").path).to_pylist()[0]
    assert row["response_mask"] == [1, 1, 1] and row["num_turns"] == 4 and row["model_turns"] == 2


def test_prime_example_id_and_flat_sequence(run_dir: Path, tmp_path: Path):
    rows = pq.read_table(export_run(run_dir, "prime", tmp_path / "p.parquet")).to_pylist()
    originals = by_id(read_run(run_dir).rollouts)
    for row in rows:
        assert row["example_id"] == f"task-{row['group_id']}"
        prompt_end = originals[row["rollout_id"]].turns[0].prompt_end
        assert not any(row["mask"][:prompt_end]) and row["mask"][prompt_end] is True
        assert row["token_turns"] == originals[row["rollout_id"]].tokens.turn[:len(row["token_ids"])].tolist()


# ---------------------------------------------------------------------------
# Each trainer's data path, as docs/traces.md shows it
# ---------------------------------------------------------------------------


def doc_loader(fmt: str, name: str):
    """Run the first Python block of the docs' ``### `fmt``` section and return the function it defines."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split(f"### `{fmt}`\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, f"docs/traces.md shows no loader for {fmt}"
    namespace: dict = {}
    exec(compile(block.group(1), f"docs/traces.md ({fmt})", "exec"), namespace)  # noqa: S102
    return namespace[name]


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch):
    """``datasets`` caches what it loads: under the test's folder, never the home directory."""
    import datasets  # the dev extra installs it: TRL and verl read Parquet through it

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def right_padded(rows: list[list], value) -> np.ndarray:
    width = max(len(x) for x in rows)
    return np.array([list(x) + [value] * (width - len(x)) for x in rows])


def test_trl_rollout_func_feeds_grpo(run_dir: Path, tmp_path: Path, datasets_cache):
    originals = by_id(read_run(run_dir).rollouts)
    path = export_run(run_dir, "trl", tmp_path / "trl.parquet")
    group_ids, rollout_func = doc_loader("trl", "trl_replay")(path)
    assert group_ids == ["g0", "g1", "g2"]
    exported = pq.read_table(path).column("rollout_id").to_pylist()
    served = [originals[rid] for rid in exported]  # group by group, members in trace order
    prompts = [r.group_id for r in served]  # GRPO hands rollout_func each prompt num_generations times
    out = rollout_func(prompts, None)
    assert {"prompt_ids", "completion_ids", "logprobs"} <= out.keys()  # the keys GRPOTrainer requires
    assert len(out["completion_ids"]) == len(served)
    # as GRPOTrainer pads: completion_mask 1 on tokens, 0 on right padding; env_mask padded with 1
    completion_mask = right_padded([[1] * len(c) for c in out["completion_ids"]], 0)
    env_mask = right_padded(out["env_mask"], 1)
    logprobs = right_padded(out["logprobs"], 0.0).astype(np.float32)
    loss_mask = completion_mask * env_mask
    for i, r in enumerate(served):
        start, end = r.turns[0].prompt_end, last_sampled(r)
        assert out["prompt_ids"][i] + out["completion_ids"][i] == r.tokens.token_id[:end].tolist()
        model = r.tokens.source[start:end] == Source.MODEL
        assert np.array_equal(loss_mask[i].astype(bool), np.pad(model, (0, loss_mask.shape[1] - len(model))))
        assert np.array_equal(logprobs[i][loss_mask[i] == 1], r.tokens.logprob[start:end][model])
        assert np.all(logprobs[i][loss_mask[i] == 0] == 0.0) and out["env_mask"][i][-1] == 1
        assert out["reward"][i] == r.reward


def test_verl_agent_loop_outputs_make_its_batch(run_dir: Path, tmp_path: Path, datasets_cache):
    originals = by_id(read_run(run_dir).rollouts)
    path = export_run(run_dir, "verl", tmp_path / "verl.parquet")
    groups = doc_loader("verl", "verl_outputs")(path)
    rows = pq.read_table(path).to_pylist()
    assert {g: len(v) for g, v in groups.items()} == {g: rows[[x["group_id"] for x in rows].index(g)]["group_size"]
                                                      for g in groups}
    outputs = [fields for g in groups for fields in groups[g]]
    ids = [row["rollout_id"] for row in rows]
    # as verl's agent loop pads: prompts left with 0, responses right with 0, response_mask * attention
    width = max(len(o["prompt_ids"]) for o in outputs)
    prompts = np.array([[0] * (width - len(o["prompt_ids"])) + o["prompt_ids"] for o in outputs])
    responses = right_padded([o["response_ids"] for o in outputs], 0)
    attention = np.concatenate([np.array([[0] * (width - len(o["prompt_ids"])) + [1] * len(o["prompt_ids"])
                                          for o in outputs]),
                                right_padded([[1] * len(o["response_ids"]) for o in outputs], 0)], 1)
    response_mask = right_padded([o["response_mask"] for o in outputs], 0) * attention[:, width:]
    log_probs = right_padded([o["response_logprobs"] for o in outputs], 0.0).astype(np.float32)
    last = attention[:, width:].sum(1) - 1  # where verl puts reward_score (rm_scores)
    for i, fields in enumerate(outputs):
        r = originals[ids[i]]
        start, end = r.turns[0].prompt_end, last_sampled(r)
        assert np.array_equal(np.concatenate([prompts[i][width - start:], responses[i][:end - start]]),
                              r.tokens.token_id[:end])
        model = r.tokens.source[start:end] == Source.MODEL
        assert np.array_equal(np.flatnonzero(response_mask[i]), np.flatnonzero(model))
        assert np.array_equal(log_probs[i][response_mask[i] == 1], r.tokens.logprob[start:end][model])
        assert last[i] == np.flatnonzero(model)[-1]  # the reward lands on the last model token
        assert fields["reward_score"] == r.reward and fields["num_turns"] == 2 * len(r.turns)


def test_prime_training_samples(run_dir: Path, tmp_path: Path):
    originals = by_id(read_run(run_dir).rollouts)
    path = export_run(run_dir, "prime", tmp_path / "prime.parquet")
    samples = doc_loader("prime", "prime_samples")(path, 0.7, "env-x")
    ids = pq.read_table(path).column("rollout_id").to_pylist()
    assert len(samples) == len(ids) == 10
    for rid, sample in zip(ids, samples, strict=True):
        r = originals[rid]
        end = last_sampled(r)
        n = len(sample["token_ids"])
        assert n == end and len(sample["mask"]) == len(sample["logprobs"]) == len(sample["temperatures"]) == n
        assert sample["token_ids"] == r.tokens.token_id[:end].tolist()
        mask = np.asarray(sample["mask"])
        assert mask.dtype == bool and np.array_equal(mask, r.tokens.source[:end] == Source.MODEL)
        logprobs = np.asarray(sample["logprobs"], np.float32)
        assert np.array_equal(logprobs[mask], r.tokens.logprob[:end][mask]) and np.all(logprobs[~mask] == 0.0)
        assert sample["temperatures"] == [0.7] * n and sample["env_name"] == "env-x"
        assert sample["advantages"] == [] and sample["reward"] == r.reward


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
    if fmt in TRAINERS:
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


def test_cli_export_never_creates_a_missing_out_folder(run_dir: Path, tmp_path: Path):
    out = tmp_path / "missing" / "deeper" / "x.parquet"
    result = runner.invoke(app, ["export", str(run_dir), "--format", "verl", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--out {out}: the folder {out.parent} does not exist" in lines[0], result.stderr
    assert not (tmp_path / "missing").exists()
    assert not (run_dir / "exports").exists()
    nested = runner.invoke(app, ["export", str(run_dir), "--format", "verl", "--out", str(run_dir / "exports/a/x")])
    assert nested.exit_code == 2 and not (run_dir / "exports").exists(), nested.output  # only exports/ itself


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
