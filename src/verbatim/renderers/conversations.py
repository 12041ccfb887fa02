"""Conversations as data: JSONL files of ``{"messages": [...], "tools": [...]}`` objects.

Messages in files use the Hugging Face chat format (``role``, ``content``,
``reasoning_content``, ``tool_calls`` with ``function.name``/``arguments``,
``tool_call_id``). This module converts between that format and
:class:`~verbatim.datamodel.Message`, and reads files with errors that name the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from verbatim.datamodel import Message, ToolCall
from verbatim.errors import InputError

DEFAULT_CONVERSATIONS = Path(__file__).with_name("default_conversations.jsonl")
"""The linter's built-in conversation set."""


class Conversation(BaseModel):
    """One conversation: its messages (as given, HF format) and optional tool definitions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    note: str = ""

    def as_messages(self) -> list[Message]:
        return [message_from_dict(m) for m in self.messages]


def message_from_dict(data: dict[str, Any]) -> Message:
    """A :class:`Message` from an HF-format message dict.

    ``function.arguments`` may be an object or a JSON string (OpenAI's wire format). A string is kept
    exactly as given (``ToolCall.arguments_text``); one that is not a JSON object is a line in
    ``Message.problems``, never an exception.
    """
    calls, problems = [], []
    for call in data.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        text = None
        if isinstance(arguments, str):
            text = arguments
            arguments, problem = arguments_object(text)
            if problem is not None:
                problems.append(f"tool call {function['name']!r}: {problem}")
        calls.append(ToolCall(name=function["name"], arguments=arguments, id=call.get("id"), arguments_text=text))
    reasoning = data.get("reasoning_content", data.get("reasoning", data.get("thinking")))
    return Message(role=data["role"], content=data.get("content") or "", reasoning=reasoning,
                   tool_calls=tuple(calls), tool_call_id=data.get("tool_call_id"), name=data.get("name"),
                   problems=tuple(problems))


def arguments_object(text: str) -> tuple[dict[str, Any], str | None]:
    """The object a JSON arguments string holds, or ``{}`` and a problem."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"arguments are not valid JSON ({exc.msg} at char {exc.pos}): {text[:80]!r}"
    if not isinstance(value, dict):
        return {}, f"arguments are not a JSON object: {text[:80]!r}"
    return value, None


def message_to_dict(message: Message, *, arguments_as_string: bool = False,
                    none_content_with_calls: bool = False, arguments_as_given: bool = False,
                    reasoning_key: str = "reasoning_content") -> dict[str, Any]:
    """The HF-format dict a chat template expects for ``message`` (keys with no value are left out).

    ``arguments_as_given`` passes arguments that came as a string as that string (for templates that
    write a string unchanged); otherwise the template gets the parsed object.
    """
    data: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning is not None:
        data[reasoning_key] = message.reasoning
    if message.tool_calls:
        if none_content_with_calls and not message.content:
            data["content"] = None
        data["tool_calls"] = [_call_to_dict(call, arguments_as_string, arguments_as_given)
                              for call in message.tool_calls]
    if message.tool_call_id is not None:
        data["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        data["name"] = message.name
    return data


def _call_to_dict(call: ToolCall, arguments_as_string: bool, arguments_as_given: bool) -> dict[str, Any]:
    arguments: Any = json.dumps(call.arguments, ensure_ascii=False) if arguments_as_string else call.arguments
    if call.arguments_text is not None and (arguments_as_string or arguments_as_given):
        arguments = call.arguments_text
    data: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": arguments}}
    if call.id is not None:
        data["id"] = call.id
    return data


def parse_conversation(value: Any, where: str) -> Conversation:
    """Validate one decoded JSON value as a conversation; ``where`` names it in errors."""
    if not isinstance(value, dict) or not isinstance(value.get("messages"), list):
        raise InputError(f"{where}: expected an object with a 'messages' list")
    for i, message in enumerate(value["messages"]):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InputError(f"{where}: message {i} needs a string 'role'")
    try:
        return Conversation(**value)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InputError(f"{where}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def load_conversations(path: str | Path) -> list[Conversation]:
    """Read a JSONL file of conversations; a malformed line is an :class:`InputError` naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read conversations file {path}: {exc}") from None
    conversations = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        conversations.append(parse_conversation(value, f"{path}:{number}"))
    if not conversations:
        raise InputError(f"{path} holds no conversations")
    return conversations
