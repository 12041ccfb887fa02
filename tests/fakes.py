"""Test doubles for pure loop logic (never evidence that an engine capability works), and a tiny rollout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from verbatim.datamodel import Message, Rollout, TokenColumns, Turn

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


PARSER_MARKUP = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
                 '{"name": "f", "arguments": {', '{"name": "f", "arguments": {"x": 1}}', "{", "}", '"', "```",
                 "<|channel|>analysis<|message|>",
                 "<|channel|>commentary to=functions.f <|constrain|>json<|message|>", "<|end|>", "<|call|>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                 "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n",
                 "<｜tool▁call▁end｜>", "function", "\n", "<|im_end|>", "<|eot_id|>", "<end_of_turn>"]
"""Format markup the renderers' ``parse_completion`` look for, mixed into fuzzed text (both fuzz suites)."""


def tiny_rollout(index: int = 0) -> Rollout:
    """A valid six-token rollout (three prompt tokens, three sampled), distinct per ``index``."""
    tokens = TokenColumns(token_id=np.arange(6) + index, source=np.array([0, 0, 0, 2, 2, 2]),
                          logprob=np.array([np.nan] * 3 + [-0.5] * 3), policy_version=np.array([-1] * 3 + [0] * 3),
                          turn=np.zeros(6))
    turn = Turn(index=0, prompt_end=3, completion_end=6, cached_tokens=0, finish_reason="stop")
    return Rollout(run_id="fuzz", group_id="g0", rollout_id=f"r{index}", tokens=tokens, turns=(turn,),
                   reward=1.0, task={"id": index}, info={"note": "x" * index})
