"""scripts/gpu_probe.py, the device check kept for the first GPU, runs here on the CPU so that it does not rot:
with vLLM and pydantic unimportable (a GPU machine with torch and transformers alone runs it), every check
holds and says what it ran (the CPU's kernels, no CUDA group), and a check that breaks fails the probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = """
import runpy, sys
for name in ("vllm", "pydantic", "pyarrow", "typer"):
    sys.modules[name] = None  # what a bare PyTorch image lacks: importing it fails
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def probe(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "-c", BARE.format(script=str(ROOT / "scripts" / "gpu_probe.py")),
                           "--small", "--out", str(out), *extra], capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow
def test_the_gpu_probe_runs_on_a_bare_cpu_and_every_check_holds(tmp_path):
    done, report = probe(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["ok"] and report["machine"]["device"] == "cpu"
    for dtype in ("bf16", "fp32"):
        assert report[f"cascade_{dtype}"]["kernel"] == "cpu" and report[f"cascade_{dtype}"]["ok"]
    exact = report["prefixflow_exactness"]
    assert exact["fp32"] <= 1e-5 and exact["bf16_vs_full_bf16"] <= 3e-2
    assert report["group"]["backend"] == "gloo" and report["group"]["cpu_float64_sum"] is True
    assert report["group"]["cuda_sum"].startswith("not run")
    timing = report["timing"]
    assert timing["speedup"] > 0 and 1 < timing["flop_ideal_speedup"] and timing["peak_mib_full"] is None


def test_a_kernel_that_breaks_fails_its_check(monkeypatch):
    import importlib.util

    import torch

    import verbatim.trainer.cascade as cascade

    spec = importlib.util.spec_from_file_location("gpu_probe", ROOT / "scripts" / "gpu_probe.py")
    gpu_probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_probe)
    cpu = torch.device("cpu")
    assert gpu_probe.check_cascade(cpu, torch.float32, small=True)["ok"]
    real = cascade._math_attend
    monkeypatch.setattr(cascade, "_math_attend", lambda *args: (real(*args)[0] * 1.01, real(*args)[1]))
    broken = gpu_probe.check_cascade(cpu, torch.float32, small=True)
    assert not broken["ok"] and broken["errors"]["out"] > 1e-3
