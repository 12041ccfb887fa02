"""Tool-call arguments as JSON strings (OpenAI's wire format): kept as given, rendered as the template does."""

from __future__ import annotations

from pathlib import Path

import pytest

from verbatim.renderers.conversations import message_from_dict
from verbatim.renderers.registry import FAMILIES, get_renderer

COMPACT = '{"city":"Paris","days":2}'  # tojson would write {"city": "Paris", "days": 2}
MALFORMED = '{"city": "Par'
AS_GIVEN = [(name, template) for name in ("qwen3", "qwen3-instruct-2507", "deepseek-v3", "deepseek-r1", "deepseek-v3.1")
            for template in FAMILIES[name].load().templates]
"""Families whose official templates write a string ``arguments`` unchanged (the others put it through tojson)."""
PARSED = ["qwen2.5", "llama3", "mistral-v3", "mistral-v7-tekken", "gpt-oss", "qwq", "kimi-k2", "mistral-nemo"]


def wire(arguments: str, content: str | None = "") -> list[dict]:
    call = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "Thanks."}]


def test_a_string_is_kept_exactly_and_a_malformed_one_is_a_problem() -> None:
    good = message_from_dict(wire(COMPACT)[1])
    assert good.tool_calls[0].arguments_text == COMPACT and good.tool_calls[0].arguments == {"city": "Paris", "days": 2}
    assert good.problems == ()
    bad = message_from_dict(wire(MALFORMED)[1])  # used to raise JSONDecodeError
    assert bad.tool_calls[0].arguments_text == MALFORMED and bad.tool_calls[0].arguments == {}
    assert len(bad.problems) == 1 and "'get_weather'" in bad.problems[0] and "not valid JSON" in bad.problems[0]
    listed = message_from_dict({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]})
    assert "not a JSON object" in listed.problems[0]


@pytest.mark.parametrize(("family", "template"), AS_GIVEN, ids=[f"{f}:{t}" for f, t in AS_GIVEN])
@pytest.mark.parametrize("arguments", [COMPACT, MALFORMED], ids=["compact", "malformed"])
def test_string_arguments_render_as_the_official_template(family: str, template: str, arguments: str,
                                                          default_model_dir: Path, chat_templates_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    conversation = wire(arguments, None if family.startswith("deepseek") else "")  # as each template expects
    messages = [message_from_dict(m) for m in conversation]
    for generation in (False, True):
        expected = renderer.tokenizer.apply_chat_template(
            conversation, chat_template=(chat_templates_dir / template).read_text(encoding="utf-8"),
            add_generation_prompt=generation, tokenize=True, return_dict=False, **renderer.template_kwargs())
        ours = renderer.render(messages, add_generation_prompt=generation).token_ids
        assert list(ours) == list(expected), renderer.tokenizer.decode(ours)
    assert arguments in renderer.tokenizer.decode(ours)


@pytest.mark.parametrize("family", PARSED)
def test_tojson_families_write_the_parsed_object_and_never_fail(family: str, default_model_dir: Path) -> None:
    """These templates would write a string through tojson, as a quoted string literal: they get the object."""
    renderer = get_renderer(family, model_dir=default_model_dir)
    as_dict = [message_from_dict(m) for m in wire('{"city": "Paris", "days": 2}')]
    as_dict[1] = as_dict[1].model_copy(update={"tool_calls": tuple(
        c.model_copy(update={"arguments_text": None}) for c in as_dict[1].tool_calls)})
    compact = [message_from_dict(m) for m in wire(COMPACT)]
    assert renderer.render(compact, add_generation_prompt=True) == renderer.render(as_dict, add_generation_prompt=True)
    malformed = renderer.render([message_from_dict(m) for m in wire(MALFORMED)], add_generation_prompt=True)
    assert MALFORMED in renderer.tokenizer.decode(malformed.token_ids)  # written as given, no exception
