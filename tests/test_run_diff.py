"""verbatim diff: two runs the same in everything compared, or the first place they part, in each thing compared.

The runs here are written by the trace writer from ledgers (no engine); the engine tests of reproducible runs
(tests/test_reproducible.py) run ``verbatim diff`` on real reruns too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Completion
from verbatim.harness.ledger import Ledger
from verbatim.harness.metrics_log import append_metrics
from verbatim.harness.run_diff import compare_metrics, diff_runs, first_part
from verbatim.harness.store import RunManifest, TraceWriter

runner = CliRunner()
PROMPT = [1, 2, 3, 4]


def rollout(rid: str, replies: list[list[int]], logprobs: list[list[float]] | None = None, reward: float = 1.0,
            version: int = 0):
    ledger = Ledger()
    ledger.append_prompt(PROMPT)
    for k, ids in enumerate(replies):
        lps = logprobs[k] if logprobs else [-0.25 - 0.125 * i for i in range(len(ids))]
        ledger.append_completion(Completion(token_ids=np.array(ids), logprobs=np.array(lps),
                                            versions=np.full(len(ids), version), finish_reason="stop",
                                            prompt_tokens=len(ledger), cached_tokens=0))
        if k < len(replies) - 1:
            ledger.append_observation([7, 8])
    return ledger.to_rollout(run_id="run", group_id="g0", rollout_id=rid, reward=reward)


BASE = {"r00": [[10, 11, 12], [13, 14]], "r01": [[20, 21], [22]]}


def write_run(path: Path, rollouts=None, config=None, metrics=None) -> Path:
    rollouts = rollouts if rollouts is not None else [rollout(rid, replies) for rid, replies in BASE.items()]
    manifest = RunManifest(run_id="run", engine={"block_size": 16},
                           config=config or {"train": {"seed": 5, "out": str(path)}})
    writer = TraceWriter(path, manifest)
    writer.write_batch(rollouts)
    writer.write_manifest(manifest.model_copy(update={"status": "completed"}))
    for record in metrics or []:
        append_metrics(path, record)
    return path


def step(n: int, loss: float = 0.5, **more) -> dict:
    return {"step": n, "loss": loss, "rollout_s": 1.0 + n, "trainer_peak_rss_mib": 900 + n,
            "ratio_quantiles": {"p50": 1.0}, **more}


def test_a_run_is_the_same_as_its_copy_in_everything_compared(tmp_path):
    a = write_run(tmp_path / "a", metrics=[step(1), step(2)])
    b = write_run(tmp_path / "b", metrics=[step(1), step(2)])
    result = diff_runs(a, b)
    assert result.same and result.settings == ()  # the run directories differ, and do not count
    assert [c.name for c in result.comparisons] == [
        "rollout ids", "token ids", "token sources", "sampler logprobs μ", "policy versions", "turn of each token",
        "rewards and statuses", "metrics"]
    assert all(c.items == 2 for c in result.comparisons)
    done = runner.invoke(app, ["diff", str(a), str(b)])
    assert done.exit_code == 0, done.output
    assert "the runs are the same in everything compared" in done.output


def test_a_rollout_is_counted_under_the_column_it_parts_in_first_at_its_earliest_token():
    same = rollout("r", [[10, 11, 12]])
    nearest = np.nextafter(np.float32(-0.375), np.float32(0.0))  # μ is float32: one bit off in its last place
    column, part = first_part(same, rollout("r", [[10, 11, 12]], logprobs=[[-0.25, nearest, -0.5]]))
    assert column == "logprob" and part.where == "rollout r, token 5 (turn 0, model)"
    assert (part.a, part.b) == ("-0.375", repr(float(nearest)))  # shown in full
    later_id = rollout("r", [[10, 11, 99]], logprobs=[[-0.25, -0.3, -0.5]])
    assert first_part(same, later_id)[0] == "logprob"  # μ parts at token 5, before the id at token 6
    assert first_part(same, rollout("r", [[10, 11, 12]], version=1))[0] == "policy_version"
    longer = rollout("r", [[10, 11, 12], [13]])
    column, part = first_part(same, longer)
    assert column == "token_id" and part.where == "rollout r, after its 7 shared tokens"
    assert (part.a, part.b) == ("7 tokens", "10 tokens")
    column, part = first_part(same, rollout("r", [[10, 11, 12]], reward=0.0))
    assert column == "outcome" and (part.a, part.b) == ("reward 1.0, ok", "reward 0.0, ok")
    assert first_part(same, rollout("r", [[10, 11, 12]])) == (None, None)


def test_two_runs_that_part_say_where_first_in_each_thing_and_exit_1(tmp_path):
    a = write_run(tmp_path / "a", metrics=[step(1), step(2)])
    changed = [rollout("r00", [[10, 11, 12], [13, 15]]), rollout("r01", BASE["r01"], reward=0.0),
               rollout("r02", [[30]])]
    b = write_run(tmp_path / "b", changed, config={"train": {"seed": 6, "out": "elsewhere"}},
                  metrics=[step(1), step(2, loss=0.25), step(3)])
    result = diff_runs(a, b)
    assert not result.same and result.settings == ("train.seed: 5 -> 6",)
    by_name = {c.name: c for c in result.comparisons}
    assert by_name["rollout ids"].differ == 1 and by_name["rollout ids"].first.where == "rollout r02"
    assert by_name["token ids"].differ == 1
    assert by_name["token ids"].first.where == "rollout r00, token 10 (turn 1, model)"
    assert (by_name["token ids"].first.a, by_name["token ids"].first.b) == ("14", "15")
    assert by_name["rewards and statuses"].differ == 1 and by_name["sampler logprobs μ"].same
    metrics = by_name["metrics"]
    assert (metrics.differ, metrics.first.where, metrics.first.a, metrics.first.b) == (2, "step 2, loss", "0.5",
                                                                                      "0.25")
    done = runner.invoke(app, ["diff", str(a), str(b)])
    assert done.exit_code == 1
    text = " ".join(done.output.replace("│", " ").split())
    assert "settings that differ: train.seed: 5 -> 6" in text
    assert "the runs differ; first in rollout ids: rollout r02" in text
    answer = json.loads(runner.invoke(app, ["diff", str(a), str(b), "--json"]).stdout)
    assert answer["same"] is False and answer["settings"] == ["train.seed: 5 -> 6"]


def test_metrics_leave_out_wall_times_and_memory_at_every_depth_and_count_a_step_one_run_lacks():
    assert compare_metrics([step(1, timings={"push_s": 1.0})], [step(1, rollout_s=99.0, timings={"push_s": 3.0})]).same
    nested = compare_metrics([step(1)], [step(1, ratio_quantiles={"p50": 1.5})])
    assert nested.first.where == "step 1, ratio_quantiles.p50" and (nested.first.a, nested.first.b) == ("1.0", "1.5")
    several = compare_metrics([step(1)], [step(1, loss=0.1, grad_norm=2.0)])
    assert several.first.where == "step 1, grad_norm (and 1 more)"
    short = compare_metrics([step(1), step(2)], [step(1)])
    assert (short.differ, short.first.where, short.first.a, short.first.b) == (1, "step 2", "present", "absent")


def _checkpoint(run: Path, weights: dict[str, np.ndarray], rng: bytes = b"rng") -> None:
    folder = run / "checkpoints" / "step-000002"
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "rng.pt").write_bytes(rng)
    (folder / "optimizer.pt").write_bytes(b"adam")


def test_the_newest_shared_checkpoint_is_compared_tensor_by_tensor_and_its_states_byte_for_byte(tmp_path):
    a, b, c = (write_run(tmp_path / name) for name in "abc")
    weights = {"layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "norm": np.ones(3, np.float32)}
    _checkpoint(a, weights)
    _checkpoint(b, weights | {"norm": np.array([1.0, 1.0, 1.25], np.float32)})
    _checkpoint(c, weights, rng=b"other rng")
    moved = {x.name: x for x in diff_runs(a, b).comparisons}["newest shared checkpoint"]
    assert moved.note == "step-000002: weights, optimizer.pt, rng.pt"
    assert moved.first.where == "tensor norm" and moved.first.a == "F32 (3,), max |Δ| 0.25"
    rng = {x.name: x for x in diff_runs(a, c).comparisons}["newest shared checkpoint"]
    assert (rng.first.where, rng.first.a, rng.first.b) == ("checkpoints/step-000002/rng.pt", "these bytes",
                                                           "other bytes")


def _bf16_file(path: Path, values: list[int]) -> None:
    """A safetensors file of one bfloat16 tensor (numpy has no bfloat16: written by hand, as the format says)."""
    data = np.array(values, np.uint16).tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [len(values)], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_the_same_tensors_laid_out_in_another_order_are_the_same_weights_and_other_metadata_is_not(tmp_path):
    from verbatim.harness.run_diff import _weights

    weights = {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}
    save_file(weights, str(tmp_path / "one.safetensors"), metadata={"format": "pt"})
    data = np.zeros(3, np.float32).tobytes() + np.ones(2, np.float32).tobytes()  # b first, then a
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                         "a": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}).encode()
    (tmp_path / "two.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    assert (tmp_path / "one.safetensors").read_bytes() != (tmp_path / "two.safetensors").read_bytes()
    assert _weights(tmp_path / "one.safetensors", tmp_path / "two.safetensors") == []
    save_file(weights, str(tmp_path / "three.safetensors"), metadata={"format": "np"})
    (part,) = _weights(tmp_path / "one.safetensors", tmp_path / "three.safetensors")
    assert part.where == "one.safetensors (metadata)" and part.b == '{"format": "np"}'


def test_bfloat16_weights_are_compared_by_their_bytes_and_their_difference_shown(tmp_path):
    from verbatim.harness.run_diff import _weights

    _bf16_file(tmp_path / "a.safetensors", [0x3F80, 0x4000])  # 1.0, 2.0
    _bf16_file(tmp_path / "b.safetensors", [0x3F80, 0x4040])  # 1.0, 3.0
    _bf16_file(tmp_path / "c.safetensors", [0x3F80, 0x4000])
    assert _weights(tmp_path / "a.safetensors", tmp_path / "c.safetensors") == []
    (part,) = _weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert (part.where, part.a) == ("tensor w", "BF16 (2,), max |Δ| 1")


@pytest.mark.parametrize("which", ["first", "second"])
def test_a_folder_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, which):
    run = write_run(tmp_path / "run")
    args = [str(tmp_path / "nothing"), str(run)] if which == "first" else [str(run), str(tmp_path)]
    done = runner.invoke(app, ["diff", *args])
    assert done.exit_code == 2
    assert "is not" in done.output and len(done.output.strip().splitlines()) <= 2


def test_a_damaged_batch_file_is_a_warning_naming_the_run_and_the_intact_rollouts_are_compared(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    (b / "rollouts-000002.parquet").write_bytes(b"not parquet")
    result = diff_runs(a, b)
    assert len(result.problems) == 1 and result.problems[0].startswith("B: rollouts-000002.parquet")
    assert result.same
    done = runner.invoke(app, ["diff", str(a), str(b)])
    assert done.exit_code == 0 and "warning: B: rollouts-000002.parquet" in done.output


def test_the_first_differing_token_is_shown_as_text_with_the_runs_tokenizer(tmp_path, default_model_dir,
                                                                            default_tokenizer):
    def encode(text: str) -> list[int]:
        return default_tokenizer.encode(text, add_special_tokens=False)

    runs = []
    for name, guess in (("a", "I guess 3 first."), ("b", "I guess 4 first.")):
        run = write_run(tmp_path / name, [rollout("r00", [encode(guess)])])
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps(manifest | {"model": str(default_model_dir),
                                                                  "renderer": "smollm2"}))
        runs.append(run)
    done = runner.invoke(app, ["diff", *map(str, runs)])
    assert done.exit_code == 1
    assert "I guess ': A '3', B '4'" in done.output, done.output  # the tokens before it, then each run's
