"""Llama 3.1 / 3.2 / 3.3 Instruct: header-delimited turns, tools in the first user message.

Every render starts with a system header that holds the knowledge cut-off and
"Today Date: <date_string>". The date is an option fixed at construction
(default ``"26 Jul 2024"``, the 3.1/3.3 template's constant), never the clock:
Llama 3.2's template reads the clock, so its re-renders drift from day to day.
Content is trimmed; tool results are written as JSON strings; one tool call per
assistant turn, as ``{"name": …, "parameters": …}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, tojson, tool_call_from_object

BOT, EOT, EOM, PYTHON_TAG = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"
TOOLS_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


def header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


class Llama3(ChatFormat):
    name = "llama3"
    templates = ("llama3_1_instruct.jinja", "llama3_3_instruct.jinja", "llama3_2_instruct.jinja")
    prefix_stable = True  # with a fixed date_string; see docs/renderers.md
    # meta-llama/Llama-3.1-8B-Instruct (and 3.2, 3.3) generation_config.json: eos_token_id [128001, 128008, 128009]
    end_tokens = ((128001, "<|end_of_text|>"), (128008, EOM), (128009, EOT))
    close_text = EOT
    markup = (PYTHON_TAG,)  # a bare JSON call has no marker token: it is read by its shape alone

    def __init__(self, tokenizer: Any, *, date_string: str = "26 Jul 2024") -> None:
        super().__init__(tokenizer)
        self.date_string = date_string

    def template_kwargs(self) -> dict[str, Any]:
        return {"date_string": self.date_string}

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        start = 1 if messages[0].role == "system" else 0
        system = messages[0].content.strip() if start else ""
        out = [Piece(BOT), Piece(self.system_text(system, tools), 0 if start else PREAMBLE)]
        if tools:
            if start >= len(messages):
                raise RenderError("llama3: tools go into the first user message, and there is none")
            out.append(Piece(self.tools_turn(messages[start].content, tools), start))
            start += 1
        out += [Piece(self.message_text(messages[i]), i) for i in range(start, len(messages))]
        if add_generation_prompt:
            out.append(Piece(header("assistant"), len(messages)))
        return out

    def system_text(self, system: str, tools: list[dict] | None) -> str:
        environment = "Environment: ipython\n" if tools else ""
        return (header("system") + environment + "Cutting Knowledge Date: December 2023\n"
                f"Today Date: {self.date_string}\n\n" + system + EOT)

    def tools_turn(self, first_user: str, tools: list[dict]) -> str:
        listing = "".join(tojson(tool, indent=4) + "\n\n" for tool in tools)
        return header("user") + TOOLS_PREAMBLE + listing + first_user.strip() + EOT

    def message_text(self, message: Message) -> str:
        if message.role == "tool":
            return header("ipython") + json.dumps(message.content, ensure_ascii=False) + EOT
        if message.tool_calls:
            if len(message.tool_calls) != 1:
                raise RenderError("llama3: the model supports exactly one tool call per assistant turn")
            call = message.tool_calls[0]
            arguments = arguments_json(call, as_given=False)
            return header("assistant") + f'{{"name": "{call.name}", "parameters": {arguments}}}' + EOT
        return header(message.role) + message.content.strip() + EOT

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        return [Piece(self.message_text(m)) for m in new_messages] + [Piece(header("assistant"))]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = [] if finished else ["completion ended without an end token (<|eot_id|>, <|eom_id|>, "
                                        "<|end_of_text|>): cut by max tokens?"]
        body = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
        stripped = body.strip()
        if not stripped.startswith("{"):
            return Message(role="assistant", content=text, problems=tuple(problems))
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            if '"name"' in stripped:
                problems.append(f"malformed tool call (invalid JSON: {exc.msg}): {stripped[:80]!r}")
            return Message(role="assistant", content=text, problems=tuple(problems))
        if not (isinstance(value, dict) and "name" in value and "parameters" in value):
            return Message(role="assistant", content=text, problems=tuple(problems))
        call, problem = tool_call_from_object(value, stripped, args_key="parameters")
        if call is None:
            return Message(role="assistant", content=text, problems=tuple(problems + [problem]))
        return Message(role="assistant", content="", tool_calls=(call,), problems=tuple(problems))
