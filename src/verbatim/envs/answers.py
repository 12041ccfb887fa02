"""Reading answers out of free model text: numbers and short phrases, never raising."""

from __future__ import annotations

import math
import re

NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_ANSWER = re.compile(rf"answer\s*(?:is|:|=)?\s*\**\s*({NUMBER})", re.IGNORECASE)
_NUMBER = re.compile(NUMBER)
_WORD = re.compile(r"[a-z0-9]+")


def to_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def first_number(text: str) -> float | None:
    """The first number written in ``text`` (``1,234`` and ``-2.5`` included), or None."""
    match = _NUMBER.search(text)
    return to_number(match.group()) if match else None


def final_number(text: str) -> float | None:
    """The number after the last ``Answer:``, else the last number in ``text``, or None."""
    marked = _ANSWER.findall(text)
    if marked:
        return to_number(marked[-1])
    numbers = _NUMBER.findall(text)
    return to_number(numbers[-1]) if numbers else None


def numbers_match(got: float | None, want: float, places: int = 2) -> bool:
    """``got`` equals ``want`` to ``places`` decimals (so integer answers must be exact)."""
    if got is None:
        return False
    return abs(got - want) <= 0.5 * 10 ** -places + 1e-12 * max(1.0, abs(want))


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words of ``text``."""
    return _WORD.findall(text.lower())


def mentions(text: str, phrase: str) -> bool:
    """``phrase`` occurs in ``text`` as whole words, case-insensitively."""
    needle, hay = words(phrase), words(text)
    n = len(needle)
    return n > 0 and any(hay[i:i + n] == needle for i in range(len(hay) - n + 1))
