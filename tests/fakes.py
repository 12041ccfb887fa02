"""Test doubles for pure loop logic (never evidence that an engine capability works)."""

from __future__ import annotations

from types import SimpleNamespace

from verbatim.datamodel import Message

STOP = 1
"""The stop token id of :class:`CharRenderer`."""


class CharRenderer:
    """One token per character (code point + 10); the stop token ends each assistant turn."""

    stop_token_ids = (STOP,)

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) + 10 for c in text]

    def render(self, messages, *, tools=None, add_generation_prompt):
        text = "".join(f"<{m.role}>{m.content}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return SimpleNamespace(token_ids=self.encode(text))

    def bridge(self, previous_ids, new_messages, *, tools=None):
        return self.encode("".join(f"<{m.role}>{m.content}" for m in new_messages) + "<assistant>")

    def parse_completion(self, token_ids):
        return Message(role="assistant", content="".join(chr(t - 10) for t in token_ids if t != STOP))
