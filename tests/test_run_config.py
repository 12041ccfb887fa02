"""One config describes a run: its flags, ``--config`` files, the run folder's ``config.toml`` and a resume's
check all derive from it (jobs/config.py, jobs/flag_table.py, jobs/run_record.py, cli/job_flags.py).

No engine starts here: a command's config is caught where its work would begin."""

from __future__ import annotations

import pytest
import tomllib
import typer
from command_config import config_of
from pydantic import Field
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.cli.job_flags import job_command
from verbatim.engine.protocol import CachePolicy
from verbatim.errors import InputError
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.jobs.config import RUN_FLAGS, TRAIN_FLAGS, RunOptions, TrainConfig, flags_of
from verbatim.jobs.run_record import CONFIG_FILE, recorded_config, toml_value, write_config
from verbatim.rl.plan import TrainPlan
from verbatim.trainer.learner_config import CorrectionConfig, LearnerConfig, LossConfig

runner = CliRunner()


def test_every_field_of_a_config_is_a_flag_but_the_derived_ones():
    paths = {".".join(f.path) for f in TRAIN_FLAGS.flags}
    assert {"learner.loss.clip_eps", "plan.max_lag", "max_tokens", "urls"} <= paths
    assert "learner.correction.max_version_lag" not in paths  # derived from --max-lag
    assert {f.name for f in RUN_FLAGS.flags} >= {"--stop-grace", "--env-arg", "--high-water", "--top-p"}
    assert all(f.help for f in TRAIN_FLAGS.flags + RUN_FLAGS.flags)


UNUSUAL = TrainConfig(
    env="guess", env_args={"high": 5, "name": "a \"quoted\"\nline ü"}, tasks=None, max_tokens=12, temperature=0.7,
    top_p=0.9, engine="http", urls=("http://127.0.0.1:8001", "http://127.0.0.1:8002"), admission=False,
    out="runs/x", log=("tensorboard",),
    plan=TrainPlan(steps=3, groups=1, group_size=2, seed=7, advantage="rloo", cache_policy=CachePolicy.FLUSH,
                   max_lag=1, fixed_lag=True, allow_truncated_sampling=True),
    learner=LearnerConfig(lr=3e-4, lr_schedule="cosine", prefixflow=False, dtype="bf16",
                          loss=LossConfig(normaliser="sequence", kl_coef=0.05),
                          correction=CorrectionConfig(token_tis_cap=None, sequence_tis="geo_mean",
                                                      token_mask_band=None, sequence_mask_band=(0.25, 4.0))),
    trainer_procs=2)


def test_config_toml_read_by_config_gives_the_same_training_config(tmp_path, monkeypatch):
    path = write_config(tmp_path / "run", TRAIN_FLAGS, UNUSUAL, "train")
    again = config_of("train", ["--config", str(path)], monkeypatch)
    assert again == UNUSUAL
    assert recorded_config(tmp_path / "run", TRAIN_FLAGS) == UNUSUAL
    text = path.read_text()
    assert "resume" not in tomllib.loads(text) and "token_mask_band = \"none\"" in text


def test_config_toml_of_a_rollout_run_repeats_it_too(tmp_path, monkeypatch):
    options = RunOptions(env="guess", groups=3, group_size=2, seed=4, cache_policy=CachePolicy.SALT, top_k=5,
                         stop_grace_s=2.5, env_args={"high": 9}, resume=True)
    path = write_config(tmp_path / "run", RUN_FLAGS, options, "run")
    assert config_of("run", ["--config", str(path)], monkeypatch) == options.model_copy(update={"resume": False})


def test_a_flag_on_the_command_line_still_wins_over_a_recorded_config(tmp_path, monkeypatch):
    path = write_config(tmp_path / "run", TRAIN_FLAGS, UNUSUAL, "train")
    again = config_of("train", ["--config", str(path), "--out", str(tmp_path / "new"), "--lr", "0.01"], monkeypatch)
    assert again.out == str(tmp_path / "new") and again.learner.lr == 0.01 and again.plan.seed == 7


def test_the_recorded_config_holds_no_credentials():
    secret = UNUSUAL.model_copy(update={"urls": ("http://user:hunter2@127.0.0.1:8001/?api_key=abc",)})
    assert "hunter2" not in str(TRAIN_FLAGS.values(secret.recorded()))
    assert "abc" not in str(TRAIN_FLAGS.values(secret.recorded()))


@pytest.mark.parametrize("value,text", [
    (True, "true"), (3, "3"), (1e-05, "1e-05"), (float("inf"), "inf"), ("a\"b\\c\n\x7f", '"a\\"b\\\\c\\u000A\\u007F"'),
    (["x", "y"], '["x", "y"]'),
])
def test_toml_values_read_back_as_written(value, text):
    assert toml_value(value) == text
    assert tomllib.loads(f"k = {text}")["k"] == value


class WithAKnob(TrainConfig):
    """A config a developer has just given one more field."""

    knob_turns: int = Field(default=3, ge=1)
    """How far the new knob turns."""


def test_a_field_added_to_the_config_is_a_flag_recorded_and_checked_without_another_edit(tmp_path, monkeypatch):
    table = flags_of(WithAKnob)
    seen = []
    knob_app = typer.Typer(cls=app.info.cls, rich_markup_mode=None)  # the CLI's one-line errors
    knob_app.command("train")(job_command(table, lambda config, summary: seen.append(config), "Train."))
    knob_app.command("other")(lambda: None)  # a group, so the command is called by name

    help_text = " ".join(runner.invoke(knob_app, ["train", "--help"]).output.split())
    assert "--knob-turns" in help_text and "How far the new knob turns. [x>=1] [default: 3]" in help_text

    result = runner.invoke(knob_app, ["train", "--env", "guess", "--knob-turns", "5", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert config.knob_turns == 5 and config.config()["train"]["knob_turns"] == 5  # the manifest's config
    path = write_config(tmp_path / "r", table, config, "train")
    assert "knob_turns = 5" in path.read_text()  # config.toml

    refused = runner.invoke(knob_app, ["train", "--knob-turns", "0"])
    assert refused.exit_code == 2 and "--knob-turns 0 must be at least 1" in refused.output

    TraceWriter(tmp_path / "r", RunManifest(run_id="r", model="m", renderer="r", engine={"block_size": 16},
                                            config=config.config()))
    from verbatim.jobs.train import check

    changed = config.model_copy(update={"knob_turns": 6, "resume": True})
    with pytest.raises(InputError, match="knob_turns: 5 -> 6"):  # the resume check reads it from config.toml
        check(changed)
    assert check(config.model_copy(update={"resume": True})) == 0  # the same knob goes on (no step trained yet)


def test_a_resume_compares_against_config_toml_where_the_folder_has_one(tmp_path):
    from verbatim.jobs.train import check

    out = tmp_path / "run"
    config = TrainConfig(env="guess", out=str(out), plan=TrainPlan(steps=2))
    TraceWriter(out, RunManifest(run_id="r", model="m", renderer="r", engine={"block_size": 16},
                                 config=config.config()))
    edited = config.model_copy(update={"learner": config.learner.model_copy(update={"lr": 0.5})})
    write_config(out, TRAIN_FLAGS, edited, "train")  # the record says 0.5, the manifest 1e-05
    with pytest.raises(InputError, match=r"learner.lr: 0.5 -> 1e-05"):
        check(config.model_copy(update={"resume": True}))
    (out / CONFIG_FILE).unlink()  # a folder written before config.toml: the manifest's config serves
    assert check(config.model_copy(update={"resume": True})) == 0
