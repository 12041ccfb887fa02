"""DeepSeek-V3 and DeepSeek-R1: full-width control tokens, system prompts hoisted to the front.

Both templates keep three flags across the whole conversation, and never reset
them: whether a tool call was written yet (later tool-call turns lose their
``<｜Assistant｜><｜tool▁calls▁begin｜>`` opener), whether a tool output was written
yet (later rounds lose ``<｜tool▁outputs▁begin｜>``), and whether the last message
was a tool result (then the next assistant text follows ``<｜tool▁outputs▁end｜>``
directly and no generation prompt is written). The renderers reproduce this, and
``bridge`` reads the first two flags back from the previous tokens.

R1 cuts every assistant turn to the text after ``</think>`` and opens the
generation prompt with ``<think>\\n``, so its re-rendered history never contains
the reasoning the model sampled (``reasoning_stripped``, ``generation_prompt_dropped``).
Tool-call arguments are string-concatenated by both templates, so they are passed as JSON text.

V3's template writes a turn's calls only when its ``content`` is None; with
``content: ""`` (how many clients send a call-only turn) it writes an empty
answer and drops the calls. The renderer writes them (``departures``): ``""`` and
None are the same call-only turn to verbatim, and the history holds the calls
the model sampled. Text before the calls has no syntax in V3's template; there
the renderer follows it and drops the calls too. ``verbatim lint template``
reports both as ``tool_calls_dropped``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verbatim.datamodel import Message, ToolCall
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, parse_json_arguments, split_think

USER, ASSISTANT, EOS = "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


@dataclass
class Flags:
    """The templates' namespace: ``is_first``, ``is_output_first``, ``is_tool``."""

    call_written: bool = False
    output_written: bool = False
    after_tool: bool = False


def call_body(call: ToolCall) -> str:
    """One call; both templates concatenate the arguments string, so a string given is written as given."""
    return f"function{SEP}{call.name}\n```json\n{arguments_json(call, as_given=True)}\n```{CALL_END}"


class DeepSeekV3(ChatFormat):
    name = "deepseek-v3"
    templates = ("deepseek_v3.jinja",)
    prefix_stable = False  # tool-call turns are re-serialized (single calls never closed)
    end_tokens = ((1, EOS),)  # deepseek-ai/DeepSeek-V3 and DeepSeek-R1 generation_config.json: eos_token_id 1
    close_text = EOS
    markup = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "<think>", "</think>")
    arguments_as_given = True
    message_dict_options = {"arguments_as_string": True, "none_content_with_calls": True}
    # The template writes calls only when content is None: given content "" it drops them for an empty
    # answer. A call-only turn is written with its calls here, as sampled; template_messages passes None.
    departures = frozenset({"tool_calls_dropped"})
    generation_text = ASSISTANT
    output_separator = "\n"

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        systems = [m.content for m in messages if m.role == "system"]
        out = [Piece(self.tokenizer.bos_token), Piece("\n\n".join(systems), PREAMBLE)]
        flags = Flags()
        out += [Piece(self.message_text(m, flags), i) for i, m in enumerate(messages)]
        out.append(Piece(self.ending(flags, add_generation_prompt), len(messages)))
        return out

    def ending(self, flags: Flags, add_generation_prompt: bool) -> str:
        if flags.after_tool:
            return OUTPUTS_END
        return self.generation_text if add_generation_prompt else ""

    def message_text(self, message: Message, flags: Flags) -> str:
        if message.role == "user":
            flags.after_tool = False
            return USER + message.content
        if message.role == "tool":
            flags.after_tool = True
            first, flags.output_written = not flags.output_written, True
            opener = OUTPUTS_BEGIN if first else self.output_separator
            return f"{opener}{OUTPUT_BEGIN}{message.content}{OUTPUT_END}"
        if message.role == "assistant" and message.tool_calls and not message.content:
            flags.after_tool = False
            return self.calls_text(message, flags)
        if message.role == "assistant":
            text = self.assistant_content(message.content)
            if flags.after_tool:
                flags.after_tool = False
                return OUTPUTS_END + text + EOS
            return ASSISTANT + text + EOS
        return ""

    def calls_text(self, message: Message, flags: Flags) -> str:
        text = ""
        for call in message.tool_calls:
            if not flags.call_written:
                text += f"{ASSISTANT}{CALLS_BEGIN}{CALL_BEGIN}" + call_body(call)
                flags.call_written = True
            else:
                text += f"\n{CALL_BEGIN}" + call_body(call) + CALLS_END + EOS
        return text

    def assistant_content(self, content: str) -> str:
        return content

    def completion_text(self, messages, index, *, tools=None) -> str:
        """What the model samples: its reasoning if the prompt opened a think block, content, a closed call section.

        The templates' own turns cannot serve: V3 never closes a single call's section, both
        drop the outputs-end marker before a tool-call turn, and R1 cuts the reasoning.
        """
        message = messages[index]
        text = f"{message.reasoning or ''}\n</think>\n\n" if self.generation_text.endswith("<think>\n") else ""
        text += message.content.split("</think>")[-1].lstrip("\n") if text else message.content
        if message.tool_calls:
            text += CALLS_BEGIN + "\n".join(CALL_BEGIN + call_body(c) for c in message.tool_calls)
            text += CALLS_END
        return text + EOS

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        seen = set(previous_ids)
        flags = Flags(call_written=self._token_id(CALLS_BEGIN) in seen,
                      output_written=self._token_id(OUTPUTS_BEGIN) in seen)
        out = [Piece(self.message_text(m, flags)) for m in new_messages]
        return out + [Piece(self.ending(flags, add_generation_prompt=True))]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text, opened=self.generation_text.endswith("<think>\n"))
        if reasoning is not None:
            reasoning, rest = reasoning.strip("\n"), rest.lstrip("\n")
        return reply(*parse_calls(rest), reasoning, problems, finished=finished)


class DeepSeekR1(DeepSeekV3):
    name = "deepseek-r1"
    templates = ("deepseek_r1.jinja",)
    departures = frozenset()  # R1's template tests for 'tool_calls', not for content None
    prefix_stable = False  # reasoning cut from every turn; <think> in the prompt is not in history
    generation_text = ASSISTANT + "<think>\n"
    output_separator = ""
    think = ("<think>", "</think>")  # a reply cut while reasoning gets "\n</think>\n\n" before the end
    turn_starts = (ASSISTANT, USER, OUTPUTS_END)

    def message_text(self, message: Message, flags: Flags) -> str:
        if message.role == "assistant" and message.tool_calls:
            flags.after_tool = False
            return self.calls_text(message, flags)
        if message.role == "assistant" and flags.after_tool:
            flags.after_tool = False
            return OUTPUTS_END + message.content + EOS  # the template does not cut reasoning here
        return super().message_text(message, flags)

    def calls_text(self, message: Message, flags: Flags) -> str:
        text = ""
        for call in message.tool_calls:
            if not flags.call_written:
                text += f"{ASSISTANT}{message.content}{CALLS_BEGIN}{CALL_BEGIN}" + call_body(call)
                flags.call_written = True
            else:
                text += f"\n{CALL_BEGIN}" + call_body(call)
        return text + CALLS_END + EOS

    def assistant_content(self, content: str) -> str:
        return content.split("</think>")[-1]

def reply(content: str, calls: list[ToolCall], call_problems: list[str], reasoning: str | None,
          problems: list[str], *, finished: bool) -> Message:
    """The parsed assistant message; a completion without its end token is noted as cut."""
    cut = [] if finished else [f"completion ended without {EOS} (cut by max tokens?)"]
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=tuple(calls),
                   problems=(*problems, *call_problems, *cut))


def parse_calls(text: str) -> tuple[str, list, list[str]]:
    """Content, tool calls and problems for DeepSeek's ``<｜tool▁calls▁begin｜>`` section."""
    if CALLS_BEGIN not in text and CALL_BEGIN not in text:
        return text, [], []
    marker = CALLS_BEGIN if CALLS_BEGIN in text else CALL_BEGIN
    content, section = text.split(marker, 1)
    calls, problems = [], []
    for block in section.split(CALL_BEGIN):
        block = block.replace(CALLS_END, "")
        if not block.strip():
            continue
        if CALL_END not in block or SEP not in block or "```json\n" not in block:
            problems.append(f"malformed tool call: {block[:80]!r}")
            continue
        body = block.split(CALL_END, 1)[0]
        name = body.split(SEP, 1)[1].split("\n", 1)[0]
        arguments = body.split("```json\n", 1)[1].rsplit("\n```", 1)[0]
        call, problem = parse_json_arguments(name, arguments, CALL_BEGIN + body + CALL_END)
        calls.append(call) if call is not None else problems.append(problem)
    return content, calls, problems
