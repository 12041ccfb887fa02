"""The trainer's logprob files beside a run: the format, a training step writing one, ``mismatch --save``,
and ``verbatim view`` reading them (no engine)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import view_runs
from test_trainer_learner import segments, traced
from typer.testing import CliRunner

from verbatim.bench.prefixflow_exactness import VOCAB, tiny_llama
from verbatim.cli.app import app
from verbatim.datamodel import Rollout, Source, Turn
from verbatim.errors import TraceFormatError
from verbatim.renderers.registry import get_renderer
from verbatim.rl.train_step import step_input, step_logprobs
from verbatim.trainer.learner import Learner
from verbatim.trainer.learner_config import LearnerConfig
from verbatim.trainer.logprob_files import (
    RolloutLogprobs,
    logprob_files,
    mismatch_file,
    read_ids,
    read_logprobs,
    read_meta,
    step_file,
    write_logprobs,
)
from verbatim.view.run_data import RunData

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_file_round_trips_rows_and_metadata_and_leaves_no_temporary(tmp_path):
    rows = [RolloutLogprobs("a", np.array([np.nan, -0.5, -1.25], np.float32), np.array([False, True, False])),
            RolloutLogprobs("b", np.array([np.nan, np.nan], np.float32), np.zeros(2, bool))]
    path = write_logprobs(step_file(tmp_path, 7), rows, {"writer": "train", "step": 7, "trainer_version": 7})
    assert path == tmp_path / "trainer_logprobs" / "step-000007.parquet"
    assert [p.name for p in path.parent.iterdir()] == ["step-000007.parquet"]
    assert read_meta(path) == {"writer": "train", "step": 7, "trainer_version": 7}
    assert read_ids(path) == ["a", "b"]
    (only,) = read_logprobs(path, ["a"]).values()
    assert only.logprob.dtype == np.float32 and np.isnan(only.logprob[0])
    np.testing.assert_array_equal(only.logprob[1:], [-0.5, -1.25])
    assert only.keep.tolist() == [False, True, False]
    write_logprobs(mismatch_file(tmp_path), rows[:1], {"writer": "mismatch"})
    assert logprob_files(tmp_path) == [path, tmp_path / "trainer_logprobs.parquet"]  # steps first
    (tmp_path / "trainer_logprobs.parquet").write_bytes(b"PAR1 torn")
    with pytest.raises(TraceFormatError, match="not a trainer logprob file"):
        read_logprobs(tmp_path / "trainer_logprobs.parquet")
    with pytest.raises(ValueError, match="3 logprobs but 2 keep flags"):
        RolloutLogprobs("c", np.zeros(3, np.float32), np.zeros(2, bool))


def test_routing_flips_round_trip_where_counted_and_older_files_have_none(tmp_path):
    import pyarrow.parquet as pq

    rows = [RolloutLogprobs("a", np.zeros(3, np.float32), np.ones(3, bool), np.array([0, 2, 1])),
            RolloutLogprobs("b", np.zeros(2, np.float32), np.ones(2, bool))]
    path = write_logprobs(mismatch_file(tmp_path), rows, {"writer": "mismatch"})
    read = read_logprobs(path)
    assert read["a"].flips.tolist() == [0, 2, 1] and read["b"].flips is None
    older = pq.read_table(path).drop_columns(["routing_flips"])  # a file written before the column
    pq.write_table(older, path)
    assert all(row.flips is None for row in read_logprobs(path).values())
    with pytest.raises(ValueError, match="2 routing flips for 3 tokens"):
        RolloutLogprobs("c", np.zeros(3, np.float32), np.zeros(3, bool), np.zeros(2))


def _rollout(model: torch.nn.Module, rid: str, group: str, seed: int, reward: float, shift: float = 0.0) -> Rollout:
    rng = np.random.default_rng(seed)
    tokens = traced(model, segments(rng, np.arange(7) % VOCAB, turns=2), version=0)
    if shift:  # a sampler that disagreed with the trainer by e^shift on every model token
        tokens = type(tokens)(**{**tokens.as_dict(), "logprob": tokens.logprob - shift})
    model_at = np.flatnonzero(tokens.source == Source.MODEL)
    turns = (Turn(index=0, prompt_end=int(model_at[0]), completion_end=len(tokens)),)
    return Rollout(run_id="r", group_id=group, rollout_id=rid, tokens=tokens, turns=turns, reward=reward)


def test_a_training_step_writes_each_trained_rollouts_pi_old_and_keep_mask(tmp_path):
    model = tiny_llama(tied=False, seed=0)
    rollouts = [_rollout(model, "s0-b", "g", 1, 0.0, shift=3.0), _rollout(model, "s0-a", "g", 2, 1.0),
                _rollout(model, "s0-c", "g", 3, 0.5)]
    rows, _ = step_input(rollouts, "grpo")
    assert list(rows.rollout_ids) == ["s0-a", "s0-b", "s0-c"]  # aligned with the rows (sorted by id)
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3))
    learned = learner.train_step(rows)
    found, meta = step_logprobs(0, 0, rows, learned, "tiny", {"token_mask_band": [0.5, 5.0]})
    path = write_logprobs(step_file(tmp_path, 0), found, meta)
    saved = read_logprobs(path)
    assert read_meta(path)["writer"] == "train" and read_meta(path)["trainer_version"] == 0
    for rollout in rollouts:
        row = saved[rollout.rollout_id]
        model_tokens = rollout.tokens.source == Source.MODEL
        assert len(row.logprob) == len(rollout.tokens)
        assert np.isnan(row.logprob[~model_tokens]).all() and not row.keep[~model_tokens].any()
        shift = 3.0 if rollout.rollout_id == "s0-b" else 0.0  # π_old is the model before the update: μ + shift
        np.testing.assert_allclose(row.logprob[model_tokens], rollout.tokens.logprob[model_tokens] + shift, atol=1e-4)
        assert row.keep[model_tokens].all() == (shift == 0.0)  # e³ is outside the (0.5, 5) band: masked


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    return get_renderer("smollm2", model_dir=default_model_dir)


def test_the_view_takes_a_training_steps_logprobs_before_mismatch_saves(tmp_path, renderer, default_model_dir):
    r0, r1, _ = view_runs.rollouts(renderer)
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir), [[r0, r1]], trainer=[r0])
    data = RunData(run)
    assert data.rollout("g0-r1")["trainer"] is None
    other = view_runs.trainer_logprobs(r0)
    write_logprobs(mismatch_file(run), [RolloutLogprobs("g0-r0", other.logprob - 1, ~other.keep),
                                        view_runs.trainer_logprobs(r1)], {"writer": "mismatch", "model": "m"})
    first, second = data.rollout("g0-r0")["trainer"], data.rollout("g0-r1")["trainer"]
    assert first["source"] == "trainer_logprobs/step-000000.parquet" and first["writer"] == "train"
    kept = [k for k in first["keep"] if k is not None]
    assert kept == [bool(k) for k, s in zip(other.keep, r0.tokens.source) if s == Source.MODEL]
    assert second["source"] == "trainer_logprobs.parquet" and second["writer"] == "mismatch"
    assert data.summary()["trainer_logprobs"] == ["trainer_logprobs/step-000000.parquet", "trainer_logprobs.parquet"]


@pytest.mark.slow
def test_mismatch_save_writes_pi_beside_the_trace_and_the_view_shows_it(tmp_path, renderer, default_model_dir):
    r0, r1, _ = view_runs.rollouts(renderer)
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir), [[r0, r1]])
    trace = {p.name: p.read_bytes() for p in run.iterdir()}
    result = CliRunner().invoke(app, ["mismatch", str(run), "--model", str(default_model_dir), "--save", "--json"])
    assert result.exit_code == 0, result.stderr
    assert "trainer_logprobs.parquet" in result.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name in trace} == trace  # the trace is untouched
    saved = read_logprobs(mismatch_file(run))
    assert set(saved) == {"g0-r0", "g0-r1"} and read_meta(mismatch_file(run))["writer"] == "mismatch"
    for rollout in (r0, r1):
        row, model_tokens = saved[rollout.rollout_id], rollout.tokens.source == Source.MODEL
        assert np.isfinite(row.logprob[model_tokens]).all() and np.isnan(row.logprob[~model_tokens]).all()
    detail = RunData(run).rollout("g0-r0")
    assert detail["trainer"]["writer"] == "mismatch"
    assert sum(v is not None for v in detail["trainer"]["log_ratio"]) == int((r0.tokens.source == Source.MODEL).sum())
