"""Qwen3.6 (and Qwen3.5): Qwen's ChatML with XML tool calls, trimmed content and an opened think block.

Differences from Qwen3 that matter for tokens: every message's content is
trimmed; the tool list comes before the system prompt and asks for
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>…`` calls
(a string value as it is, others through ``tojson``); every assistant turn after
the last user query gets a think block, empty if need be; the generation prompt
already opens it (``<|im_start|>assistant\\n<think>\\n``), so a completion starts
inside the reasoning. Earlier turns lose their reasoning on re-render
(``reasoning_stripped``); ``keep_reasoning=True`` keeps it everywhere, which is
the template's own ``preserve_thinking`` kwarg, so that mode is checked against
the template as well. The template refuses a conversation with no user query, a
system message after the first, and unknown roles; so does ``render``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message, ToolCall
from verbatim.errors import RenderError
from verbatim.renderers.base import PREAMBLE, Piece
from verbatim.renderers.chatml import IM_END, IM_START
from verbatim.renderers.completion import extract_tagged, loose_value, split_think, tojson
from verbatim.renderers.qwen3 import QwenThinking, reasoning_and_content

TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_RULES = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)
CALL = re.compile(r"\s*<function=([^>\n]+)>\n(.*)</function>\s*", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n?", re.DOTALL)


def xml_call(call: ToolCall) -> str:
    """One call as the template writes it."""
    parameters = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else tojson(value)}\n</parameter>\n"
                         for key, value in call.arguments.items())
    return f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>"


class Qwen36(QwenThinking):
    name = "qwen3.6"
    templates = ("qwen3_6.jinja",)
    end_tokens = ((248046, IM_END), (248044, "<|endoftext|>"))  # Qwen/Qwen3.6-27B generation_config.json

    def template_kwargs(self) -> dict[str, Any]:
        return {**({"preserve_thinking": True} if self.keep_reasoning else {}),
                **({} if self.enable_thinking else {"enable_thinking": False})}

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("<think>\n" if self.enable_thinking else "<think>\n\n</think>\n\n")

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        self._check(messages)
        last_query = last_query_index(messages)
        out = [self.system_piece(messages, tools)]
        for i, message in enumerate(messages):
            if message.role != "system":
                out.append(Piece(self.turn_text(messages, i, last_query, has_previous=i > 0), i))
        if add_generation_prompt:
            out.append(Piece(self.generation_prompt(), len(messages)))
        return out

    def _check(self, messages: list[Message]) -> None:
        for i, message in enumerate(messages):
            if message.role not in ("system", "user", "assistant", "tool"):
                raise RenderError(f"{self.name}: the template has no role {message.role!r}")
            if message.role == "system" and i > 0:
                raise RenderError(f"{self.name}: the template takes a system message only at the beginning")
        if last_query_index(messages) is None:
            raise RenderError(f"{self.name}: the template needs a user query (a user message that is not "
                              "wrapped tool output)")

    def system_piece(self, messages: list[Message], tools: list[dict] | None) -> Piece:
        system = messages[0].content.strip() if messages[0].role == "system" else None
        owner = 0 if system is not None else PREAMBLE
        if tools:
            listed = TOOLS_INTRO + "".join("\n" + tojson(tool) for tool in tools) + TOOLS_RULES
            return Piece(f"{IM_START}system\n{listed}" + (f"\n\n{system}" if system else "") + f"{IM_END}\n", owner)
        return Piece(f"{IM_START}system\n{system}{IM_END}\n" if system is not None else "", owner)

    def turn_text(self, messages: list[Message], i: int, last_query: int, *, has_previous: bool) -> str:
        """Message ``i``; ``has_previous``: a message precedes it (the template opens no user turn for a first tool)."""
        message = messages[i]
        if message.role == "assistant":
            return self.assistant_text(message, thinking=self.keep_reasoning or i > last_query)
        if message.role == "tool":
            opener = f"{IM_START}user" if has_previous and messages[i - 1].role != "tool" else ""
            last = i == len(messages) - 1 or messages[i + 1].role != "tool"
            return f"{opener}\n<tool_response>\n{message.content.strip()}\n</tool_response>" + (
                f"{IM_END}\n" if last else "")
        return f"{IM_START}user\n{message.content.strip()}{IM_END}\n"

    def assistant_text(self, message: Message, *, thinking: bool) -> str:
        trimmed = message.model_copy(update={"content": message.content.strip()})
        reasoning, content = reasoning_and_content(trimmed)
        text = f"{IM_START}assistant\n" + (f"<think>\n{reasoning.strip()}\n</think>\n\n" if thinking else "") + content
        for n, call in enumerate(message.tool_calls):
            text += ("\n\n" if content.strip() else "") if n == 0 else "\n"
            text += xml_call(call)
        return text + f"{IM_END}\n"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        after = [Message(role="assistant")] + new_messages  # the history ends with an assistant turn
        out = [Piece(self.turn_text(after, i, len(after), has_previous=True)) for i in range(1, len(after))]
        return out + [Piece(self.generation_prompt())]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text, opened=self.enable_thinking)
        if reasoning is not None:
            reasoning, rest = reasoning.strip(), rest.lstrip("\n")
        content, calls, call_problems = parse_xml_calls(rest)
        problems += call_problems
        if not finished:
            problems.append("completion ended without <|im_end|> (cut by max tokens?)")
        return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=tuple(calls),
                       problems=tuple(problems))


def last_query_index(messages: list[Message]) -> int | None:
    """The last user message that is not wrapped tool output (compared trimmed), or None."""
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].content.strip()
        wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[index].role == "user" and not wrapped:
            return index
    return None


def parse_xml_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Content, tool calls and problems for ``<tool_call>\\n<function=…>…</function>\\n</tool_call>`` blocks."""
    content, bodies, problems = extract_tagged(text, "<tool_call>", "</tool_call>")
    calls = []
    for body in bodies:
        match = CALL.fullmatch(body)
        inner = match.group(2) if match else ""
        if match is None or PARAMETER.sub("", inner).strip():
            problems.append(f"malformed tool call (expected <function=…> and <parameter=…> blocks): {body[:80]!r}")
            continue
        arguments = {key: loose_value(value) for key, value in PARAMETER.findall(inner)}
        calls.append(ToolCall(name=match.group(1), arguments=arguments, raw=f"<tool_call>{body}</tool_call>"))
    return (content.rstrip("\n") if bodies else content), calls, problems
