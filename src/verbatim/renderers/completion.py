"""Reading a sampled completion's text back into a :class:`Message`.

Pure string functions the families share: think blocks, JSON tool calls, and
the JSON that templates write (``tojson``, as transformers defines it).
Nothing here raises on model output: what is wrong becomes a *problem* string.
"""

from __future__ import annotations

import json
from typing import Any

from verbatim.datamodel import ToolCall


def tojson(value: Any, indent: int | None = None) -> str:
    """JSON exactly as the chat templates' ``tojson`` filter writes it in transformers."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def arguments_json(call: ToolCall, *, as_given: bool) -> str:
    """A call's arguments as the JSON text a family's template writes.

    Arguments that came as a string (``ToolCall.arguments_text``) are written unchanged where the template
    writes a string as it is (``as_given``: Qwen3, DeepSeek) and wherever they are not a JSON object (there is
    nothing else to write, and never an error). Templates that put a string through ``tojson`` would write a
    quoted JSON string literal, a call no model of the family was trained on: those get the parsed object.
    """
    text = call.arguments_text
    if text is None:
        return tojson(call.arguments)
    if as_given or not _is_json_object(text):
        return text
    return tojson(call.arguments)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def split_think(text: str, opener: str = "<think>", closer: str = "</think>",
                *, opened: bool = False) -> tuple[str | None, str, list[str]]:
    """``(reasoning, rest, problems)`` for text that may start with a think block.

    ``opened`` says the prompt already wrote the opener (e.g. ``<think>\\n`` in the
    generation prompt), so the completion starts inside the block.
    """
    body = text
    if not opened:
        stripped = body.lstrip()
        if not stripped.startswith(opener):
            return None, text, []
        body = stripped[len(opener):]
    if closer not in body:
        return body, "", [f"unterminated think block: no {closer}"]
    reasoning, rest = body.split(closer, 1)
    return reasoning, rest, []


def close_think(sampled: str, closer: str = "</think>", *, padded: bool = True) -> str:
    """What to append so that a think block cut short reads as the templates write one, then its turn can end.

    ``sampled`` is the text after the opener token (``<think>``) up to the cut, the
    generation prompt's own ``\\n`` included where it wrote one. ``padded`` templates
    (Qwen, DeepSeek-R1) write ``<think>\\n`` + reasoning stripped of newlines +
    ``\\n</think>\\n\\n`` + content; the sampled text is never changed, so this returns
    only what follows it: the closer and its newlines where the block is open, the
    missing newlines after a closer sampled just before the cut, else nothing. Newlines
    the template would have stripped from the sampled reasoning stay (then no further
    one is added). Tight templates (GLM-4.5, DeepSeek-V3.1) write ``<think>reasoning</think>``
    and nothing after it for empty content: the closer alone, unless it was sampled.
    """
    if not padded:
        return "" if closer in sampled else closer
    if closer in sampled:
        rest = sampled.split(closer, 1)[1]
        return "\n\n"[len(rest):] if "\n\n".startswith(rest) else ""
    whole = "\n" + sampled.strip("\n") + "\n" + closer + "\n\n"
    if whole.startswith(sampled):
        return whole[len(sampled):]
    return ("" if sampled.endswith("\n") else "\n") + closer + "\n\n"


def parse_json_call(raw: str, *, args_key: str = "arguments",
                    call_id: str | None = None) -> tuple[ToolCall | None, str | None]:
    """A tool call written as a JSON object ``{"name": ..., args_key: {...}}``, or a problem."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return None, f"malformed tool call (invalid JSON: {exc.msg} at char {exc.pos}): {raw[:80]!r}"
    return tool_call_from_object(value, raw, args_key=args_key, call_id=call_id)


def tool_call_from_object(value: Any, raw: str, *, args_key: str = "arguments",
                          call_id: str | None = None) -> tuple[ToolCall | None, str | None]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, f"malformed tool call (no string 'name'): {raw[:80]!r}"
    arguments = value.get(args_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f"malformed tool call (arguments are not JSON): {raw[:80]!r}"
    if not isinstance(arguments, dict):
        return None, f"malformed tool call ({args_key!r} is not an object): {raw[:80]!r}"
    found_id = value.get("id", call_id)
    return ToolCall(name=value["name"], arguments=arguments, id=found_id if isinstance(found_id, str) else None,
                    raw=raw), None


def parse_json_arguments(name: str, raw_arguments: str, raw: str,
                         call_id: str | None = None) -> tuple[ToolCall | None, str | None]:
    """A tool call whose name is known and whose arguments are a JSON object in ``raw_arguments``."""
    try:
        arguments = json.loads(raw_arguments)
    except json.JSONDecodeError as exc:
        return None, f"malformed tool call {name!r} (arguments: {exc.msg} at char {exc.pos}): {raw[:80]!r}"
    if not isinstance(arguments, dict):
        return None, f"malformed tool call {name!r} (arguments are not an object): {raw[:80]!r}"
    return ToolCall(name=name, arguments=arguments, id=call_id, raw=raw), None


def extract_tagged(text: str, opener: str, closer: str) -> tuple[str, list[str], list[str]]:
    """``(text outside the tags, bodies inside, problems)`` for ``opener…closer`` blocks."""
    outside, bodies, problems = [], [], []
    rest = text
    while opener in rest:
        before, after = rest.split(opener, 1)
        outside.append(before)
        if closer not in after:
            problems.append(f"malformed tool call (no {closer}): {after[:80]!r}")
            bodies.append(None)
            rest = ""
            break
        body, rest = after.split(closer, 1)
        bodies.append(body)
    outside.append(rest)
    return "".join(outside), [b for b in bodies if b is not None], problems


def loose_value(text: str) -> Any:
    """An argument value from an XML-style tool call (Qwen3.6 ``<parameter=…>``, GLM ``<arg_value>``).

    Those templates write a string value as it is and any other value through ``tojson``, so text that
    reads as JSON other than a string is that value and the rest is a string. Without the tool's schema a
    string that spells JSON (``"2"``, ``"true"``) cannot be told from the number or boolean: it reads as those.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) else value
