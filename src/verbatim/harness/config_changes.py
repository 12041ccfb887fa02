"""What changed between a run's saved config and the one a ``--resume`` asks for: pure, no I/O.

:func:`config_differences` compares two JSON-shaped configs key by dotted key, as JSON sees values (a
tuple is a list, True is not 1, NaN equals NaN), so a config that went through ``state.json`` or
``manifest.json`` compares equal to the one it came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_MISSING = object()  # a key on one side only


def config_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``"key.sub: saved -> now"`` for every dotted key whose value differs or exists on one side only, sorted."""
    before, after = _flatten(saved), _flatten(now)
    keys = set(before) | set(after)
    lines = []
    for key in sorted(keys):
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        if not _same(old, new) and not _filled(key, old, new, keys):
            lines.append(f"{key}: {_show(old)} -> {_show(new)}")
    return lines


def _filled(key: str, old: Any, new: Any, keys: set[str]) -> bool:
    """An empty mapping on one side whose keys the other side holds: their own lines say what changed."""
    emptied = (old is _MISSING and new == {}) or (new is _MISSING and old == {})
    return emptied and any(k.startswith(f"{key}.") for k in keys)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = _plain(value)
    return flat


def _plain(value: Any) -> Any:
    """JSON's view of a value: tuples are lists, mappings are dicts (a saved config went through JSON)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: True is not 1, NaN is NaN."""
    if a is _MISSING or b is _MISSING:
        return a is b
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(missing)"
    return repr(value) if isinstance(value, str) else str(value)
