"""parse_completion: sampled tokens back to a Message; malformed tool calls are problems, never exceptions."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verbatim.datamodel import Message, ToolCall
from verbatim.errors import InputError
from verbatim.renderers.base import Renderer
from verbatim.renderers.registry import FAMILIES, family, get_renderer, renderer_names

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "City"}},
                                                "required": ["city"]}}}
USER = Message(role="user", content="Weather in Paris?")
CALL = ToolCall(name="get_weather", arguments={"city": "Paris", "days": 2}, id="call00001")
REASONING = {"qwen3", "deepseek-r1", "gpt-oss", "qwen3.6", "qwq", "glm-4.5", "deepseek-v3.1-thinking"}
TOOL_CALLS = {"qwen2.5", "qwen3-instruct-2507", "qwen3", "llama3", "mistral-v3", "mistral-v7-tekken",
              "deepseek-v3", "deepseek-r1", "gpt-oss", "qwen3.6", "qwq", "glm-4.5", "kimi-k2", "deepseek-v3.1",
              "deepseek-v3.1-thinking", "mistral-nemo"}
MALFORMED = {
    "qwen2.5": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
    "qwen3": "<think>\nok\n</think>\n\n<tool_call>\n{\"name\": get_weather}\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Par',
    "mistral-v3": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": ]',
    "mistral-v7-tekken": "[TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{\"city\": Paris}",
    "deepseek-v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{oops\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>",
    "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ]',
    "gpt-oss": " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": ",
    "qwen3.6": "ok\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n"
               "</tool_call>",
    "qwq": "ok\n</think>\n\n<tool_call>\n{\"name\": get_weather}\n</tool_call>",
    "glm-4.5": "\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               "{oops<|tool_call_end|><|tool_calls_section_end|>",
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_renderers_follow_the_protocol(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    assert isinstance(renderer, Renderer)
    assert renderer.name == name and renderer.templates
    assert renderer.stop_token_ids and all(isinstance(i, int) for i in renderer.stop_token_ids)
    for stop in renderer.stop_token_ids:  # every stop token is one token of the vocabulary
        assert renderer.encode(renderer.tokenizer.convert_ids_to_tokens(stop)) == [stop]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parse_reads_back_what_the_model_samples(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    reply = Message(role="assistant", content="It is sunny in Paris.",
                    reasoning="Check the forecast." if name in REASONING else None)
    parsed = renderer.parse_completion(renderer.completion_ids([USER, reply], 1))
    assert parsed.content == reply.content and parsed.problems == ()
    assert parsed.reasoning == reply.reasoning
    if name in TOOL_CALLS:
        call = Message(role="assistant", tool_calls=(CALL,))
        parsed = renderer.parse_completion(renderer.completion_ids([USER, call], 1, tools=[WEATHER]))
        assert parsed.problems == ()
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(CALL.name, CALL.arguments)]
        assert parsed.tool_calls[0].raw and "Paris" in parsed.tool_calls[0].raw


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_tool_calls_are_reported_not_raised(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    ids = renderer.encode(MALFORMED[name]) + [renderer.stop_token_ids[-1]]
    parsed = renderer.parse_completion(ids)
    assert parsed.tool_calls == ()
    assert any("malformed tool call" in problem for problem in parsed.problems), parsed.problems


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_cut_reply_is_flagged(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    parsed = renderer.parse_completion(renderer.encode("Once upon a"))
    assert any("without" in problem for problem in parsed.problems)


def test_hermes_tool_call_keeps_the_raw_text(default_model_dir: Path) -> None:
    renderer = get_renderer("smollm2", model_dir=default_model_dir)
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = renderer.parse_completion(renderer.encode(text) + list(renderer.stop_token_ids))
    assert parsed.content == "Checking."
    assert parsed.tool_calls[0].arguments == {"city": "Oslo"}
    assert parsed.tool_calls[0].raw.startswith("<tool_call>") and "Oslo" in parsed.tool_calls[0].raw


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parse_never_raises(name: str, data: st.DataObject, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    size = len(renderer.tokenizer)
    ids = data.draw(st.lists(st.integers(0, size - 1), max_size=30))
    ids += data.draw(st.lists(st.sampled_from(renderer.stop_token_ids), max_size=1))
    assert isinstance(renderer.parse_completion(ids), Message)


def test_unknown_renderer_names_suggest_close_matches() -> None:
    with pytest.raises(InputError, match="unknown renderer 'qwen-3'") as caught:
        family("qwen-3")
    assert "qwen3" in caught.value.one_line()
    assert family("LLAMA3.3").name == "llama3"  # aliases, any case
    assert "gpt-oss" in renderer_names()


def test_options_reach_the_renderer(default_model_dir: Path) -> None:
    llama = get_renderer("llama3", date_string="01 Jan 2030")
    text = llama.tokenizer.decode(llama.render([USER], add_generation_prompt=True).token_ids)
    assert "Today Date: 01 Jan 2030" in text
    qwen3 = get_renderer("qwen3", enable_thinking=False)
    assert qwen3.tokenizer.decode(qwen3.render([USER], add_generation_prompt=True).token_ids).endswith(
        "<think>\n\n</think>\n\n")
    with pytest.raises(InputError, match="default model"):
        get_renderer("smollm2")


def test_renderers_import_no_engine_harness_torch_or_vllm() -> None:
    """Also for the default model's own tokenizer and a stand-in built on it: a ``verbatim run --engine http``
    process loads one of these and nothing else that needs torch, which would add 2.5 s to each start."""
    import subprocess
    import sys

    from verbatim.engine.models import resolve

    code = ("import sys\nfrom verbatim.datamodel import Message\nfrom verbatim.renderers import get_renderer\n"
            "for name in ('qwen3', 'smollm2', 'phi4'):\n"
            "    r = get_renderer(name, model_dir=sys.argv[1])\n"
            "    r.bridge(r.render([Message(role='user', content='hi')], "
            "add_generation_prompt=True).token_ids, [Message(role='user', content='more')])\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm') "
            "or m.startswith(('verbatim.engine', 'verbatim.harness'))]\nprint(bad)")
    result = subprocess.run([sys.executable, "-c", code, str(resolve("default"))], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
