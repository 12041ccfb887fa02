"""DeepSeek V3.1 corners the corpus does not reach: what the template keeps after tool output and around systems."""

from __future__ import annotations

from pathlib import Path

import pytest

from verbatim.datamodel import Message, ToolCall
from verbatim.renderers.registry import get_renderer
from verbatim.renderers.replay import replay

USER = Message(role="user", content="Weather in Paris?")
CALL = Message(role="assistant", tool_calls=(ToolCall(name="get_weather", arguments={"city": "Paris"}, id="c1"),))
RESULT = Message(role="tool", content="sunny", tool_call_id="c1")
THOUGHT = Message(role="assistant", content="plan</think>It is sunny.")
CONVERSATIONS = {
    "after tool output the text is kept whole": [USER, CALL, RESULT, THOUGHT],
    "a system message between user and reply": [USER, Message(role="system", content="Be brief."), THOUGHT],
    "tool output then user": [USER, CALL, RESULT, Message(role="user", content="And Rome?")],
}


def template_ids(renderer, messages: list[Message], chat_templates_dir: Path, generation: bool) -> list[int]:
    return list(renderer.tokenizer.apply_chat_template(
        renderer.template_messages(messages), chat_template=(chat_templates_dir / renderer.templates[0]).read_text(
            encoding="utf-8"), add_generation_prompt=generation, tokenize=True, return_dict=False,
        **renderer.template_kwargs()))


@pytest.mark.parametrize("family", ["deepseek-v3.1", "deepseek-v3.1-thinking"])
@pytest.mark.parametrize("note", sorted(CONVERSATIONS))
def test_render_matches_the_template(family: str, note: str, default_model_dir: Path,
                                     chat_templates_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    messages = CONVERSATIONS[note]
    for generation in (False, True):
        ours = list(renderer.render(messages, add_generation_prompt=generation).token_ids)
        assert ours == template_ids(renderer, messages, chat_templates_dir, generation), renderer.tokenizer.decode(ours)


def test_no_generation_prompt_after_tool_output_and_the_bridge_agrees(default_model_dir: Path,
                                                                      chat_templates_dir: Path) -> None:
    renderer = get_renderer("deepseek-v3.1", model_dir=default_model_dir)
    held = replay(renderer, [USER, CALL, RESULT])
    assert renderer.tokenizer.decode(held[-1:]) == "<｜tool▁output▁end｜>"  # the model goes on from here
    assert held == template_ids(renderer, [USER, CALL, RESULT], chat_templates_dir, True)
    reply = renderer.encode("It is sunny.") + [renderer.stop_token_ids[0]]
    assert renderer.parse_completion(reply).content == "It is sunny."


def test_thinking_reads_the_reasoning_and_keeps_only_the_answer_in_history(default_model_dir: Path) -> None:
    renderer = get_renderer("deepseek-v3.1-thinking", model_dir=default_model_dir)
    prompt = renderer.tokenizer.decode(renderer.render([USER], add_generation_prompt=True).token_ids)
    assert prompt.endswith("<｜Assistant｜><think>")
    sampled = renderer.completion_ids([USER, THOUGHT.model_copy(update={"reasoning": "check"})], 1)
    parsed = renderer.parse_completion(sampled)
    assert (parsed.reasoning, parsed.content) == ("check", "It is sunny.")
    history = renderer.tokenizer.decode(renderer.render([USER, THOUGHT], add_generation_prompt=False).token_ids)
    assert history.endswith("<｜Assistant｜></think>It is sunny.<｜end▁of▁sentence｜>")
