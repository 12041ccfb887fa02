"""`verbatim models tiny FAMILY`: small random model folders with the family's real tokenizer and template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Message
from verbatim.errors import InputError
from verbatim.harness.tiny_models import MARKER, TINY_FAMILIES, tiny_family, write_tiny_model

FAMILIES = sorted(TINY_FAMILIES)
CONVERSATION = [Message(role="user", content="Hello there, what is 2+2?"),
                Message(role="assistant", content="It is 4."), Message(role="user", content="Thanks! And 3+3?")]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Every family's folder at seed 0, written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    yield {name: write_tiny_model(name, root / name, seed=0) for name in FAMILIES}
    shutil.rmtree(root, ignore_errors=True)  # 0.5 GB, Gemma's vocabulary mostly


@pytest.fixture(scope="module")
def folder_tokenizers(tiny_dirs: dict[str, Path]) -> dict[str, object]:
    """Each folder's tokenizer as AutoTokenizer reads it back (Gemma's 262k vocabulary takes seconds)."""
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(folder) for name, folder in tiny_dirs.items()}


def _weights(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_folder_loads_in_float32_with_a_vocabulary_covering_its_tokenizer(
        family: str, tiny_dirs: dict[str, Path], folder_tokenizers: dict, one_torch_thread: None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32)
    tokenizer = folder_tokenizers[family]
    config = model.config
    assert config.model_type == tiny_family(family).model_type
    assert all(p.dtype == torch.float32 for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert config.num_hidden_layers == 2 and head_dim in (32, 64)  # vLLM's CPU attention sizes
    assert config.num_key_value_heads < config.num_attention_heads
    assert model.get_input_embeddings().weight.shape[0] == config.vocab_size >= len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id and config.bos_token_id == tokenizer.bos_token_id
    ids = tokenizer("a tiny test", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_renderer_is_detected_and_renders_as_the_folder_template(
        family: str, tiny_dirs: dict[str, Path], folder_tokenizers: dict) -> None:
    from verbatim.renderers.detect import detect_folder
    from verbatim.renderers.registry import get_renderer

    folder = tiny_dirs[family]
    detected = detect_folder(folder)
    assert detected == tiny_family(family).renderer
    renderer = get_renderer(detected, model_dir=folder)  # as `verbatim train --model DIR` loads it
    expected = folder_tokenizers[family].apply_chat_template(
        renderer.template_messages(CONVERSATION), add_generation_prompt=True, tokenize=True, return_dict=False,
        **renderer.template_kwargs())
    assert list(renderer.render(CONVERSATION, add_generation_prompt=True).token_ids) == list(expected)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(renderer.stop_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_seed_writes_the_same_weights_and_another_seed_others(
        family: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = write_tiny_model(family, tmp_path / "again", seed=0)
    assert _weights(again) == _weights(tiny_dirs[family])
    other = write_tiny_model(family, tmp_path / "other", seed=1)
    assert _weights(other) != _weights(tiny_dirs[family])
    assert json.loads((other / MARKER).read_text())["seed"] == 1


@pytest.mark.slow
def test_family_settings_are_kept(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoConfig

    gemma2 = AutoConfig.from_pretrained(tiny_dirs["gemma2"])
    assert (gemma2.final_logit_softcapping, gemma2.attn_logit_softcapping) == (30.0, 50.0)
    assert gemma2.sliding_window == 16 and "sliding_attention" in gemma2.layer_types
    assert AutoConfig.from_pretrained(tiny_dirs["qwen2.5"]).use_sliding_window is False
    assert AutoConfig.from_pretrained(tiny_dirs["qwen3-moe"]).num_experts == 4
    assert AutoConfig.from_pretrained(tiny_dirs["qwen3"]).tie_word_embeddings is True


def test_an_unknown_family_lists_the_known_ones() -> None:
    with pytest.raises(InputError) as refused:
        tiny_family("nosuch")
    assert refused.value.one_line() == f"no tiny model family 'nosuch' (known: {', '.join(TINY_FAMILIES)})"


def test_a_folder_of_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a tiny model"):
        write_tiny_model("mistral", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_cli_bad_family_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["models", "tiny", "nosuch", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no tiny model family 'nosuch'"), result.stderr
    assert not (tmp_path / "x").exists()


def test_cli_help_lists_the_families() -> None:
    result = runner.invoke(app, ["models", "tiny", "--help"])
    assert result.exit_code == 0
    assert all(name in result.stdout for name in FAMILIES)


@pytest.mark.slow
def test_cli_writes_the_folder_and_writes_over_its_own(tmp_path: Path) -> None:
    out = tmp_path / "phi3"
    for seed in ("3", "4"):
        result = runner.invoke(app, ["models", "tiny", "phi3", "--out", str(out), "--seed", seed])
        assert result.exit_code == 0, result.output
        assert str(out) in result.stdout and "renderer phi3" in result.stdout
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", MARKER} <= {p.name for p in out.iterdir()}
    assert json.loads((out / MARKER).read_text())["seed"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["phi3"]  # no staging folder left beside it


def test_sizes_in_place_of_the_tiny_ones_are_written_and_recorded(tmp_path: Path) -> None:
    import json

    from verbatim.harness.tiny_models import MARKER, build_tiny_folder

    sizes = {"num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 256}
    built = build_tiny_folder("qwen2.5", tmp_path / "sized", seed=0, sizes=sizes)
    config = json.loads((built.path / "config.json").read_text())
    assert {key: config[key] for key in sizes} == sizes and config["num_attention_heads"] == 2
    assert json.loads((built.path / MARKER).read_text())["sizes"] == sizes
