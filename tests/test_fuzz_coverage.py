"""Coverage-guided fuzzing (atheris/libFuzzer) of the parsers of untrusted input, in CI.

Each target (``tests/fuzz_targets.py``) runs in its own process from one valid seed input,
with a fixed libFuzzer seed, for ``RUNS`` inputs or ``SECONDS`` seconds, whichever comes
first; an exception other than verbatim's own, or one input slower than 10 s, makes the
process exit non-zero with the input saved under ``tmp_path``. The hypothesis tests in
``tests/test_fuzz.py`` cover the same parsers with structured inputs; this reaches what
byte-level mutation guided by coverage reaches.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("fuzz_targets.py")
RUNS, SECONDS = 20_000, 5
"""At most 5 s a target: the slowest (parquet) still makes about 9,000 runs on this machine alone (measured
2026-12-06), the fastest reach the 20,000 in 2 s; the assertion below wants 1,000."""
TARGETS = ["jsonl", "parquet", "tasks", "completion:smollm2", "completion:qwen3", "completion:llama3",
           "completion:mistral-v7-tekken", "completion:gpt-oss", "completion:deepseek-v3"]


def rss_limit_mb(headroom_mb: int = 2048) -> int:
    """libFuzzer's memory limit, above what the fuzzer will think it started with.

    libFuzzer reads its RSS as ``ru_maxrss``, and Linux hands a child the peak RSS of the
    process it was forked from (pytest's, several GB once the engine tests have run), so its
    default 2 GB limit fails every target at once late in the suite. The fuzz process may use
    ``headroom_mb`` more than that inherited peak.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + headroom_mb


def driver(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_coverage_guided_fuzzing_finds_no_crash(target, tmp_path):
    corpus = tmp_path / "corpus"
    seeded = driver("--seed", target, str(corpus), cwd=tmp_path)
    assert seeded.returncode == 0 and any(corpus.iterdir()), seeded.stderr[-2000:]
    fuzz = driver(target, str(corpus), f"-runs={RUNS}", f"-max_total_time={SECONDS}", "-seed=1", "-timeout=10",
                  f"-rss_limit_mb={rss_limit_mb()}", f"-artifact_prefix={tmp_path}/", cwd=tmp_path)
    report = "\n".join(line for line in fuzz.stderr.splitlines() if not line.startswith("INFO: Instrumenting"))
    assert fuzz.returncode == 0, report[-6000:]
    done = re.search(r"Done (\d+) runs in (\d+) second", report)
    assert done and int(done.group(1)) >= 1000, report[-2000:]  # it really fuzzed
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
