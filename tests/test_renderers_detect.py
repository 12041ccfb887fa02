"""Bring your own model: a model folder's renderer is the family whose official template its chat
template is (renderers/detect.py); anything else is one line naming the closest family, exit 2,
before an engine starts or a model loads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.errors import InputError
from verbatim.renderers.detect import detect_family, detect_folder, folder_template, normalise
from verbatim.renderers.templates import official_templates

runner = CliRunner()


def official(stem: str) -> str:
    """The shipped file's exact text (no newline translation)."""
    return official_templates()[stem].read_bytes().decode("utf-8")


def model_folder(root: Path, template: str | list | None = None, *, jinja: str | None = None) -> Path:
    """A fake Hugging Face folder: config.json, a tokenizer_config.json with ``template`` as its
    chat_template (none if None), and a chat_template.jinja if ``jinja`` is given."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja, newline="")
    return root


def crlf_and_trailing_spaces(text: str) -> str:
    return "\r\n".join(line + "  " for line in text.split("\n")) + "\n\n"


@pytest.mark.parametrize("stem,family", [
    ("qwen3", "qwen3"),
    ("qwen3_2504_original", "qwen3"),  # a family's second verified template
    ("llama3_2_instruct", "llama3"),
    ("deepseek_v3_1", "deepseek-v3.1"),  # shared by both thinking modes: the first registered
    ("gemma3", "gemma3"),
])
def test_a_copy_of_an_official_template_is_its_family_whatever_its_line_endings(stem, family):
    text = official(stem)
    assert detect_family(text) == family
    assert detect_family(crlf_and_trailing_spaces(text)) == family


def test_the_shipped_crlf_template_matches_its_lf_copy():
    text = official("kimi_k2_instruct")
    assert "\r\n" in text  # shipped as published, CRLF kept
    assert detect_family(text.replace("\r\n", "\n")) == "kimi-k2"


def test_normalise_touches_only_line_ends_and_the_ends_of_the_text():
    assert normalise("\n  a \r\n\tb\t\rc  \n\n") == "a\n\tb\nc"
    assert normalise("{{ 'x  y' }}") == "{{ 'x  y' }}"


@pytest.mark.parametrize("text,closest", [
    (official("qwen3").replace("<|im_start|>system\\n", "<|im_start|>system\\n\\n", 1), "qwen3"),
    # Meta-Llama-3-Instruct's short first template: few characters in common with 3.1's, the same markup
    (official("llama3_instruct"), "llama3"),
    (official("deepseek_r1_distill"), "deepseek-v3"),
])
def test_an_edited_or_unverified_template_is_refused_naming_the_closest_family(text, closest):
    with pytest.raises(InputError) as caught:
        detect_family(text)
    line = caught.value.one_line()
    assert f"(closest: {closest}, " in line and f"--renderer {closest}" in line, line
    assert "\n" not in line


def test_an_edit_inside_a_string_is_not_whitespace():
    text = official("smollm2_instruct").replace("<|im_start|>", "<|im_start|> ", 1)
    with pytest.raises(InputError, match=r"closest: smollm2, with 100% of the markup tokens and 99% of the text"):
        detect_family(text)


def test_the_pure_function_takes_any_official_texts_in_their_order():
    known = {"a": ("<a>{{ x }}",), "b": ("<b>{{ x }}", "<a>{{ x }}")}
    assert detect_family("<a>{{ x }}\r\n", known) == "a"
    assert detect_family("<b>{{ x }}", known) == "b"
    with pytest.raises(InputError, match=r"closest: b"):
        detect_family("<b>{{ y }}", known)
    with pytest.raises(InputError, match="is empty"):
        detect_family(" \n ", known)


def test_a_folder_template_is_read_as_transformers_reads_it(tmp_path):
    qwen = official("qwen3")
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": qwen}]
    assert folder_template(model_folder(tmp_path / "a", qwen))[1] == qwen
    assert folder_template(model_folder(tmp_path / "b", named))[1] == qwen
    jinja = model_folder(tmp_path / "c", "ignored", jinja=qwen)
    assert folder_template(jinja) == (str(jinja / "chat_template.jinja"), qwen)
    assert detect_folder(jinja) == "qwen3"


@pytest.mark.parametrize("template,needle", [
    (None, "has no chat template (no chat_template.jinja, no chat_template in its tokenizer_config.json)"),
    ([{"name": "tool_use", "template": "x"}], "has named chat templates (tool_use) but none called 'default'"),
    (7, "chat_template must be a string or a list of {name, template}, not int"),
])
def test_a_folder_without_a_usable_template_is_one_line(tmp_path, template, needle):
    with pytest.raises(InputError) as caught:
        detect_folder(model_folder(tmp_path, template))
    assert needle in caught.value.one_line()


# --- the commands: one line, exit 2, before the engine or the model -------------------------------------


@pytest.fixture
def nothing_heavy(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("reached the engine or the model")

    monkeypatch.setattr("verbatim.engine.inproc.InprocEngine.start", reached)
    monkeypatch.setattr("verbatim.trainer.reference.load_model", reached)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", reached)


def refused(args: list[str], needle: str) -> str:
    began = time.monotonic()
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output
    assert time.monotonic() - began < 10
    return lines[0]


@pytest.mark.parametrize("command", ["run", "train"])
def test_run_and_train_refuse_a_folder_whose_template_no_renderer_has(tmp_path, nothing_heavy, command):
    edited = official("qwen2_5_instruct").replace("You are Qwen", "You are Bob", 1)
    folder = model_folder(tmp_path / "edited", edited)
    out = tmp_path / "out"
    line = refused([command, "--env", "guess", "--model", str(folder), "--out", str(out)],
                   "tokenizer_config.json is none of the official templates")
    assert "closest: qwen2.5" in line and "--renderer qwen2.5" in line
    refused([command, "--env", "guess", "--model", str(model_folder(tmp_path / "none")), "--out", str(out)],
            "has no chat template")
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "train"])
def test_run_and_train_take_the_renderer_a_folder_template_names(tmp_path, nothing_heavy, monkeypatch, command):
    chosen = []

    def get_renderer(name, *args, **kwargs):
        chosen.append(name)
        raise InputError("stop here")

    monkeypatch.setattr("verbatim.renderers.registry.get_renderer", get_renderer)
    folder = model_folder(tmp_path / "m", crlf_and_trailing_spaces(official("qwen3_instruct_2507")))
    args = [command, "--env", "guess", "--model", str(folder), "--out", str(tmp_path / "out")]
    refused(args, "stop here")
    refused([*args, "--renderer", "qwen2.5"], "stop here")  # --renderer wins over the template
    assert chosen == ["qwen3-instruct-2507", "qwen2.5"]


def test_generate_refuses_a_folder_without_a_chat_template_before_the_engine(tmp_path, nothing_heavy):
    refused(["generate", "--model", str(model_folder(tmp_path))], "has no chat template")
