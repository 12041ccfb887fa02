"""One entry point for a training run: ``verbatim train`` and a script (or a torchrun worker) given the
same :class:`TrainConfig` compose the same run (jobs/train.py).

The engine is constructed, never started: ``execute`` is where training would begin, and the test stops
there with the loop each path built.
"""

from __future__ import annotations

import pytest
import torch
from command_config import with_flags
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.jobs.train import TrainConfig, run_training

runner = CliRunner()


@pytest.fixture
def built(monkeypatch):
    """The loops whose training would start, in order; training itself is not run."""
    loops = []

    async def stop_here(loop, config, console, learner_of, **given):
        loop.learner = learner_of()  # what execute makes once the engine has started
        loops.append((loop, config))
        loop.engine.close()
        return []

    monkeypatch.setattr("verbatim.jobs.train.execute", stop_here)
    return loops


def test_a_script_given_the_clis_config_builds_the_same_run(tmp_path, built):
    args = ["train", "--env", "guess", "--steps", "3", "--groups", "1", "--group-size", "2", "--lr", "2e-5",
            "--cache-policy", "flush", "--microbatch", "2", "--out", str(tmp_path / "cli")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (cli_loop, cli_config), = built
    # what a torchrun worker receives: the config as JSON, the run directory its own
    sent = with_flags(cli_config, out=str(tmp_path / "script")).model_dump_json()
    config = TrainConfig.model_validate_json(sent)
    assert run_training(config) == []
    script_loop, _ = built[1]
    assert config.model_dump(exclude={"output": {"out"}}) == cli_config.model_dump(exclude={"output": {"out"}})
    assert script_loop.plan == cli_loop.plan and script_loop.plan.steps == 3
    assert script_loop.loop == cli_loop.loop
    assert script_loop.learner.config == cli_loop.learner.config and cli_loop.learner.config.lr == 2e-5
    assert script_loop.manifest.config == cli_loop.manifest.config
    assert script_loop.manifest.renderer == cli_loop.manifest.renderer == "smollm2"
    assert script_loop.manifest.run_id != cli_loop.manifest.run_id  # two runs, two ids
    ours = dict(script_loop.learner.model.named_parameters())
    for name, param in cli_loop.learner.model.named_parameters():
        assert torch.equal(param, ours[name]), name


def test_a_scripts_bad_config_is_refused_before_any_model_loads(tmp_path, built):
    from verbatim.errors import InputError
    from verbatim.rl.plan import TrainPlan
    from verbatim.trainer.learner_config import LearnerConfig

    config = TrainConfig(play={"env": "guess"}, plan=TrainPlan(steps=1, groups=1, group_size=2),
                         learner=LearnerConfig(updates_per_step=3), output={"out": str(tmp_path / "run")})
    with pytest.raises(InputError, match="--updates-per-step 3 is more than the 2 rollouts"):
        run_training(config)
    assert built == [] and not (tmp_path / "run").exists()


def test_a_scripts_max_lag_sets_the_version_lag_mask_it_is_held_once():
    """``plan.max_lag`` alone gives the correction its version-lag mask (the CLI no longer copies it); a script
    that sets the mask apart, to another number, is refused naming both."""
    from pydantic import ValidationError

    from verbatim.rl.plan import TrainPlan
    from verbatim.trainer.learner_config import CorrectionConfig, LearnerConfig

    config = TrainConfig(play={"env": "guess"}, plan=TrainPlan(steps=1, max_lag=2), learner=LearnerConfig())
    assert config.learner.correction.max_version_lag == 2
    assert TrainConfig.model_validate_json(config.model_dump_json()) == config  # what a torchrun rank receives
    with pytest.raises(ValidationError, match=r"max_version_lag 1 differs from 2 \(plan.max_lag 2"):
        TrainConfig(play={"env": "guess"}, plan=TrainPlan(steps=1, max_lag=2),
                    learner=LearnerConfig(correction=CorrectionConfig(max_version_lag=1)))


def test_a_rank_above_0_under_torchrun_follows_without_touching_the_run_folder(tmp_path, monkeypatch):
    """torchrun starts `verbatim train` on every rank: rank 0 owns the folder and prints, the others follow."""
    import verbatim.jobs.trainer_team as trainer_team

    followed = []
    monkeypatch.setattr(trainer_team, "follow_run", lambda config: followed.append(config) or 0)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # rank 0 got there first: a follower must not refuse the folder
    result = CliRunner().invoke(app, ["train", "--env", "guess", "--steps", "1", "--out", str(out),
                                      "--summary-json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert len(followed) == 1 and followed[0].output.out == str(out) and followed[0].placement.trainer_procs == 1
    assert not (tmp_path / "s.json").exists() and result.output.strip() == ""


def test_trainer_procs_other_than_torchruns_count_is_refused(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["train", "--env", "guess", "--steps", "1", "--trainer-procs", "3",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "--trainer-procs 3 under torchrun, which launched 2 processes" in result.output


def test_trackers_are_closed_when_the_team_cannot_start(tmp_path, monkeypatch):
    """The trackers open before the team starts (a missing library is exit 2 first); a team that fails to
    start must not leave them open."""
    import verbatim.jobs.trainer_team as trainer_team
    from verbatim.rl.plan import TrainPlan
    from verbatim.trainer.learner_config import LearnerConfig

    closed = []

    class Recorded:
        def close(self):
            closed.append(True)

    def no_team(*args, **kwargs):
        raise RuntimeError("no team")

    monkeypatch.setattr("verbatim.jobs.train.open_trackers", lambda *args: Recorded())
    monkeypatch.setattr(trainer_team, "start_followers", no_team)
    config = TrainConfig(play={"env": "guess"}, plan=TrainPlan(steps=1, groups=1, group_size=2),
                         learner=LearnerConfig(), output={"out": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match="no team"):
        run_training(config)
    assert closed == [True]


def test_the_learners_model_reaches_its_device_only_once_the_engine_has_started(tmp_path, monkeypatch):
    """An engine beside the trainer on one GPU measures its share against a device the trainer does not fill yet:
    execute starts the engine, then makes the learner (a stand-in engine here, which records the order)."""
    import asyncio

    from rich.console import Console

    from verbatim.jobs.train import execute

    events = []

    class Engine:
        async def start(self):
            events.append("engine started")
            return self

        def close(self):
            events.append("engine closed")

    class Loop:
        engine, out, learner, engine_start_s = Engine(), tmp_path, None, 0.0

        async def train(self, resume):
            events.append(f"trained by {self.learner}")
            return []

        def stop(self, request):
            pass

    monkeypatch.setattr("verbatim.jobs.train.write_config", lambda *args: None)
    config = TrainConfig(play={"env": "guess"}, output={"out": str(tmp_path / "run")})
    asyncio.run(execute(Loop(), config, Console(quiet=True), lambda: events.append("learner made") or "learner"))
    assert events == ["engine started", "learner made", "trained by learner", "engine closed"]
