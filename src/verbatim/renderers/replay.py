"""Append-only history: what a token-exact harness holds after a conversation, turn by turn.

``replay`` plays a finished conversation the way the rollout loop does: render
the first prompt, append each assistant turn exactly as the model would sample
it, and ``bridge`` the environment messages that follow. Tests compare this with
the official template's re-render; the drift linter and the bench reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import ChatFormat


def replay(renderer: ChatFormat, messages: Sequence[Message], *,
           tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids an append-only harness holds after ``messages`` (ending with a prompt if the last is not assistant)."""
    messages = list(messages)
    if not messages or messages[0].role == "assistant":
        raise RenderError("replay needs a conversation that starts with a system or user message")
    first_reply = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    ids = list(renderer.render(messages[:first_reply], tools=tools, add_generation_prompt=True).token_ids)
    index = first_reply
    while index < len(messages):
        if messages[index].role == "assistant":
            ids += renderer.completion_ids(messages, index, tools=tools)
            index += 1
            continue
        end = next((i for i in range(index, len(messages)) if messages[i].role == "assistant"), len(messages))
        ids += renderer.bridge(ids, messages[index:end], tools=tools)
        index = end
    return ids
