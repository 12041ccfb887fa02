"""Telling a family's control tokens from ordinary text that spells them.

A model that quotes documentation, or an observation that echoes hostile input,
can write ``<tool_call>{"name": "rm", …}</tool_call>`` with ordinary tokens. Where
the family's tokenizer has the markup as added tokens (Qwen's ``<tool_call>`` is id
151657), only those ids are markup: ``parse_completion`` hides every spelt-out copy
behind a private-use sentinel character before the family's parser reads the text,
and puts the original text back into the parsed message afterwards. A family whose
vocabulary has no such token (SmolLM2) parses the text as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from verbatim.datamodel import Message

SENTINEL_BASE = 0x100000  # Supplementary Private Use Area-B: no tokenizer writes these for markup


def markup_ids(tokenizer: Any, markup: Sequence[str]) -> dict[int, str]:
    """``{id: text}`` for each of ``markup`` that the tokenizer has as one added token."""
    added = tokenizer.get_added_vocab()
    return {added[text]: text for text in markup if text in added}


def decode_marked(ids: Sequence[int], markup: dict[int, str],
                  decode: Callable[[list[int]], str]) -> tuple[str, dict[str, str], list[str]]:
    """``(text, sentinels, problems)``: the decoded text with spelt-out markup replaced by sentinels.

    ``sentinels`` maps each sentinel character back to the markup text it hides.
    """
    text = decode(list(ids))
    if not markup:
        return text, {}, []
    texts = sorted(set(markup.values()), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, texts)))
    real = _expected_matches(ids, markup, pattern, decode)
    matches = list(pattern.finditer(text))
    if len(matches) != len(real):
        return text, {}, ["could not tell markup tokens from text that spells them; parsed the text as it is"]
    if all(real):
        return text, {}, []
    offset = SENTINEL_BASE
    while any(chr(offset + k) in text for k in range(len(texts))):
        offset += len(texts)
    sentinel = {markup_text: chr(offset + k) for k, markup_text in enumerate(texts)}
    pieces, position = [], 0
    for match, is_real in zip(matches, real):
        pieces.append(text[position:match.start()])
        pieces.append(match.group() if is_real else sentinel[match.group()])
        position = match.end()
    pieces.append(text[position:])
    return "".join(pieces), {char: markup_text for markup_text, char in sentinel.items()}, []


def _expected_matches(ids: Sequence[int], markup: dict[int, str], pattern: re.Pattern,
                      decode: Callable[[list[int]], str]) -> list[bool]:
    """Per markup match the decoded text will hold, in order: is it a real markup token?"""
    real: list[bool] = []
    run: list[int] = []
    for token in ids:
        if token in markup:
            real += [False] * len(pattern.findall(decode(run))) + [True]
            run = []
        else:
            run.append(token)
    return real + [False] * len(pattern.findall(decode(run)))


def restore(message: Message, sentinels: dict[str, str]) -> Message:
    """``message`` with every sentinel turned back into the markup text it hides."""
    if not sentinels:
        return message
    table = str.maketrans(sentinels)

    def back(value: Any) -> Any:
        if isinstance(value, str):
            return value.translate(table)
        if isinstance(value, dict):
            return {back(k): back(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(back(v) for v in value)
        return value

    calls = tuple(call.model_copy(update={"name": back(call.name), "arguments": back(call.arguments),
                                          "raw": back(call.raw), "arguments_text": back(call.arguments_text)})
                  for call in message.tool_calls)
    return message.model_copy(update={"content": back(message.content), "reasoning": back(message.reasoning),
                                      "tool_calls": calls, "problems": back(message.problems)})
