"""A run given an engine its caller started (a script's, the suite's session engine): ``run_training`` and
``run_rollouts`` take it instead of starting their own, run on the event loop it lives on, leave it running,
and begin it with their own weights and an empty prefix cache, whatever an earlier run left in it.

The session's one in-process engine serves three runs here, one after the other: a training step at a high
learning rate (which leaves its trained weights in the engine as version 1), a ``run`` of rollouts, and a
second training run. The tokens of the last two must be sampled by the base model they record."""

from __future__ import annotations

import pytest
from trained_run import assert_sampled_with_base_not

from verbatim.engine.protocol import Sampling
from verbatim.jobs.config import RunOptions, TrainConfig
from verbatim.jobs.run import run_rollouts
from verbatim.jobs.train import run_training
from verbatim.rl.plan import TrainPlan
from verbatim.trainer.learner_config import LearnerConfig

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ENV = "graded_env:GradedFactory"


def training(out, lr: float) -> TrainConfig:
    return TrainConfig(play={"env": ENV}, sampling={"max_tokens": 8}, engine={"max_model_len": 1024},
                       output={"out": str(out)}, plan=TrainPlan(steps=1, groups=2, group_size=4),
                       learner=LearnerConfig(lr=lr))


def test_runs_on_a_given_engine_begin_it_with_their_own_weights_and_leave_it_running(engine_runner, tmp_path,
                                                                                       default_model_dir):
    engine = engine_runner.engine
    first, played, second = tmp_path / "first", tmp_path / "played", tmp_path / "second"
    assert len(run_training(training(first, 1e-3), engine=engine)) == 1
    assert engine.version == 1  # the first run's trained weights are what the engine now serves
    summary = run_rollouts(RunOptions(play={"env": ENV}, sampling={"max_tokens": 8}, output={"out": str(played)},
                                      groups=1, group_size=2), engine=engine)
    assert summary.rollouts == 2 and engine.version == 0
    assert len(run_training(training(second, 1e-5), engine=engine)) == 1
    assert (second / "config.toml").exists() and (played / "config.toml").exists()
    assert not (second / "engine.log").exists()  # not started here

    assert_sampled_with_base_not(first, [played, second], default_model_dir)

    reply = engine_runner.run(engine.generate([1, 2, 3], Sampling(max_tokens=2, temperature=0.0)))
    assert len(reply.token_ids) == 2  # the engine still runs for the suite's next test
