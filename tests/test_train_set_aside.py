"""What a resume sets aside when the newest checkpoint is older than the last trained step.

Pure file logic over a run directory written by the real TraceWriter; the whole loop (a real engine,
killed and resumed with --checkpoint-every) is in tests/test_train_resume.py.
"""

from __future__ import annotations

import json

import numpy as np
from fakes import tiny_rollout

from verbatim.datamodel import TokenColumns
from verbatim.harness.store import RunManifest, TraceWriter, read_run
from verbatim.rl.train_resume import check_recorded, set_aside


def _rollout(index: int, step: int, version: int):
    r = tiny_rollout(index)
    versions = np.array([-1, -1, -1, version, version, version])
    t = r.tokens
    tokens = TokenColumns(token_id=t.token_id, source=t.source, logprob=t.logprob, policy_version=versions,
                          turn=t.turn)
    return r.model_copy(update={"rollout_id": f"s{step:04d}-r{index}", "tokens": tokens, "info": {"step": step}})


def _run(tmp_path, steps: dict[int, int]):
    """One batch per step: {step: the version that sampled it}; metrics lines and logprob files of steps 1–2."""
    out = tmp_path / "run"
    writer = TraceWriter(out, RunManifest(run_id="t", format="jsonl"))
    for i, (step, version) in enumerate(steps.items()):
        writer.write_batch([_rollout(2 * i, step, version), _rollout(2 * i + 1, step, version)])
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "version": n}) + "\n" for n in (1, 2)))
    (out / "trainer_logprobs").mkdir()
    for n in (1, 2):
        (out / "trainer_logprobs" / f"step-{n:06d}.parquet").write_bytes(b"x")
    return out


def test_steps_past_the_checkpoint_are_moved_aside_and_what_its_weights_played_stays(tmp_path):
    out = _run(tmp_path, {1: 0, 2: 1, 3: 2})  # killed in step 3, no checkpoint yet (every 3 steps)
    folder = set_aside(out, trained=0, max_lag=0)
    assert folder == out / "discarded" / "after-step-000000"
    kept = read_run(out).rollouts
    assert {r.info["step"] for r in kept} == {1}  # sampled by version 0: the resumed run's own first play
    assert len(list(folder.glob("rollouts-*"))) == 2
    assert [json.loads(x)["step"] for x in (folder / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (folder / "trainer_logprobs").iterdir()) == ["step-000001.parquet",
                                                                              "step-000002.parquet"]
    assert list((out / "trainer_logprobs").iterdir()) == []
    assert [r.rollout_id for r in read_run(out).rollouts] == [r.rollout_id for r in kept]
    assert not (out / "metrics.jsonl").read_text()
    assert set_aside(out, trained=0, max_lag=0) is None  # nothing left to set aside


def test_a_second_resume_after_the_same_checkpoint_sets_aside_beside_the_first(tmp_path):
    out = _run(tmp_path, {1: 0, 2: 1})
    first = set_aside(out, trained=0, max_lag=0)
    TraceWriter(out, RunManifest(run_id="t", format="jsonl")).write_batch([_rollout(9, 2, 1)])
    second = set_aside(out, trained=0, max_lag=0)
    assert second == first.with_name("after-step-000000-2") and len(list(first.glob("rollouts-*"))) == 1
    assert len(list(second.glob("rollouts-*"))) == 1


def test_a_lagged_step_sampled_by_the_checkpoints_version_stays(tmp_path):
    out = _run(tmp_path, {1: 0, 2: 1, 3: 1, 4: 2})  # max lag 1: step 3 played with version 1
    set_aside(out, trained=1, max_lag=1)
    assert sorted({r.info["step"] for r in read_run(out).rollouts}) == [1, 2, 3]


def test_more_steps_past_the_checkpoint_than_the_interval_allows_is_refused_as_a_lost_checkpoint(tmp_path):
    import pytest

    from verbatim.errors import InputError

    out = _run(tmp_path, {1: 0, 2: 1, 3: 2})
    check_recorded(out, trained=0, max_lag=0, every=3)  # two trained steps past none: a kill between checkpoints
    with pytest.raises(InputError, match="records step 2"):
        check_recorded(out, trained=0, max_lag=0, every=1)


def test_a_run_recorded_before_the_learners_memory_options_resumes_as_it_trained():
    from verbatim.rl.train_resume import check_changes

    now = {"plan": {"steps": 4, "checkpoint_every": 10, "fixed_lag": False},
           "learner": {"lr": 1e-5, "dtype": "fp32", "checkpoint_layers": False, "logprob_chunk": 512,
                       "prefix_activations": "recompute"}}
    check_changes({"plan": {"steps": 4}, "learner": {"lr": 1e-5}}, now)  # recorded before those settings existed
    import pytest

    from verbatim.errors import InputError

    with pytest.raises(InputError, match="learner.dtype: 'fp32' -> 'bf16'"):
        check_changes({"plan": {"steps": 4}, "learner": {"lr": 1e-5}}, now | {"learner": now["learner"] | {
            "dtype": "bf16"}})
