"""The renderer protocol, and the text-to-token machinery every chat family shares.

A family describes its chat format as *pieces* of text, each tagged with the
message it belongs to. ``render`` joins the pieces and tokenizes the whole text
once (exactly what ``apply_chat_template(..., tokenize=True)`` does), so it is
token-for-token equal to the official template whenever the text is. ``bridge``
tokenizes only the text that continues an existing sequence, so its cost is
proportional to the new tokens and it can never change a token already sampled.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, model_validator

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.completion import close_think
from verbatim.renderers.markup import decode_marked, markup_ids, restore

PREAMBLE = -1
"""Message index of tokens that belong to no message (BOS, injected system text, tool lists)."""


class RenderedTokens(BaseModel):
    """Token ids of a rendered conversation and, per token, the index of its message.

    Tokens of no message (BOS, a default system prompt, tool definitions) carry
    :data:`PREAMBLE`; the generation prompt carries ``len(messages)``, the index
    the next (assistant) message will have.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_ids: tuple[int, ...]
    message_index: tuple[int, ...]

    @model_validator(mode="after")
    def _aligned(self) -> RenderedTokens:
        if len(self.token_ids) != len(self.message_index):
            raise ValueError("token_ids and message_index must have the same length")
        return self

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Renderer(Protocol):
    """Token-exact chat rendering for one model family."""

    name: str
    templates: tuple[str, ...]
    prefix_stable: bool

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def render(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool) -> RenderedTokens: ...

    def bridge(self, previous_ids: Sequence[int], new_messages: Sequence[Message], *,
               tools: Sequence[dict] | None = None) -> list[int]: ...

    def parse_completion(self, token_ids: Sequence[int]) -> Message: ...


@dataclass(frozen=True)
class Piece:
    """Text that a chat format writes, and the message it belongs to."""

    text: str
    message: int = PREAMBLE


class ChatFormat:
    """Base of every family: pieces in, tokens out. Subclasses describe only their format.

    Class attributes a family sets:
      ``name``, ``templates`` (the official template files it is verified against),
      ``prefix_stable`` (does the official template re-render earlier turns unchanged),
      ``end_tokens`` (the ``eos_token_id`` list of the family's official ``generation_config.json``,
      as ``(id there, token text)``; the text finds the id in the tokenizer in use, stand-ins included),
      ``close_text`` (what ends an assistant turn cut short, e.g. by max tokens),
      ``think`` (a reasoning block's opener and closer tokens: a turn cut inside one is closed first,
      see :meth:`cut_close`), ``think_padded`` (the template writes newlines around the reasoning,
      ``<think>\\n…\\n</think>\\n\\n``, rather than ``<think>…</think>``: see
      :func:`~verbatim.renderers.completion.close_think`) and ``turn_starts`` (tokens that begin a turn:
      the search for the opener stops there),
      ``after_stop`` (text the template writes after the stop token, e.g. ``"\\n"``),
      ``markup`` (texts of the control tokens ``parse_text`` looks for: see :mod:`verbatim.renderers.markup`),
      ``arguments_as_given`` (the template writes a string ``function.arguments`` unchanged).
    """

    name: str = ""
    templates: tuple[str, ...] = ()
    prefix_stable: bool = True
    end_tokens: tuple[tuple[int, str], ...] = ()
    markup: tuple[str, ...] = ()
    arguments_as_given: bool = False
    close_text: str = ""
    after_stop: str = ""
    think: tuple[str, str] | None = None
    think_padded: bool = True
    turn_starts: tuple[str, ...] = ()
    bridge_roles: tuple[str, ...] = ("user", "tool")
    """Roles ``bridge`` accepts (Mistral v3 also takes the system message, to repeat it as its template does)."""
    message_dict_options: dict[str, bool] = {}
    """How :meth:`template_messages` writes messages for this family's official template."""
    departures: frozenset[str] = frozenset()
    """Lint causes (``drift.CAUSES``) where ``render`` departs from the official template on purpose, for
    messages as the template's users write them (docs/renderers.md); :meth:`template_messages` writes the
    form on which the two agree."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._stop_ids = tuple(self._token_id(text) for text in self.stop_tokens)
        self._markup = markup_ids(tokenizer, self.markup)

    # -- the protocol -------------------------------------------------------

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        """Texts of the end tokens: any of them ends an assistant turn."""
        return tuple(text for _, text in self.end_tokens)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def render(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool) -> RenderedTokens:
        if not messages:
            raise RenderError(f"{self.name}: render needs at least one message")
        pieces = self.pieces(list(messages), list(tools) if tools else None, add_generation_prompt)
        return self._tokenize_pieces(pieces)

    def bridge(self, previous_ids: Sequence[int], new_messages: Sequence[Message], *,
               tools: Sequence[dict] | None = None) -> list[int]:
        if len(previous_ids) == 0:
            raise RenderError(f"{self.name}: bridge needs the previous tokens; use render for a first prompt")
        if not new_messages:
            raise RenderError(f"{self.name}: bridge needs at least one new message")
        for message in new_messages:
            if message.role not in self.bridge_roles:
                raise RenderError(f"{self.name}: bridge appends environment messages only, got role "
                                  f"{message.role!r}; render a new prompt to add {message.role} turns")
        # Any end token closes the turn (Qwen's <|endoftext|> as well as <|im_end|>): then only what the
        # template writes after a closed turn follows. No copy: the cost must not grow with the history.
        closed = previous_ids[-1] in self._stop_ids
        text = ("" if closed else self.cut_close(previous_ids)) + self.after_stop
        text += "".join(p.text for p in self.bridge_pieces(previous_ids, list(new_messages),
                                                           list(tools) if tools else None))
        return self.encode(text)

    def cut_close(self, previous_ids: Sequence[int]) -> str:
        """What ends a turn cut short (no stop token): an open think block closed as the template writes one
        (:func:`~verbatim.renderers.completion.close_think`), then ``close_text``.

        It reads back only the current turn: from the last think opener or turn start on.
        """
        if self.think is None:
            return self.close_text
        opener, bounds = self._token_id(self.think[0]), {self._token_id(t) for t in self.turn_starts}
        for k in range(len(previous_ids) - 1, -1, -1):
            if previous_ids[k] == opener:
                sampled = self._decode([int(i) for i in previous_ids[k + 1:]])
                return close_think(sampled, self.think[1], padded=self.think_padded) + self.close_text
            if previous_ids[k] in bounds:
                break
        return self.close_text

    def parse_completion(self, token_ids: Sequence[int]) -> Message:
        ids = list(token_ids)
        finished = bool(ids) and ids[-1] in self._stop_ids
        if finished:
            ids = ids[:-1]
        text, sentinels, problems = decode_marked(ids, self._markup, self._decode)
        message = restore(self.parse_text(text, finished=finished), sentinels)
        return message.model_copy(update={"problems": tuple(problems) + message.problems}) if problems else message

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def completion_text(self, messages: Sequence[Message], index: int, *,
                        tools: Sequence[dict] | None = None) -> str:
        """The text a model of this family samples for assistant ``messages[index]``, stop token included.

        It is the template's own rendering of that message as the final turn, less the
        generation prompt that precedes it. Families whose prompt does not prefix the
        turn (DeepSeek) override it.
        """
        prompt, own = self._turn_texts(messages, index, tools)
        if not own.startswith(prompt):
            raise RenderError(f"{self.name}: the generation prompt {prompt!r} does not start the turn {own[:40]!r}")
        return self.cut_at_stop(own[len(prompt):])

    def _turn_texts(self, messages: Sequence[Message], index: int,
                    tools: Sequence[dict] | None) -> tuple[str, str]:
        messages, tools = list(messages), list(tools) if tools else None
        if index == 0 or messages[index].role != "assistant":
            raise RenderError(f"{self.name}: message {index} is not an assistant reply to earlier messages")
        prompt = "".join(p.text for p in self.pieces(messages[:index], tools, True) if p.message == index)
        own = "".join(p.text for p in self.pieces(messages[:index + 1], tools, False) if p.message == index)
        return prompt, own

    def cut_at_stop(self, text: str) -> str:
        ends = [text.find(stop) + len(stop) for stop in self.stop_tokens if stop in text]
        return text[:min(ends)] if ends else text + self.close_text

    def completion_ids(self, messages: Sequence[Message], index: int, *,
                       tools: Sequence[dict] | None = None) -> list[int]:
        """:meth:`completion_text` as token ids, tokenized in the context of the generation prompt."""
        prompt, _ = self._turn_texts(messages, index, tools)
        completion = self.completion_text(messages, index, tools=tools)
        alone, together = self.encode(prompt), self.encode(prompt + completion)
        if together[:len(alone)] == alone:
            return together[len(alone):]
        return self.encode(completion)

    # -- what a family implements ------------------------------------------

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        raise NotImplementedError

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        raise NotImplementedError

    def parse_text(self, text: str, *, finished: bool) -> Message:
        raise NotImplementedError

    # -- the official template's view ---------------------------------------

    def template_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """``messages`` as the HF-format dicts the official template expects."""
        from verbatim.renderers.conversations import message_to_dict

        options = {"arguments_as_given": self.arguments_as_given, **self.message_dict_options}
        return [message_to_dict(m, **options) for m in messages]

    def template_kwargs(self) -> dict[str, Any]:
        """Extra ``apply_chat_template`` keyword arguments that select this renderer's options."""
        return {}

    # -- shared helpers -----------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _token_id(self, text: str) -> int:
        token_id = self._backend.token_to_id(text)
        if token_id is None:
            raise RenderError(f"{self.name}: the tokenizer has no token {text!r}; "
                              "use the family's tokenizer (verbatim.renderers.tokenizers)")
        return token_id

    def _tokenize_pieces(self, pieces: list[Piece]) -> RenderedTokens:
        starts, owners, text = [], [], []
        position = 0
        for piece in pieces:
            if piece.text:
                starts.append(position)
                owners.append(piece.message)
                text.append(piece.text)
                position += len(piece.text)
        encoding = self._backend.encode("".join(text), add_special_tokens=False)
        index = [owners[max(0, bisect.bisect_right(starts, start) - 1)] for start, _ in encoding.offsets]
        return RenderedTokens(token_ids=tuple(encoding.ids), message_index=tuple(index))
