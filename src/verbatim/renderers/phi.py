"""Phi-3 / Phi-3.5 mini and Phi-4 / Phi-4-mini.

Phi-3 and Phi-4-mini append the end-of-text token when the conversation does
not end with a generation prompt, so a re-rendered history never has the
previous prompt as its prefix (``eos_in_history``); ``bridge`` never writes it.
Phi-3's templates drop messages of any role but system/user/assistant (so tool
results must be sent as user messages); Phi-3.5 also drops an empty system message.
Phi-4 is ChatML with ``<|im_sep|>`` and no newlines, and is prefix-stable.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece


class Phi3(ChatFormat):
    name = "phi3"
    templates = ("phi3_mini.jinja",)
    prefix_stable = False  # end-of-text after the last turn when not generating
    # microsoft/Phi-3-mini-4k-instruct generation_config.json: eos_token_id [32000, 32001, 32007]
    end_tokens = ((32000, "<|endoftext|>"), (32001, "<|assistant|>"), (32007, "<|end|>"))
    close_text = "<|end|>"
    after_stop = "\n"
    roles = ("system", "user", "assistant")

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = [Piece(self.turn(m), i) for i, m in enumerate(messages) if self.kept(m)]
        out.append(Piece(self.generation_prompt(), len(messages)) if add_generation_prompt
                   else Piece(self.tokenizer.eos_token, PREAMBLE))
        return out

    def kept(self, message: Message) -> bool:
        return message.role in self.roles

    def turn(self, message: Message) -> str:
        return f"<|{message.role}|>\n{message.content}<|end|>\n"

    def generation_prompt(self) -> str:
        return "<|assistant|>\n"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        for message in new_messages:
            if not self.kept(message):
                raise RenderError(f"{self.name}: the template has no {message.role!r} role and would drop it; "
                                  "send tool results as user messages")
        return [Piece(self.turn(m)) for m in new_messages] + [Piece(self.generation_prompt())]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = () if finished else (f"completion ended without {self.close_text} (cut by max tokens?)",)
        return Message(role="assistant", content=text, problems=problems)


class Phi35(Phi3):
    name = "phi3.5"
    templates = ("phi3_5_mini.jinja",)
    # microsoft/Phi-3.5-mini-instruct generation_config.json: eos_token_id [32007, 32001, 32000]
    end_tokens = ((32007, "<|end|>"), (32001, "<|assistant|>"), (32000, "<|endoftext|>"))

    def kept(self, message: Message) -> bool:
        return message.role in self.roles and not (message.role == "system" and not message.content)


class Phi4(Phi3):
    name = "phi4"
    templates = ("phi4.jinja",)
    prefix_stable = True
    end_tokens = ((100265, "<|im_end|>"),)  # microsoft/phi-4 generation_config.json: eos_token_id 100265
    close_text = "<|im_end|>"
    after_stop = ""

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = [Piece(self.turn(m), i) for i, m in enumerate(messages) if self.kept(m)]
        return out + ([Piece(self.generation_prompt(), len(messages))] if add_generation_prompt else [])

    def turn(self, message: Message) -> str:
        return f"<|im_start|>{message.role}<|im_sep|>{message.content}<|im_end|>"

    def generation_prompt(self) -> str:
        return "<|im_start|>assistant<|im_sep|>"


class Phi4Mini(Phi3):
    name = "phi4-mini"
    templates = ("phi4_mini_instruct.jinja",)
    # microsoft/Phi-4-mini-instruct generation_config.json: eos_token_id [200020, 199999]
    end_tokens = ((200020, "<|end|>"), (199999, "<|endoftext|>"))
    after_stop = ""
    roles = ("system", "user", "assistant", "tool")

    def turn(self, message: Message) -> str:
        return f"<|{message.role}|>{message.content}<|end|>"

    def generation_prompt(self) -> str:
        return "<|assistant|>"
