"""Per-turn cost of ``bridge`` versus a full ``apply_chat_template`` re-render (``verbatim bench render``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from verbatim.datamodel import Message
from verbatim.renderers.base import ChatFormat
from verbatim.renderers.replay import replay

TOPICS = ("rivers", "prime numbers", "bread", "orbits", "chess openings", "volcanoes", "jazz", "tides")


class BenchRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    turns: int
    history_tokens: int
    bridge_ms: float
    rerender_ms: float

    @property
    def speedup(self) -> float:
        return self.rerender_ms / self.bridge_ms if self.bridge_ms else float("inf")


def synthetic_conversation(turns: int) -> list[Message]:
    """A system prompt and ``turns`` user/assistant exchanges of a few sentences each, then a user message."""
    messages = [Message(role="system", content="You are a knowledgeable, concise assistant.")]
    for turn in range(turns):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append(Message(role="user", content=f"Turn {turn}: tell me one surprising fact about {topic}."))
        messages.append(Message(role="assistant", content=f"Here is a fact about {topic}: it has been studied "
                                f"for centuries, and fact number {turn} is that details still surprise experts. "
                                "Ask me for more if you like."))
    messages.append(Message(role="user", content="Thanks! One more, please."))
    return messages


def median_ms(action: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def bench_turns(renderer: ChatFormat, template: str, turns: int, repeats: int) -> BenchRow:
    """Time the prompt of turn ``turns``: bridge from the held history vs re-rendering all of it."""
    messages = synthetic_conversation(turns)
    history = replay(renderer, messages[:-1])  # ends with the last assistant reply, as sampled
    new = messages[-1:]
    dicts = renderer.template_messages(messages)
    kwargs = renderer.template_kwargs()

    def rerender() -> Any:
        return renderer.tokenizer.apply_chat_template(dicts, chat_template=template, add_generation_prompt=True,
                                                      tokenize=True, **kwargs)

    bridge_ms = median_ms(lambda: renderer.bridge(history, new), repeats)
    rerender_ms = median_ms(rerender, max(3, repeats // 4))
    return BenchRow(turns=turns, history_tokens=len(history), bridge_ms=bridge_ms, rerender_ms=rerender_ms)


def bench_render(renderer: ChatFormat, template: str, turn_counts: Sequence[int] = (10, 50, 200),
                 repeats: int = 40) -> list[BenchRow]:
    return [bench_turns(renderer, template, turns, repeats) for turns in turn_counts]


def markdown_table(rows: Sequence[BenchRow]) -> str:
    lines = ["| turns | history tokens | bridge (ms/turn) | full re-render (ms/turn) | re-render / bridge |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.turns} | {r.history_tokens} | {r.bridge_ms:.3f} | {r.rerender_ms:.2f} | {r.speedup:.0f}x |"
              for r in rows]
    return "\n".join(lines)
