"""One config describes a run: its flags, ``--config`` files, the run folder's ``config.toml`` and a resume's
check all derive from it (jobs/config.py, jobs/flag_table.py, jobs/run_record.py, cli/job_flags.py).

No engine starts here: a command's config is caught where its work would begin."""

from __future__ import annotations

import pytest
import tomllib
import typer
from command_config import config_of, with_flags
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
    assert {"learner.loss.clip_eps", "plan.max_lag", "sampling.max_tokens", "engine.urls"} <= paths
    assert "learner.correction.max_version_lag" not in paths  # derived from --max-lag
    assert {f.name for f in RUN_FLAGS.flags} >= {"--stop-grace", "--env-arg", "--high-water", "--top-p"}
    assert all(f.help for f in TRAIN_FLAGS.flags + RUN_FLAGS.flags)


UNUSUAL = TrainConfig(
    play={"env": "guess", "env_args": {"high": 5, "name": "a \"quoted\"\nline ü"}, "tasks": None},
    sampling={"max_tokens": 12, "temperature": 0.7, "top_p": 0.9},
    engine={"kind": "http", "urls": ("http://127.0.0.1:8001", "http://127.0.0.1:8002")}, routing={"admission": False},
    output={"out": "runs/x", "log": ("tensorboard",)},
    plan=TrainPlan(steps=3, groups=1, group_size=2, seed=7, advantage="rloo", cache_policy=CachePolicy.FLUSH,
                   max_lag=1, fixed_lag=True, allow_truncated_sampling=True),
    learner=LearnerConfig(lr=3e-4, lr_schedule="cosine", prefixflow=False, dtype="bf16",
                          loss=LossConfig(normaliser="sequence", kl_coef=0.05),
                          correction=CorrectionConfig(token_tis_cap=None, sequence_tis="geo_mean",
                                                      token_mask_band=None, sequence_mask_band=(0.25, 4.0))),
    placement={"trainer_procs": 2},
    evaluation={"eval_every": 2, "eval_groups": 3, "eval_samples": 4, "eval_tasks": "held.jsonl",
                "eval_temperature": 0.0, "eval_pass_k": (1, 2), "allow_overlap": True})


def test_config_toml_read_by_config_gives_the_same_training_config(tmp_path, monkeypatch):
    path = write_config(tmp_path / "run", TRAIN_FLAGS, UNUSUAL, "train")
    again = config_of("train", ["--config", str(path)], monkeypatch)
    assert again == UNUSUAL
    assert recorded_config(tmp_path / "run", TRAIN_FLAGS) == UNUSUAL
    text = path.read_text()
    assert "resume" not in tomllib.loads(text) and "token_mask_band = \"none\"" in text


def test_config_toml_of_a_rollout_run_repeats_it_too(tmp_path, monkeypatch):
    options = RunOptions(play={"env": "guess", "env_args": {"high": 9}}, sampling={"top_k": 5},
                         output={"resume": True}, groups=3, group_size=2, seed=4, cache_policy=CachePolicy.SALT,
                         stop_grace_s=2.5)
    path = write_config(tmp_path / "run", RUN_FLAGS, options, "run")
    assert config_of("run", ["--config", str(path)], monkeypatch) == with_flags(options, resume=False)


def test_config_toml_of_an_evaluation_repeats_it_with_its_samples_and_ks(tmp_path, monkeypatch):
    from verbatim.jobs.config import EVAL_FLAGS, EvalOptions

    options = EvalOptions(play={"env": "guess"}, engine={"model": "runs/x/checkpoints/step-000004"}, groups=3,
                          group_size=8, pass_k=(1, 8), seed=2)
    path = write_config(tmp_path / "run", EVAL_FLAGS, options, "eval")
    assert 'pass_k = "1,8"' in path.read_text() and "samples = 8" in path.read_text()
    assert config_of("eval", ["--config", str(path)], monkeypatch) == options
    assert config_of("eval", ["--env", "guess", "--samples", "8", "--pass-k", "2,8"], monkeypatch).pass_k == (2, 8)


def test_a_flag_on_the_command_line_still_wins_over_a_recorded_config(tmp_path, monkeypatch):
    path = write_config(tmp_path / "run", TRAIN_FLAGS, UNUSUAL, "train")
    again = config_of("train", ["--config", str(path), "--out", str(tmp_path / "new"), "--lr", "0.01"], monkeypatch)
    assert again.output.out == str(tmp_path / "new") and again.learner.lr == 0.01 and again.plan.seed == 7


def test_the_recorded_config_holds_no_credentials():
    secret = with_flags(UNUSUAL, url=["http://user:hunter2@127.0.0.1:8001/?api_key=abc"])
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
    knob_app.command("train")(job_command(table, lambda config, summary, force: seen.append(config), "Train."))
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

    changed = with_flags(config, knob_turns=6, resume=True)
    with pytest.raises(InputError, match="knob_turns: 5 -> 6"):  # the resume check reads it from config.toml
        check(changed)
    assert check(with_flags(config, resume=True)) == 0  # the same knob goes on (no step trained yet)


def test_a_resume_compares_against_config_toml_where_the_folder_has_one(tmp_path):
    from verbatim.jobs.train import check

    out = tmp_path / "run"
    config = TrainConfig(play={"env": "guess"}, output={"out": str(out)}, plan=TrainPlan(steps=2))
    TraceWriter(out, RunManifest(run_id="r", model="m", renderer="r", engine={"block_size": 16},
                                 config=config.config()))
    write_config(out, TRAIN_FLAGS, with_flags(config, lr=0.5), "train")  # the record says 0.5, the manifest 1e-05
    with pytest.raises(InputError, match=r"learner.lr: 0.5 -> 1e-05"):
        check(with_flags(config, resume=True))
    (out / CONFIG_FILE).unlink()  # a folder written before config.toml: the manifest's config serves
    assert check(with_flags(config, resume=True)) == 0


def _flat(train: dict) -> dict:
    """A ``train`` config as runs recorded it before the config had sections: every field of ``play``,
    ``sampling``, ``routing``, ``output`` and ``placement`` at the top, the engine's as ``engine``,
    ``engine_gpu_memory`` …"""
    flat = {k: v for k, v in train.items() if k in ("plan", "learner")}
    for section in ("play", "sampling", "routing", "output", "placement"):
        flat.update(train.get(section, {}))
    renamed = {"kind": "engine", "gpu_memory": "engine_gpu_memory", "tensor_parallel": "engine_tensor_parallel"}
    flat.update({renamed.get(k, k): v for k, v in train["engine"].items()})
    return flat


def test_a_run_recorded_before_the_config_had_sections_resumes_and_its_changes_are_named(tmp_path):
    from verbatim.jobs.train import check

    out = tmp_path / "run"
    config = TrainConfig(play={"env": "guess", "env_args": {"high": 5}}, sampling={"max_tokens": 12},
                         engine={"max_model_len": 2048}, output={"out": str(out)}, plan=TrainPlan(steps=2))
    flat = _flat(config.config()["train"])
    assert flat["max_tokens"] == 12 and flat["engine"] == "inproc" and "play" not in flat
    TraceWriter(out, RunManifest(run_id="r", model="m", renderer="r", engine={"block_size": 16},
                                 config={"train": flat}))
    later = {"evaluation"}  # a section added after configs had sections: a resume fills it in (ADDED)
    assert TRAIN_FLAGS.nest(flat) == {k: v for k, v in config.config()["train"].items() if k not in later}
    assert check(with_flags(config, resume=True)) == 0
    with pytest.raises(InputError, match=r"sampling.max_tokens: 12 -> 13"):
        check(with_flags(config, resume=True, max_tokens=13))
    with pytest.raises(InputError, match=r"engine.kind: 'inproc' -> 'http'"):
        check(with_flags(config, resume=True, engine="http", url=["http://127.0.0.1:9"]))


# -- run and train: the same rollout flags, grouped help ------------------------------------------------------

ROLLOUT_SECTIONS = ("play", "sampling", "engine", "routing", "output")
PLAYED_BY_THE_LOOP = ("groups", "group_size", "seed", "cache_policy", "concurrency")
"""Train's ``plan`` fields that say how rollouts are played: ``run`` has them at its top level."""


def test_run_takes_every_rollout_flag_train_takes_with_its_default_or_says_why_not():
    from verbatim.jobs.config import RUN_FLAGS, TRAIN_FLAGS

    run = {flag.name: flag for flag in RUN_FLAGS.flags}
    rollout_flags = [f for f in TRAIN_FLAGS.flags
                     if f.path[0] in ROLLOUT_SECTIONS or (f.path[0] == "plan" and f.path[1] in PLAYED_BY_THE_LOOP)]
    assert len(rollout_flags) > 25
    for flag in rollout_flags:
        assert flag.name in run, f"verbatim run has no {flag.name}"
        theirs = run[flag.name]
        if theirs.default != flag.default and flag.name not in ("--out", "--groups"):  # a folder; per step
            for help_text, other in ((flag.help, "run"), (theirs.help, "train")):
                assert other in help_text, f"{flag.name}: defaults {theirs.default} (run) and {flag.default} " \
                                           f"(train) differ and its help does not say why: {help_text}"


@pytest.mark.parametrize("command,sections,example", [
    ("train", ["What to play:", "Sampling:", "The loop:", "The learner:", "The team: where the trainer runs:",
               "Evaluation on held-out tasks:", "The engine:", "Routing over replicas:", "Output:"],
     "A first training run: verbatim train --env"),
    ("eval", ["What to play:", "The run:", "Sampling:", "The engine:", "Routing over replicas:", "Output:"],
     "Evaluate a training run's newest checkpoint on 8 held-out guess games"),
    ("run", ["What to play:", "The run:", "Sampling:", "The engine:", "Routing over replicas:", "Output:"],
     "A first run: verbatim run --env guess"),
])
def test_help_lists_the_flags_by_section_and_ends_with_a_first_run(command, sections, example):
    from verbatim.cli.app import app

    text = CliRunner().invoke(app, [command, "--help"], terminal_width=120).output
    found = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert found == sections, found
    output = text.split("Output:")[1]
    assert "--summary-json" in output and "--force" in output and "--config" in output
    epilog = " ".join(output.split("--help")[1].split())  # after the last option: the example
    assert example in epilog, epilog
