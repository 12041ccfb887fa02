"""Qwen3 hybrid-thinking models: Qwen's ChatML plus ``<think>`` blocks.

The official template keeps reasoning only on assistant turns after the last
real user query, and always gives the last such turn a think block (empty if
need be). Re-rendered history therefore loses earlier reasoning, which an
append-only history keeps. ``keep_reasoning=True`` renders every turn's
reasoning, i.e. what ``bridge`` histories look like; ``False`` (the default)
matches the template exactly. ``enable_thinking=False`` appends the empty think
block to the generation prompt, as the template's kwarg does. A reply cut by max
tokens inside ``<think>`` is closed by ``bridge`` as the template writes a turn
whose reasoning ended there: ``\\n</think>\\n\\n<|im_end|>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message
from verbatim.renderers.base import Piece
from verbatim.renderers.chatml import IM_START, QwenChat, hermes_call, parse_hermes_calls
from verbatim.renderers.completion import split_think

NL = "\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


class QwenThinking(QwenChat):
    """What Qwen's thinking formats share: no default system, ``<think>`` blocks that a re-render
    strips from earlier turns, and the two switches ``keep_reasoning`` and ``enable_thinking``."""

    prefix_stable = False  # earlier reasoning is stripped on re-render
    default_system = None
    markup = ("<tool_call>", "</tool_call>", "<think>", "</think>")
    think = ("<think>", "</think>")  # a reply cut while reasoning gets "\n</think>\n\n" before <|im_end|>
    turn_starts = (IM_START,)

    def __init__(self, tokenizer: Any, *, keep_reasoning: bool = False, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.keep_reasoning = keep_reasoning
        self.enable_thinking = enable_thinking


class Qwen3(QwenThinking):
    """Qwen3 (hybrid thinking), verified against the current and the first-release templates."""

    name = "qwen3"
    templates = ("qwen3.jinja", "qwen3_2504_original.jinja")
    arguments_as_given = True

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking else {"enable_thinking": False}

    def tools_system_text(self, system: str | None) -> str:
        return system + "\n\n" if system is not None else ""

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK)

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        self._last_query = last_query_index(messages)
        return super().pieces(messages, tools, add_generation_prompt)

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        self._last_query = len(new_messages)  # bridge never writes assistant turns
        return super().bridge_pieces(previous_ids, new_messages, tools)

    def qwen_message_text(self, messages: list[Message], i: int) -> str:
        message = messages[i]
        if message.role != "assistant":
            return super().qwen_message_text(messages, i)
        reasoning, content = reasoning_and_content(message)
        is_last = i == len(messages) - 1
        if (i > self._last_query and (is_last or reasoning)) or (self.keep_reasoning and reasoning):
            text = f"{IM_START}assistant\n<think>\n{reasoning.strip(NL)}\n</think>\n\n{content.lstrip(NL)}"
        else:
            text = f"{IM_START}assistant\n{content}"
        for n, call in enumerate(message.tool_calls):
            separator = "\n" if (n == 0 and content) or n > 0 else ""
            text += separator + hermes_call(call, as_given=True)
        return text + "<|im_end|>\n"

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text)
        content, calls, call_problems = parse_hermes_calls(rest.lstrip("\n") if reasoning is not None else rest)
        problems += call_problems
        if not finished:
            problems.append("completion ended without <|im_end|> (cut by max tokens?)")
        return Message(role="assistant", content=content,
                       reasoning=reasoning.strip("\n") if reasoning is not None else None,
                       tool_calls=tuple(calls), problems=tuple(problems))


def last_query_index(messages: list[Message]) -> int:
    """Index of the last user message that is a real query (not wrapped tool output), as the template finds it."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        wrapped = message.content.startswith("<tool_response>") and message.content.endswith("</tool_response>")
        if message.role == "user" and not wrapped:
            return index
    return len(messages) - 1


def reasoning_and_content(message: Message) -> tuple[str, str]:
    """The template's split: the ``reasoning`` field, else a ``<think>`` block inside the content."""
    if message.reasoning is not None:
        return message.reasoning, message.content
    content = message.content
    if "</think>" in content:
        head, tail = content.split("</think>", 1)[0], content.split("</think>")[-1]
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), tail.lstrip("\n")
    return "", content
