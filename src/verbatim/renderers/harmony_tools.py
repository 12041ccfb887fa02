"""gpt-oss tool schemas as the official template writes them: a TypeScript-like ``namespace functions``.

The template's ``render_typescript_type`` macro is reproduced quirk for quirk, since a model
sees exactly its text:

- a nested object's properties are written inline, each type after ``": "`` and the
  16 spaces of indentation that the macro's source line carries (``name: \\n<16 spaces>string``);
  descriptions and defaults below the top level are not written;
- an array of anything but string/number/integer/boolean items is ``T[]`` for the item's own
  type ``T``, or ``any[]`` when ``T`` is longer than 50 characters or is ``object | object``;
- ``oneOf`` is written variant by variant (``A// description | \\nB<20 spaces>// default: 3``).
  The macro meant to write ``any`` for a union with an object variant, but its flag is set
  inside a loop, where Jinja scopes it away: the union is always written out, and so it is here;
- ``anyOf`` is not read: such a property is ``any``;
- at the top level, a default is written with ``tojson`` (``, // default: "x"``), except beside an
  ``enum`` (``, // default: x``) or a ``oneOf`` (``// default: x``, no comma), where the template
  concatenates it as text: a default that is not a string there makes the template fail, and
  :class:`RenderError` here.
"""

from __future__ import annotations

from typing import Any

from verbatim.errors import RenderError
from verbatim.renderers.completion import tojson

PROPERTY_INDENT = "\n" + " " * 16  # gpt_oss.jinja: the line that writes a nested property's type
VARIANT_INDENT = " " * 20  # gpt_oss.jinja: the line that writes a oneOf variant's default
SCALARS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean"}


def _text(value: Any, where: str) -> str:
    """A value the template joins with ``+``: Jinja refuses anything but a string there."""
    if not isinstance(value, str):
        raise RenderError(f"gpt-oss: the template writes {where} as text, and {value!r} is not a string")
    return value


def typescript_type(spec: dict) -> str:
    """A JSON-schema property as the template's ``render_typescript_type`` writes it."""
    kind = spec.get("type")
    if kind == "array":
        return _array_type(spec)
    if isinstance(kind, list | tuple) and kind:
        return " | ".join(map(str, kind)) if len(kind) > 1 else str(kind[0])
    if spec.get("oneOf"):
        return _one_of_type(spec["oneOf"])
    if kind == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(map(str, spec["enum"])) + '"'
        return "string" + (" | null" if spec.get("nullable") else "")
    if kind == "object":
        return _object_type(spec)
    return SCALARS.get(kind, "any") if isinstance(kind, str) else "any"


def _array_type(spec: dict) -> str:
    items = spec.get("items")
    if not items or not isinstance(items, dict):  # the template reads no type from a list of item schemas
        text = "any[]"
    elif isinstance(items.get("type"), str) and items["type"] in SCALARS:
        text = SCALARS[items["type"]] + "[]"
    else:
        inner = typescript_type(items)
        text = "any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]"
    return text + (" | null" if spec.get("nullable") else "")


def _one_of_type(variants: list[dict]) -> str:
    parts = []
    for variant in variants:
        text = typescript_type(variant)
        if variant.get("description"):
            text += "// " + _text(variant["description"], "a oneOf variant's description")
        if "default" in variant:
            text += VARIANT_INDENT + "// default: " + tojson(variant["default"])
        parts.append(text)
    return " | \n".join(parts)


def _object_type(spec: dict) -> str:
    properties = spec.get("properties")
    if not properties:
        return "object"
    required = spec.get("required") or []
    fields = [name + ("" if name in required else "?") + ": " + PROPERTY_INDENT + typescript_type(inner)
              for name, inner in properties.items()]
    return "{\n" + ", ".join(fields) + "}"


def parameter_line(name: str, spec: dict, required: list) -> str:
    """One top-level parameter: its description comment, ``name?: type`` and its default."""
    text = "// " + _text(spec["description"], "a parameter's description") + "\n" if spec.get("description") else ""
    text += name + ("" if name in required else "?") + ": " + typescript_type(spec)
    if "default" in spec:
        if spec.get("enum"):
            text += ", // default: " + _text(spec["default"], f"the default of enum {name!r}")
        elif spec.get("oneOf"):
            text += "// default: " + _text(spec["default"], f"the default of oneOf {name!r}")
        else:
            text += ", // default: " + tojson(spec["default"])
    return text + ",\n"


def tool_namespace(tools: list[dict]) -> str:
    """The ``## functions`` section of the developer message."""
    text = "## functions\n\nnamespace functions {\n\n"
    for tool in tools:
        function = tool["function"]
        text += "// " + _text(function.get("description"), "a tool's description") + "\n"
        text += "type " + _text(function.get("name"), "a tool's name") + " = "
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") or {}
        if not properties:
            text += "() => any;\n\n"
            continue
        required = parameters.get("required") or []
        text += "(_: {\n" + "".join(parameter_line(name, spec, required) for name, spec in properties.items())
        text += "}) => any;\n\n"
    return text + "} // namespace functions"
