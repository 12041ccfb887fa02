"""DeepSeek-V3.1: V3's full-width markers, a ``thinking`` switch, and no conversation-long flags.

The generation prompt is ``<｜Assistant｜></think>`` (non-thinking) or ``<｜Assistant｜><think>``
(thinking). An assistant turn that answers a user is written ``<｜Assistant｜></think>`` + the
text after the first ``</think>`` of its content, in either mode: the reasoning the model
sampled is never re-rendered, so the thinking mode is not prefix-stable
(``generation_prompt_dropped``) while the non-thinking mode is.

Tool calls are ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>…
<｜tool▁calls▁end｜>`` (arguments concatenated as JSON text, no code fence). Tool results are bare
``<｜tool▁output▁begin｜>…<｜tool▁output▁end｜>`` blocks, and after one the template writes no
generation prompt: the model continues right after the last block, and its text there is kept
whole (no ``</think>`` cut). DeepSeek documents tool calls for the non-thinking mode only; in the
thinking mode ``parse_completion`` expects every completion to open inside the think block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verbatim.datamodel import Message
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, parse_json_arguments, split_think
from verbatim.renderers.deepseek import (
    ASSISTANT,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    EOS,
    OUTPUT_BEGIN,
    OUTPUT_END,
    SEP,
    USER,
    reply,
)

THINK, END_THINK = "<think>", "</think>"


@dataclass
class After:
    """The role of the last non-system message written: the template's ``is_last_user`` and ``is_tool``."""

    role: str = ""


class DeepSeekV31(ChatFormat):
    name = "deepseek-v3.1"
    templates = ("deepseek_v3_1.jinja",)
    prefix_stable = True  # non-thinking: the prompt's </think> opens the turn the template re-renders
    end_tokens = ((1, EOS),)  # deepseek-ai/DeepSeek-V3.1 generation_config.json: eos_token_id 1
    close_text = EOS
    markup = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, THINK, END_THINK)
    arguments_as_given = True
    message_dict_options = {"arguments_as_string": True}  # the template concatenates the arguments text
    thinking = False

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        systems = [m.content for m in messages if m.role == "system"]
        out = [Piece(self.tokenizer.bos_token), Piece("\n\n".join(systems), PREAMBLE)]
        after = After()
        out += [Piece(self.message_text(m, after), i) for i, m in enumerate(messages)]
        if add_generation_prompt and after.role == "user":
            out.append(Piece(self.generation_text, len(messages)))
        return out

    @property
    def generation_text(self) -> str:
        return ASSISTANT + (THINK if self.thinking else END_THINK)

    @staticmethod
    def message_text(message: Message, after: After) -> str:
        """``message`` as the template writes it after ``after.role``, which it then updates."""
        previous = after.role
        if message.role == "system":
            return ""
        after.role = message.role
        if message.role == "user":
            return USER + message.content
        if message.role == "tool":
            return OUTPUT_BEGIN + message.content + OUTPUT_END
        if message.role != "assistant":
            return ""
        opener = ASSISTANT + END_THINK if previous == "user" else ""
        if message.tool_calls:
            calls = "".join(f"{CALL_BEGIN}{c.name}{SEP}{arguments_json(c, as_given=True)}{CALL_END}"
                            for c in message.tool_calls)
            return f"{opener}{message.content}{CALLS_BEGIN}{calls}{CALLS_END}{EOS}"
        content = message.content
        if previous != "tool" and END_THINK in content:
            content = content.split(END_THINK, 1)[1]
        return opener + content + EOS

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        after = After("assistant")
        out = [Piece(self.message_text(m, after)) for m in new_messages]
        return out + [Piece(self.generation_text if after.role == "user" else "")]

    def completion_text(self, messages: Sequence[Message], index: int, *,
                        tools: Sequence[dict] | None = None) -> str:
        """Thinking: the reasoning, then the turn as the template writes it from its ``</think>`` on."""
        prompt, own = self._turn_texts(messages, index, tools)
        if prompt.endswith(THINK) and own.startswith(ASSISTANT + END_THINK):
            return self.cut_at_stop((messages[index].reasoning or "") + own[len(ASSISTANT):])
        return super().completion_text(messages, index, tools=tools)

    def template_kwargs(self) -> dict[str, Any]:
        return {"thinking": self.thinking}

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text, opened=True) if self.thinking else (None, text, [])
        return reply(*parse_calls(rest), reasoning, problems, finished=finished)


class DeepSeekV31Thinking(DeepSeekV31):
    name = "deepseek-v3.1-thinking"
    prefix_stable = False  # the prompt's <think> and the sampled reasoning are not re-rendered
    thinking = True
    # A reply cut while reasoning gets "</think>" before <｜end▁of▁sentence｜>: what the model samples for a
    # reasoning that ended there (the template drops reasoning from history; as DeepSeek-R1).
    think = (THINK, END_THINK)
    think_padded = False
    turn_starts = (ASSISTANT, USER, OUTPUT_END)  # after tool outputs the model continues past the last end


def parse_calls(text: str) -> tuple[str, list, list[str]]:
    """Content, tool calls and problems for V3.1's ``NAME<｜tool▁sep｜>ARGUMENTS`` calls."""
    if CALLS_BEGIN not in text and CALL_BEGIN not in text:
        return text, [], []
    content, section = text.split(CALLS_BEGIN if CALLS_BEGIN in text else CALL_BEGIN, 1)
    calls, problems = [], []
    for block in section.split(CALL_BEGIN):
        block = block.replace(CALLS_END, "")
        if not block.strip():
            continue
        if CALL_END not in block or SEP not in block:
            problems.append(f"malformed tool call: {block[:80]!r}")
            continue
        body = block.split(CALL_END, 1)[0]
        name, arguments = body.split(SEP, 1)
        call, problem = parse_json_arguments(name, arguments, CALL_BEGIN + body + CALL_END)
        calls.append(call) if call is not None else problems.append(problem)
    return content, calls, problems
