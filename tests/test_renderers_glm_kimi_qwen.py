"""Family behaviour of Qwen3.6, QwQ, GLM-4.5 and Kimi K2 beyond the shared renderer tests.

GLM-4.5 ends a reply with the token that opens the next turn; Qwen3.6's and GLM's
options are the templates' own kwargs; XML tool-call values come back typed; Kimi
numbers its calls by position.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verbatim.datamodel import Message, ToolCall
from verbatim.errors import RenderError
from verbatim.renderers.conversations import load_conversations
from verbatim.renderers.registry import get_renderer
from verbatim.renderers.replay import replay

CORPUS = Path(__file__).parent / "data" / "conversations.jsonl"
USER = Message(role="user", content="Weather in Paris?")
CALL = ToolCall(name="get_weather", arguments={"city": "Paris", "days": 2, "units": ["C"], "alerts": True, "n": "7"})


def conversation(note: str) -> tuple[list[Message], list[dict] | None]:
    found = next(c for c in load_conversations(CORPUS) if c.note == note)
    return found.as_messages(), list(found.tools) if found.tools else None


def official(renderer, messages: list[Message], tools=None, *, generation: bool, **kwargs) -> list[int]:
    from verbatim.paths import chat_templates_dir

    template = (chat_templates_dir() / renderer.templates[0]).read_text(encoding="utf-8")
    return list(renderer.tokenizer.apply_chat_template(
        renderer.template_messages(messages), tools=tools, chat_template=template, add_generation_prompt=generation,
        tokenize=True, return_dict=False, **{**renderer.template_kwargs(), **kwargs}))


def test_glm_end_tokens_open_the_next_turn_and_are_not_written_twice(default_model_dir: Path) -> None:
    glm = get_renderer("glm-4.5", model_dir=default_model_dir)
    end_text, user, observation = glm.stop_token_ids
    prompt = list(glm.render([USER], add_generation_prompt=True).token_ids)
    reply = glm.encode("\n<think>look</think>\nSunny.")
    for end in (end_text, user, observation):
        parsed = glm.parse_completion(reply + [end])
        assert (parsed.reasoning, parsed.content, parsed.problems) == ("look", "Sunny.", ())
    follow = [Message(role="user", content="And tomorrow?")]
    answered = [USER, Message(role="assistant", content="Sunny.")] + follow
    reply = glm.encode("\n<think></think>\nSunny.")  # the template keeps no reasoning before the last user turn
    assert prompt + reply + [user] + glm.bridge(prompt + reply + [user], follow) == official(
        glm, answered, generation=True)  # <|user|> sampled: the bridge starts with its "\n"
    assert glm.bridge(prompt + reply + [end_text], follow)[0] == user  # any other end: the opener in full
    assert glm.bridge(prompt + reply, follow)[0] == user  # a cut reply likewise
    called = [USER, Message(role="assistant", tool_calls=(CALL,)), Message(role="tool", content="sunny")]
    ids = replay(glm, called)
    assert ids[len(prompt):].count(observation) == 1  # sampled once, not repeated by the bridge
    assert ids == official(glm, called, generation=True)


@pytest.mark.parametrize("name", ["qwen3.6", "glm-4.5"])
def test_xml_tool_call_values_come_back_typed(name: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir)
    ids = renderer.completion_ids([USER, Message(role="assistant", content="Checking.", tool_calls=(CALL,))], 1)
    parsed = renderer.parse_completion(ids)
    assert parsed.problems == () and parsed.content == "Checking."
    # a string that reads as JSON ("7") cannot be told from the number without the tool's schema
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", {**CALL.arguments, "n": 7})]


def test_qwen36_keep_reasoning_is_the_templates_preserve_thinking(default_model_dir: Path) -> None:
    qwen = get_renderer("qwen3.6", model_dir=default_model_dir, keep_reasoning=True)
    assert qwen.template_kwargs() == {"preserve_thinking": True}
    messages, _ = conversation("reasoning with long conversation")
    assert list(qwen.render(messages, add_generation_prompt=False).token_ids) == official(
        qwen, messages, generation=False)
    prompt = messages[:-1]  # ends with a user message
    history = replay(qwen, prompt)  # every reply as sampled, reasoning included
    assert history == official(qwen, prompt, generation=True)  # append-only equals the template's render
    plain = get_renderer("qwen3.6", model_dir=default_model_dir)
    assert replay(plain, prompt) != official(plain, prompt, generation=True)


@pytest.mark.parametrize(("name", "suffix"), [("qwen3.6", "<think>\n\n</think>\n\n"), ("glm-4.5", "\n<think></think>")])
def test_enable_thinking_false_matches_the_template(name: str, suffix: str, default_model_dir: Path) -> None:
    renderer = get_renderer(name, model_dir=default_model_dir, enable_thinking=False)
    messages, tools = conversation("tools defined, multi turn")
    for generation in (False, True):
        ours = list(renderer.render(messages, tools=tools, add_generation_prompt=generation).token_ids)
        assert ours == official(renderer, messages, tools, generation=generation)
    assert renderer.tokenizer.decode(ours).endswith(suffix)
    prompt = messages[:4]
    held = replay(renderer, prompt[:3], tools=tools)
    added = renderer.bridge(held, prompt[3:])
    assert official(renderer, prompt, tools, generation=True)[-len(added):] == added  # GLM: "/nothink" too


def test_qwen36_refuses_what_its_template_refuses(default_model_dir: Path) -> None:
    qwen = get_renderer("qwen3.6", model_dir=default_model_dir)
    system = Message(role="system", content="Be brief.")
    for messages in ([system, Message(role="assistant", content="Hi.")],  # no user query
                     [USER, Message(role="assistant", content="Hi."), system]):  # system after the first
        with pytest.raises(Exception, match="user query|beginning"):
            official(qwen, messages, generation=True)
        with pytest.raises(RenderError):
            qwen.render(messages, add_generation_prompt=True)


def test_kimi_numbers_calls_by_position_and_keeps_the_models_ids(default_model_dir: Path) -> None:
    kimi = get_renderer("kimi-k2", model_dir=default_model_dir)
    two = Message(role="assistant", tool_calls=(CALL, CALL.model_copy(update={"id": "ignored"})))
    text = kimi.tokenizer.decode(kimi.completion_ids([USER, two], 1))
    assert "functions.get_weather:0<|tool_call_argument_begin|>" in text and "functions.get_weather:1" in text
    parsed = kimi.parse_completion(kimi.encode(text.replace(":1<", ":7<")))
    assert [c.id for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.get_weather:7"]
    result = Message(role="tool", content="sunny", tool_call_id="functions.get_weather:0")
    assert kimi.tokenizer.decode(kimi.bridge(kimi.encode(text), [result])).startswith(
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\\nsunny<|im_end|>")  # a literal \n


def test_qwq_reasoning_lives_only_in_the_sampled_history(default_model_dir: Path) -> None:
    qwq = get_renderer("qwq", model_dir=default_model_dir)
    messages, _ = conversation("reasoning, multi turn")
    history = qwq.tokenizer.decode(replay(qwq, messages[:4]))
    assert "<think>\n12*12 = 144." in history  # the prompt's <think>\n, then the reasoning as sampled
    assert "12*12 = 144" not in qwq.tokenizer.decode(official(qwq, messages[:4], generation=True))
