"""The tools of the ``tools`` env: definitions (OpenAI-style JSON schema) and their execution.

``run_tool`` never raises: an unknown tool, a missing or wrong argument, an
unknown unit or item comes back as an ``error: …`` string the model can read.
"""

from __future__ import annotations

import json
import math
from typing import Any

from verbatim.datamodel import ToolCall

UNITS: dict[str, tuple[str, float]] = {
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237),
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0),
}
"""Unit → (dimension, size in the dimension's base unit)."""


def _function(name: str, description: str, **params: tuple[str, str]) -> dict[str, Any]:
    properties = {p: {"type": kind, "description": text} for p, (kind, text) in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(params)}}}


TOOL_DEFINITIONS: tuple[dict[str, Any], ...] = (
    _function("add", "Add two numbers.", a=("number", "first number"), b=("number", "second number")),
    _function("multiply", "Multiply two numbers.", a=("number", "first number"), b=("number", "second number")),
    _function("convert", "Convert a value between units (" + ", ".join(UNITS) + ").",
              value=("number", "the amount"), from_unit=("string", "unit of value"),
              to_unit=("string", "unit wanted")),
    _function("price", "Look up the price of one item in the shop.", item=("string", "item name")),
)

TOOL_SUMMARY = "add(a, b), multiply(a, b), convert(value, from_unit, to_unit), price(item)"


class ToolFailure(Exception):
    """A tool call the model got wrong; its message becomes the tool's answer."""


def run_tool(call: ToolCall, prices: dict[str, float]) -> str:
    """The text a tool answers to ``call``: a number, or ``error: …``."""
    try:
        if call.name == "add":
            return format_number(_number(call, "a") + _number(call, "b"))
        if call.name == "multiply":
            return format_number(_number(call, "a") * _number(call, "b"))
        if call.name == "convert":
            return format_number(convert(_number(call, "value"), _text(call, "from_unit"), _text(call, "to_unit")))
        if call.name == "price":
            return format_number(_price(_text(call, "item"), prices))
        raise ToolFailure(f"unknown tool {call.name!r}; tools: {TOOL_SUMMARY}")
    except ToolFailure as exc:
        return f"error: {exc}"


def _argument(call: ToolCall, key: str) -> Any:
    if key not in call.arguments:
        raise ToolFailure(f"{call.name} needs argument {key!r}")
    return call.arguments[key]


def _number(call: ToolCall, key: str) -> float:
    value = _argument(call, key)
    if isinstance(value, str):
        try:
            value = float(value.replace(",", ""))
        except ValueError:
            raise ToolFailure(f"{call.name}: {key} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ToolFailure(f"{call.name}: {key} must be a number, got {json.dumps(value)[:40]}")
    return float(value)


def _text(call: ToolCall, key: str) -> str:
    value = _argument(call, key)
    if not isinstance(value, str):
        raise ToolFailure(f"{call.name}: {key} must be a string, got {json.dumps(value)[:40]}")
    return value.strip().lower()


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit`` (same dimension only)."""
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise ToolFailure(f"unknown unit {unit!r}; units: {', '.join(UNITS)}")
    (dim_from, size_from), (dim_to, size_to) = UNITS[from_unit], UNITS[to_unit]
    if dim_from != dim_to:
        raise ToolFailure(f"cannot convert {dim_from} ({from_unit}) to {dim_to} ({to_unit})")
    return value * size_from / size_to


def _price(item: str, prices: dict[str, float]) -> float:
    key = item.rstrip("s") if item not in prices and item.rstrip("s") in prices else item
    if key not in prices:
        raise ToolFailure(f"no item {item!r}; items: {', '.join(sorted(prices))}")
    return prices[key]


def format_number(value: float) -> str:
    """A result as a short decimal: integers without ``.0``, others rounded to 6 places."""
    rounded = round(float(value), 6)
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)
