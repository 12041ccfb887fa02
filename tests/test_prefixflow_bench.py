"""``verbatim bench prefixflow --json``: the shape of its objects and the exactness it reports.

Timings are not tested; a tiny random Llama saved to a folder stands in for the model.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from verbatim.bench.prefixflow import KEYS, Case, flop_ideal_speedup, markdown_table, peak_rss_mb
from verbatim.cli.app import app

from .test_prefixflow import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=2).save_pretrained(path)
    return path


def test_json_objects_have_the_issue_keys_and_exact_gradients(tiny_model_dir):
    result = runner.invoke(app, ["bench", "prefixflow", "--json", "--model", str(tiny_model_dir),
                                 "--seq-len", "40", "--prefix-ratio", "0.5", "--prefix-ratio", "0.83",
                                 "--group-size", "3", "--micro-batch", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [(r["prefix_ratio"], r["group_size"]) for r in rows] == [(0.5, 3), (0.83, 3)]
    for r in rows:
        assert tuple(r) == KEYS
        assert r["prefix_tokens"] + r["suffix_tokens"] == 40
        p, s = r["prefix_tokens"], r["suffix_tokens"]
        assert r["ideal_speedup"] == pytest.approx(3 * (p + s) / (p + 3 * s), abs=1e-3)
        assert 1 < r["flop_ideal_speedup"] < r["ideal_speedup"] and 2 <= r["phase_b_rows"] <= 3
        assert r["flop_ideal_speedup_recompute"] < r["flop_ideal_speedup"]
        assert r["baseline_s"] > 0 and r["prefixflow_s"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_s"] / r["prefixflow_s"], rel=2e-2)
        assert 0 <= r["grad_max_rel_err"] <= 1e-5
        peaks = [r[f"peak_mb_{n}"] for n in ("baseline", "prefixflow", "prefixflow_kept", "prefixflow_low_memory")]
        assert all(isinstance(peak, float) and peak >= 0 for peak in peaks)
        for key in ("kept", "low_memory"):
            assert r[f"speedup_{key}"] == pytest.approx(r["baseline_s"] / r[f"prefixflow_{key}_s"], rel=2e-2)
    table = markdown_table(rows)
    assert table.count("| 0.83 | 3 |") == 4  # the configuration, then its three PrefixFlow settings
    assert "| 0.83 | 3 | phase B at M | kept | 2 |" in table
    assert "| 0.83 | 3 | low memory | recomputed | 2 |" in table


def test_bad_ratio_is_a_one_line_input_error(tiny_model_dir):
    result = runner.invoke(app, ["bench", "prefixflow", "--model", str(tiny_model_dir), "--prefix-ratio", "1.5"])
    assert result.exit_code == 2
    assert "--prefix-ratio must lie in (0, 1)" in result.output


def test_case_geometry_and_ideal_speedup():
    case = Case(0.83, 8, 1024)
    assert (case.prefix_tokens, case.suffix_tokens) == (850, 174)
    assert case.ideal_speedup == pytest.approx(8 * 1024 / (850 + 8 * 174))
    assert Case(0.999, 2, 10).suffix_tokens == 1  # every suffix keeps a token


def test_flop_ideal_of_the_default_model_at_the_target():
    """SmolLM2-135M's shape: prefix attention and the output layer put the FLOP ideal near 86 % of the token ideal."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3)
    case = Case(0.83, 8, 1024)
    flops = flop_ideal_speedup(case, config)
    assert 3.1 < flops < 3.2 and 0.84 < flops / case.ideal_speedup < 0.88
    assert flop_ideal_speedup(Case(0.5, 1, 1024), config) == pytest.approx(1.0)
    again = flop_ideal_speedup(case, config, recompute=True)  # a second prefix forward: a third of its work more
    assert 0.76 < again / case.ideal_speedup < 0.80


def test_peak_memory_sees_a_large_allocation():
    with peak_rss_mb() as peak:
        block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        del block
    assert peak.mb is not None and 60 <= peak.mb < 200


def test_write_puts_the_timings_into_the_named_section(tmp_path, tiny_model_dir):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- bench-prefixflow-small:begin -->\nold\n<!-- bench-prefixflow-small:end -->\n\nkeep\n")
    args = ["bench", "prefixflow", "--model", str(tiny_model_dir), "--seq-len", "40", "--prefix-ratio", "0.5",
            "--group-size", "2", "--no-low-memory", "--write", str(doc)]
    refused = runner.invoke(app, args)  # the default section is not in this file: refused before any work
    assert refused.exit_code == 2 and "bench-prefixflow:begin" in refused.output and "r=0.5" not in refused.output
    result = runner.invoke(app, args + ["--section", "bench-prefixflow-small"])
    assert result.exit_code == 0, result.output
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- bench-prefixflow-small:end -->\n\nkeep\n")
    assert "| 0.5 | 2 | 20 | 20 | 2 |" in text and "Machine (detected): " in text and "torch " in text
    assert "PrefixFlow setting" not in text  # --no-low-memory: the fast PrefixFlow only, no settings table
    assert (f"`verbatim bench prefixflow --prefix-ratio 0.5 --group-size 2 --seq-len 40 --micro-batch 2 --repeats 1 "
            f"--model {tiny_model_dir} --no-low-memory --write {doc} --section bench-prefixflow-small`") in text


def test_exactness_table_is_measured_and_written(tmp_path, tiny_model_dir):
    doc = tmp_path / "trainer.md"
    doc.write_text("# T\n\n<!-- prefixflow-exactness:begin -->\n<!-- prefixflow-exactness:end -->\n")
    result = runner.invoke(app, ["bench", "prefixflow", "--exactness", "--model", str(tiny_model_dir),
                                 "--write", str(doc)])
    assert result.exit_code == 0, result.output
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| ") and "setting" not in line]
    assert len(rows) == 6 and "(96 runs)" in rows[0] and "(24 runs)" in rows[1] and "(3 runs)" in rows[2]
    assert "(9 cases;" in rows[5] and "vs the plain HF forward: " in rows[3]
    measured = [float(row.split(" | ")[1].split(" ")[0]) for row in rows]
    bounds = [1e-5, 1e-5, 1e-12, 1e-10]
    assert all(0 <= m <= b for m, b in zip(measured, bounds)) and 0 < measured[5] <= 3e-2
    against_hf = float(rows[3].split("vs the plain HF forward: ")[1].split(")")[0])
    assert 0 <= against_hf <= 1e-10
    assert f"`verbatim bench prefixflow --exactness --model {tiny_model_dir} --write {doc}`" in doc.read_text()



RETAINED = """
import sys, torch
from pathlib import Path
from verbatim.bench.prefixflow import _status_kb, fix_mmap_threshold
if sys.argv[1] == "pinned":
    fix_mmap_threshold(1)
status = Path("/proc/self/status")
torch.ones(1 << 10).add_(1)  # torch's first call sets up its own state, which is not what is measured
kept = []
start = _status_kb(status, "VmRSS")
for _ in range(3):
    block = torch.ones(8 << 18)  # 8 MiB, touched; freeing a mapped block raises glibc's dynamic threshold
    kept.append(torch.ones(1 << 10))  # a small live tensor after it
    del block
print((_status_kb(status, "VmRSS") - start) / 1024)
"""


@pytest.mark.parametrize("mode", ["dynamic", "pinned"])
def test_pinned_mmap_threshold_returns_freed_blocks(mode):
    """glibc's default keeps a freed 8 MiB block resident once its threshold has risen; pinned, every one is unmapped.

    Measured over the whole loop: a later block may reuse the pages an earlier one left, so one iteration's
    growth alone says nothing."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, check=True)
    retained = float(out.stdout.split()[-1])
    assert (retained >= 7) if mode == "dynamic" else (retained < 1), (mode, retained)
