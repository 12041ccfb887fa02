"""``verbatim bench train-step``: every (model, setting) in its own process, a table only when all of them trained."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from verbatim.bench import train_step
from verbatim.bench.prefixflow_exactness import VOCAB, tiny_llama
from verbatim.cli.app import app
from verbatim.errors import BenchmarkError

SMALL = train_step.Workload(groups=2, group_size=2, prompt=6, reply=5, microbatch=2, threads=1)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tied=True, seed=0).save_pretrained(folder)
    return folder


def test_the_rows_train_every_model_token_without_a_sampler_logprob():
    rows = train_step.step_input(VOCAB, SMALL)
    assert len(rows.columns) == SMALL.rows and rows.behaviour_from_trainer
    assert [len(g) for g in rows.groups] == [SMALL.group_size] * SMALL.groups
    assert all(int(c.loss_mask.sum()) == SMALL.reply for c in rows.columns)
    first, second = rows.columns[0].token_id, rows.columns[1].token_id
    assert (first[:SMALL.prompt] == second[:SMALL.prompt]).all()  # a group shares its prompt


def test_each_setting_turns_on_its_option_alone_and_all_turns_on_every_one():
    assert train_step.SETTINGS["fp32"] == {"logprob_chunk": 0}
    assert train_step.SETTINGS["chunked"] == {}  # the learner's default chunk
    assert train_step.SETTINGS["bf16"]["dtype"] == "bf16" and train_step.SETTINGS["bf16"]["logprob_chunk"] == 0
    assert train_step.SETTINGS["checkpointing"] == {"logprob_chunk": 0, "checkpoint_layers": True}
    assert train_step.SETTINGS["all"] == {"dtype": "bf16", "checkpoint_layers": True}
    assert train_step.SETTINGS["lora"] == {"logprob_chunk": 0, "lora": {"rank": 16}}  # fp32's, with an adapter


def test_each_setting_runs_in_its_own_process_and_makes_one_row_per_path(tiny_folder):
    results = train_step.run_bench([str(tiny_folder)], ["fp32", "all"], SMALL, paths=train_step.PATHS)
    assert [(r["path"], r["setting"]) for r in results] == [("plain", "fp32"), ("plain", "all"),
                                                            ("prefixflow", "fp32"), ("prefixflow", "all")]
    assert results[1]["config"] == {"dtype": "bf16", "checkpoint_layers": True, "logprob_chunk": 512}
    assert all(r["step_s"] > 0 and r["step_peak_mb"] is not None for r in results)
    table = train_step.markdown_table(results)
    assert table.count("\n") == len(results) + 1
    assert table.count("| 1.00x | 1.00x |") == 2  # each path's fp32 row is its own reference
    text = train_step.section_text(results, SMALL, "verbatim bench train-step")
    assert "Measured by `verbatim bench train-step`" in text


def test_a_lora_row_holds_and_pushes_the_adapters_state_alone(tiny_folder):
    full, adapter = train_step.run_bench([str(tiny_folder)], ["fp32", "lora"], SMALL)
    assert full["parameters"] == adapter["parameters"]  # the model's own, the adapter's not counted
    # rank 16 on a width of 64 is half the tiny model's size; on the default model it is a few per cent
    assert 0 < adapter["push_mb"] < full["push_mb"] and 0 < adapter["optimizer_mb"] < full["optimizer_mb"]
    assert "| lora |" in train_step.markdown_table([full, adapter])


def test_a_setting_that_fails_is_an_error_not_a_table(tmp_path):
    with pytest.raises(BenchmarkError, match="failed"):
        train_step.run_bench([str(tmp_path / "no-model")], ["fp32"], SMALL)


@pytest.mark.parametrize("args,needle", [
    (["--setting", "fp16"], "unknown --setting 'fp16'"),
    (["--path", "fast"], "unknown --path 'fast'"),
    (["--write", "missing.md"], "--write missing.md: no such file"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_step, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    result = CliRunner().invoke(app, ["bench", "train-step", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.output
