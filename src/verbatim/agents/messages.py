"""OpenAI chat messages on the agent endpoint: checked, compared with what the rollout recorded, answered.

Pure functions. A request's ``messages`` are brought to one canonical form (:func:`canonical`): role
(``developer`` is a system message), content as one string (text parts joined), tool calls as
``(id, name, arguments string)``, ``tool_call_id``, ``name``, and reasoning where the agent sent it back.
Two messages are the same message when their canonical forms agree; an assistant message the agent sends
back without its reasoning is still the reply verbatim returned (clients drop ``reasoning_content``; the
ledger keeps the sampled tokens either way).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message
from verbatim.renderers.conversations import message_from_dict

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning")


class BadRequest(ValueError):
    """A request body the endpoint cannot read: HTTP 400, an OpenAI-style error naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def canonical(raw: Any, index: int) -> dict[str, Any]:
    """One request message in canonical form; :class:`BadRequest` names what is wrong with it."""
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object", where)
    role = ROLES.get(raw.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {raw.get('role')!r}", f"{where}.role")
    message: dict[str, Any] = {"role": role, "content": _text(raw.get("content"), f"{where}.content")}
    calls = raw.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls")
        message["tool_calls"] = [_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"{where}.{key} must be a string", f"{where}.{key}")
            message[key] = value
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    if isinstance(reasoning, str):
        message["reasoning"] = reasoning
    return message


def canonical_all(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    return [canonical(m, k) for k, m in enumerate(raw)]


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{k}]: only text parts are supported", f"{where}[{k}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string, null or a list of text parts", where)


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} needs function.name", where)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id"), "name": function["name"], "arguments": arguments}


def as_message(message: dict[str, Any]) -> Message:
    """The renderer's :class:`Message` of a canonical message."""
    data = {key: value for key, value in message.items() if key not in ("tool_calls", "reasoning")}
    if message.get("reasoning") is not None:
        data["reasoning_content"] = message["reasoning"]
    if message.get("tool_calls"):
        data["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["name"], "arguments": c["arguments"]}}
                              for c in message["tool_calls"]]
    return message_from_dict(data)


def reply(message: Message, call_ids: Sequence[str]) -> dict[str, Any]:
    """The canonical form of a parsed completion as the endpoint returns it (tool calls get ``call_ids``)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call_id, "name": call.name,
                              "arguments": call.arguments_text if call.arguments_text is not None
                              else json.dumps(call.arguments, ensure_ascii=False)}
                             for call, call_id in zip(message.tool_calls, call_ids)]
    if message.reasoning is not None:
        out["reasoning"] = message.reasoning
    return out


def openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A canonical assistant reply in OpenAI's response schema."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in message["tool_calls"]]
    if message.get("reasoning") is not None:
        out["reasoning_content"] = message["reasoning"]
    return out


def first_difference(recorded: Sequence[dict[str, Any]], incoming: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Where ``incoming`` stops extending ``recorded`` (None where it does): the message's index and role, the
    first field that differs (``dropped`` for messages left out: at the end, or before ones kept as they were)
    and a line saying so."""
    for index, (mine, theirs) in enumerate(zip(recorded, incoming)):
        field = _differing_field(mine, theirs)
        if field is not None:
            gap = _dropped_run(recorded, incoming, index)
            if gap:
                return where_broken(index, mine["role"], "dropped", _dropped_text(recorded, index, gap))
            return where_broken(index, mine["role"], field, f"message {index} ({mine['role']}): {field} differs")
    if len(incoming) < len(recorded):
        index = len(incoming)
        role = recorded[index]["role"]
        return where_broken(index, role, "dropped", f"message {index} ({role}) and after were dropped")
    return None


def _dropped_run(recorded: Sequence[dict[str, Any]], incoming: Sequence[dict[str, Any]], index: int) -> int:
    """How many recorded messages from ``index`` on the agent left out, when what it sent from ``index`` on is
    recorded messages after them, unchanged (0: it changed a message, it did not only drop some)."""
    for gap in range(1, len(recorded) - index):
        kept = list(zip(recorded[index + gap:], incoming[index:]))
        if kept and all(_differing_field(mine, theirs) is None for mine, theirs in kept):
            return gap
    return 0


def _dropped_text(recorded: Sequence[dict[str, Any]], index: int, gap: int) -> str:
    roles = ", ".join(m["role"] for m in recorded[index: index + gap])
    if gap == 1:
        return f"message {index} ({roles}) was dropped"
    return f"messages {index}-{index + gap - 1} ({roles}) were dropped"


def where_broken(index: int | None, role: str | None, field: str, text: str) -> dict[str, Any]:
    return {"message": index, "role": role, "field": field, "what": text}


def _differing_field(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    for field in FIELDS:
        if field == "reasoning" and "reasoning" not in theirs:
            continue  # sent back without its reasoning: still the same reply
        if mine.get(field) != theirs.get(field):
            return field
    return None
