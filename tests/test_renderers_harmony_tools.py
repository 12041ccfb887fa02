"""gpt-oss tool schemas (nested objects, arrays of objects, oneOf, enum defaults) render as the official template."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from verbatim.errors import RenderError
from verbatim.renderers.conversations import message_from_dict
from verbatim.renderers.registry import get_renderer


def tool(name: str, properties: dict, required: tuple[str, ...] = (), description: str = "Does it.") -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


ADDRESS = {"type": "object", "description": "where (not written: nested)",
           "properties": {"city": {"type": "string", "description": "not written either"}}, "required": ["city"]}
PROBES = {
    "nested_objects": [tool("book", {
        "guest": {"type": "object", "description": "who stays",
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "address": ADDRESS},
                  "required": ["name"]},
        "extras": {"type": "object"}}, ("guest",))],
    "arrays_of_objects": [tool("order", {
        "lines": {"type": "array", "description": "order lines",
                  "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                            "required": ["sku"]}},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        "pairs": {"type": "array", "items": {"type": ["object", "object"]}},
        "either": {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "number"}]}},
        "maybe": {"type": "array", "items": {"type": "string"}, "nullable": True}})],
    "one_of_any_of": [tool("pick", {
        "value": {"description": "a value", "oneOf": [{"type": "string", "description": "as text"},
                                                      {"type": "integer", "default": 3}]},
        "shape": {"oneOf": [{"type": "object", "properties": {"side": {"type": "number"}}}, {"type": "string"}]},
        "unit": {"oneOf": [{"type": "string"}, {"type": "number"}], "default": "cm"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "anyOf is not read"},
        "kind": {"type": ["string", "null"]}}), tool("ping", {})],
    "enum_defaults": [tool("configure", {
        "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast", "description": "speed"},
        "level": {"type": "integer", "enum": [1, 2], "default": "1"},
        "deep": {"type": "object", "description": "nested enum", "properties": {"inner": {
            "type": "object", "properties": {"leaf": {"type": "string", "enum": ["a", "b"], "default": "a"}}}}},
        "verbose": {"type": "boolean", "default": False},
        "label": {"type": "string", "default": 'say "hi"'},
        "limits": {"type": "object", "default": {"max": 1}}}, ("deep",))],
}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "pick", "arguments": {"value": "x"}}}]}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}, CALL,
                {"role": "tool", "content": "done"}, {"role": "assistant", "content": "Done."}]


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.utils.chat_template_utils as chat_utils

    class FrozenClock(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return dt.datetime(2024, 7, 26, 12, 0, 0)

    monkeypatch.setattr(chat_utils, "datetime", FrozenClock)


@pytest.fixture(scope="module")
def renderer(default_model_dir: Path):
    return get_renderer("gpt-oss", model_dir=default_model_dir)


def template_ids(renderer, conversation: list[dict], tools: list[dict], generation: bool,
                 chat_templates_dir: Path) -> list[int]:
    return list(renderer.tokenizer.apply_chat_template(
        conversation, tools=tools, chat_template=(chat_templates_dir / "gpt_oss.jinja").read_text(encoding="utf-8"),
        add_generation_prompt=generation, tokenize=True, return_dict=False, **renderer.template_kwargs()))


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_tool_schemas_render_as_the_official_template(probe: str, renderer, chat_templates_dir: Path) -> None:
    tools = PROBES[probe]
    for conversation, generation in ((CONVERSATION[:2], True), (CONVERSATION, False)):
        expected = template_ids(renderer, conversation, tools, generation, chat_templates_dir)
        ours = renderer.render([message_from_dict(m) for m in conversation], tools=tools,
                               add_generation_prompt=generation)
        assert list(ours.token_ids) == expected, renderer.tokenizer.decode(ours.token_ids)


@pytest.mark.parametrize("default", [1, None])
def test_a_default_the_template_cannot_concatenate_is_refused(default: object, renderer,
                                                              chat_templates_dir: Path) -> None:
    tools = [tool("f", {"x": {"type": "integer", "enum": [1, 2], "default": default}})]
    with pytest.raises(TypeError, match="concatenate"):
        template_ids(renderer, CONVERSATION[:2], tools, True, chat_templates_dir)
    with pytest.raises(RenderError, match="default of enum 'x'"):
        renderer.render([message_from_dict(m) for m in CONVERSATION[:2]], tools=tools, add_generation_prompt=True)
