"""Naming the cause of a drift: which template behaviour changed tokens already rendered.

:func:`classify` looks at the two rendered texts around the first divergent
token and at the conversation, and picks the first matching cause in a fixed
order (most specific first). Pure string logic; see ``drift.CAUSES``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

END_MARKERS = ("<|return|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
THINK_OPENERS = ("<think>", "<|channel|>analysis")
SLACK = 8
"""Characters a divergent token may start before the text that differs."""


@dataclass(frozen=True)
class Evidence:
    """What the classifier sees: both texts, the divergence's character position, the conversation."""

    kind: str
    cut: tuple[int, int]
    earlier: str
    later: str
    position: int
    earlier_dates: tuple[str, ...]
    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]]
    eos_token: str
    prompt_start: int | None = None

    @property
    def ours(self) -> str:
        return self.earlier[self.position:]

    @property
    def theirs(self) -> str:
        return self.later[self.position:]

    def moved(self, marker: str) -> bool:
        """``marker`` sits at the divergence in the earlier text but not at the same place in the later one."""
        start = max(0, self.position - SLACK)
        ours = self.earlier.find(marker, start)
        return ours != -1 and ours <= self.position + SLACK and self.later.find(marker, start) != ours


def classify(e: Evidence) -> str:
    if e.later.startswith(e.earlier):
        return "bpe_boundary_merge"
    for cause, test in RULES:
        if test(e):
            return cause
    return "other"


def _date_injected(e: Evidence) -> bool:
    for date in set(e.earlier_dates):
        for found in re.finditer(re.escape(date), e.earlier):
            if found.start() <= e.position + 1 and e.position <= found.end() and date not in e.later:
                return True
    return False


def _eos_in_history(e: Evidence) -> bool:
    """An end marker right at the divergence (a token may start a few characters before it)."""
    return any(e.moved(m) for m in {m for m in END_MARKERS + (e.eos_token,) if m})


def reasoning_texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Every non-empty reasoning text of the conversation, from fields or ``<think>`` blocks in content."""
    found = []
    for message in messages:
        for key in ("reasoning_content", "reasoning", "thinking"):
            if isinstance(message.get(key), str) and message[key].strip():
                found.append(message[key].strip())
        content = message.get("content")
        if isinstance(content, str) and "</think>" in content:
            inner = content.split("</think>")[0].split("<think>")[-1].strip()
            found += [inner] if inner else []
    return found


def _reasoning_stripped(e: Evidence) -> bool:
    if any(e.moved(opener) for opener in THINK_OPENERS):
        return True
    return any(e.earlier.count(r) > e.later.count(r) for r in reasoning_texts(e.messages))


def _generation_prompt_dropped(e: Evidence) -> bool:
    """The divergence is in the generation prompt, and the next turn does not contain that prompt at all."""
    if e.kind != "generation_prompt" or e.prompt_start is None or e.position + SLACK < e.prompt_start:
        return False
    prompt = e.earlier[e.prompt_start:]
    return prompt not in e.later[e.prompt_start:e.prompt_start + len(prompt) + 4 * SLACK]


def _system_moved(e: Evidence) -> bool:
    texts = [m["content"] for m in e.messages if m.get("role") == "system" and isinstance(m.get("content"), str)]
    texts = [t for t in texts if t.strip()]
    texts += [json.dumps(t, ensure_ascii=False)[:40] for t in e.tools]
    texts += [t["function"]["name"] for t in e.tools if isinstance(t.get("function"), dict)]
    texts += ["[AVAILABLE_TOOLS]"] if e.tools else []
    for text in texts:
        where = e.earlier.find(text, max(0, e.position - len(text)))
        if where != -1 and where <= e.position + 80 and e.later.find(text, max(0, e.position - len(text))) != where:
            return True
    return False


def _default_system_injected(e: Evidence) -> bool:
    has_system = any(m.get("role") == "system" for m in e.messages)
    return not has_system and "system" in e.theirs[:40] and "system" not in e.ours[:40]


TOOL_CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<|call|>", "to=functions.", "<|python_tag|>", "<|tool_call_begin|>")


def _tool_call_reserialized(e: Evidence) -> bool:
    flipped = Evidence(e.kind, e.cut, e.later, e.earlier, e.position, (), e.messages, e.tools, e.eos_token)
    if any(e.moved(m) or flipped.moved(m) for m in TOOL_CALL_MARKERS):
        return True
    names = {call.get("function", call).get("name") for m in e.messages for call in (m.get("tool_calls") or ())}
    for name in filter(None, names):
        theirs, ours = e.theirs[:200].find(name), e.ours[:200].find(name)
        if theirs != -1 and theirs != ours:
            return True
    return False


def _whitespace_trimmed(e: Evidence) -> bool:
    ours, theirs = e.ours, e.theirs
    if not (ours[:1].isspace() or theirs[:1].isspace()):
        return False
    ours, theirs = ours.lstrip(), theirs.lstrip()
    n = min(24, len(ours), len(theirs))
    return n > 0 and ours[:n] == theirs[:n]


RULES = (
    ("date_injected", _date_injected),
    ("eos_in_history", _eos_in_history),
    ("default_system_injected", _default_system_injected),
    ("generation_prompt_dropped", _generation_prompt_dropped),
    ("reasoning_stripped", _reasoning_stripped),
    ("system_moved", _system_moved),
    ("tool_call_reserialized", _tool_call_reserialized),
    ("whitespace_trimmed", _whitespace_trimmed),
)
