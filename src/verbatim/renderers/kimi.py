"""Kimi K2 Instruct: ``<|im_system|>``/``<|im_user|>``/``<|im_assistant|>`` turns with ``<|im_middle|>``.

Each turn is ``<|im_ROLE|>role<|im_middle|>content<|im_end|>`` with nothing between
turns; tool results are ``<|im_system|>tool<|im_middle|>## Return of ID\\nRESULT``,
where ``\\n`` is a literal backslash and ``n`` (the template writes it outside an
expression). The template declares tools first (``tool_declare``, the list through
``tojson``), injects "You are a helpful assistant" when the first message is not a
system message, and writes calls as ``<|tool_calls_section_begin|><|tool_call_begin|>
functions.NAME:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>…<|tool_calls_section_end|>``
with ``I`` the call's position in its turn (the model's own id is not kept).
Prefix-stable, as long as the model writes its calls that way.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message
from verbatim.renderers.base import ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, parse_json_arguments, tojson

END, MIDDLE = "<|im_end|>", "<|im_middle|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
HEADERS = {"system": "<|im_system|>system", "user": "<|im_user|>user", "assistant": "<|im_assistant|>assistant",
           "tool": "<|im_system|>tool"}


class KimiK2(ChatFormat):
    name = "kimi-k2"
    templates = ("kimi_k2_instruct.jinja",)
    prefix_stable = True
    end_tokens = ((163586, END),)  # moonshotai/Kimi-K2-Instruct generation_config.json: eos_token_id 163586
    close_text = END
    markup = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS, CALL_END)
    default_system = "You are a helpful assistant"

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = [Piece(f"<|im_system|>tool_declare{MIDDLE}{tojson(tools)}{END}")] if tools else []
        if messages[0].role != "system":
            out.append(Piece(f"{HEADERS['system']}{MIDDLE}{self.default_system}{END}"))
        out += [Piece(self.turn_text(m), i) for i, m in enumerate(messages)]
        if add_generation_prompt:
            out.append(Piece(self.generation_prompt(), len(messages)))
        return out

    def generation_prompt(self) -> str:
        return f"{HEADERS['assistant']}{MIDDLE}"

    def turn_text(self, message: Message) -> str:
        header = HEADERS[message.role] + MIDDLE if message.role in HEADERS else ""
        if message.role == "assistant" and message.tool_calls:
            calls = "".join(f"{CALL_BEGIN}functions.{call.name}:{n}{ARGUMENTS}{arguments_json(call, as_given=False)}"
                            f"{CALL_END}" for n, call in enumerate(message.tool_calls))
            return f"{header}{message.content}{SECTION_BEGIN}{calls}{SECTION_END}{END}"
        if message.role == "tool":
            return f"{header}## Return of {message.tool_call_id or ''}\\n{message.content}{END}"
        return f"{header}{message.content}{END}"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        return [Piece(self.turn_text(m)) for m in new_messages] + [Piece(self.generation_prompt())]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        content, calls, problems = parse_calls(text)
        if not finished:
            problems.append(f"completion ended without {END} (cut by max tokens?)")
        return Message(role="assistant", content=content, tool_calls=tuple(calls), problems=tuple(problems))


def parse_calls(text: str) -> tuple[str, list, list[str]]:
    """Content, tool calls and problems for a reply that may hold a ``<|tool_calls_section_begin|>`` section."""
    if SECTION_BEGIN not in text:
        return text, [], []
    content, section = text.split(SECTION_BEGIN, 1)
    calls, problems = [], []
    for block in section.split(SECTION_END, 1)[0].split(CALL_BEGIN)[1:]:
        if CALL_END not in block or ARGUMENTS not in block:
            problems.append(f"malformed tool call: {block[:80]!r}")
            continue
        body = block.split(CALL_END, 1)[0]
        call_id, arguments = body.split(ARGUMENTS, 1)
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        call, problem = parse_json_arguments(name, arguments, CALL_BEGIN + body + CALL_END, call_id=call_id)
        calls.append(call) if call is not None else problems.append(problem)
    return content, calls, problems
