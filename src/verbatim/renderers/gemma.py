"""Gemma 2 and 3 instruct: ``<start_of_turn>user|model\\n … <end_of_turn>\\n`` with strict alternation.

Gemma 3's system message has no turn of its own: the template writes it, followed by
a blank line, at the start of the first user turn. Gemma 2's template refuses a system
message. Content is trimmed. There is no tool role and no tool-call syntax; tool calls
in ``content`` stay plain text.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import ChatFormat, Piece

START, END = "<start_of_turn>", "<end_of_turn>"


class Gemma3(ChatFormat):
    name = "gemma3"
    templates = ("gemma3.jinja",)
    prefix_stable = True
    end_tokens = ((1, "<eos>"), (106, END))  # google/gemma-3-*-it generation_config.json: eos_token_id [1, 106]
    close_text = END
    after_stop = "\n"

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        has_system = messages[0].role == "system"
        prefix = messages[0].content + "\n\n" if has_system else ""
        start = 1 if has_system else 0
        out = [Piece(self.tokenizer.bos_token)]
        for offset, message in enumerate(messages[start:]):
            if (message.role == "user") != (offset % 2 == 0):
                raise RenderError(f"{self.name}: roles must alternate user/assistant/user/assistant/...")
            out.append(Piece(self.turn(message, prefix if offset == 0 else ""), start + offset))
        if add_generation_prompt:
            out.append(Piece(f"{START}model\n", len(messages)))
        return out

    @staticmethod
    def turn(message: Message, prefix: str = "") -> str:
        role = "model" if message.role == "assistant" else message.role
        return f"{START}{role}\n{prefix}{message.content.strip()}{END}\n"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        if len(new_messages) != 1 or new_messages[0].role != "user":
            raise RenderError(f"{self.name}: after an assistant turn comes exactly one user message "
                              "(no tool role: send tool results as a user message)")
        return [Piece(self.turn(new_messages[0])), Piece(f"{START}model\n")]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = () if finished else ("completion ended without <end_of_turn> (cut by max tokens?)",)
        return Message(role="assistant", content=text, problems=problems)


class Gemma2(Gemma3):
    """Gemma 2 (and Gemma 1): Gemma 3's turns, but a leading system message is refused, as the template does."""

    name = "gemma2"
    templates = ("gemma2.jinja",)
    end_tokens = ((1, "<eos>"), (107, END))  # google/gemma-2-2b-it generation_config.json: eos_token_id [1, 107]

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        if messages[0].role == "system":
            raise RenderError("gemma2: the template has no system role (send it as user text)")
        return super().pieces(messages, tools, add_generation_prompt)
