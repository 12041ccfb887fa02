"""gpt-oss (the harmony format): ``<|start|>role<|channel|>…<|message|>…<|end|>``.

Every render starts with a system message holding the knowledge cut-off,
"Current date: …" (the template reads the clock; here ``today`` fixes it) and
"Reasoning: <effort>". The user's system message becomes a ``developer``
message, followed by the tools as a TypeScript-like ``namespace functions``.
The model reasons on the ``analysis`` channel, calls tools on ``commentary``
(ending ``<|call|>``) and answers on ``final`` (ending ``<|return|>``).

Not prefix-stable: the template drops analysis from turns before the last
final answer and rewrites the sampled ``<|return|>`` as ``<|end|>`` once a
turn is in history. ``bridge`` keeps both as sampled. A turn cut on the
analysis channel is closed with ``<|end|>`` and an empty final message
(:meth:`Harmony.cut_close`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, parse_json_arguments, tojson
from verbatim.renderers.harmony_tools import tool_namespace

START, MESSAGE, CHANNEL, END = "<|start|>", "<|message|>", "<|channel|>", "<|end|>"
RETURN, CALL = "<|return|>", "<|call|>"
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


class Harmony(ChatFormat):
    name = "gpt-oss"
    templates = ("gpt_oss.jinja",)
    prefix_stable = False
    # openai/gpt-oss-20b and -120b generation_config.json: eos_token_id [200002, 199999, 200012]
    end_tokens = ((200002, RETURN), (199999, "<|endoftext|>"), (200012, CALL))
    close_text = END
    markup = (START, MESSAGE, CHANNEL, END, RETURN, CALL, "<|constrain|>")
    message_dict_options = {"reasoning_key": "thinking"}

    def __init__(self, tokenizer: Any, *, today: str = "2024-07-26", reasoning_effort: str = "medium") -> None:
        super().__init__(tokenizer)
        self.today = today
        self.reasoning_effort = reasoning_effort

    def template_kwargs(self) -> dict[str, Any]:
        return {"reasoning_effort": self.reasoning_effort}

    def system_text(self, tools: list[dict] | None) -> str:
        text = (f"{IDENTITY}\nKnowledge cutoff: 2024-06\nCurrent date: {self.today}\n\n"
                f"Reasoning: {self.reasoning_effort}\n\n"
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
        if tools:
            text += "\nCalls to these tools must go to the commentary channel: 'functions'."
        return f"{START}system{MESSAGE}{text}{END}"

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        has_developer = messages[0].role == "system"
        out = [Piece(self.system_text(tools))]
        developer = messages[0].content if has_developer else ""
        if developer or tools:
            text = f"# Instructions\n\n{developer}\n\n" if developer else ""
            text += f"# Tools\n\n{tool_namespace(tools)}" if tools else ""
            out.append(Piece(f"{START}developer{MESSAGE}{text}{END}", 0 if has_developer else PREAMBLE))
        start = 1 if has_developer else 0
        last_call: str | None = None
        for i in range(start, len(messages)):
            text, last_call = self.message_text(messages, i, last_call, add_generation_prompt)
            out.append(Piece(text, i))
        if add_generation_prompt:
            out.append(Piece(f"{START}assistant", len(messages)))
        return out

    def message_text(self, messages: list[Message], i: int, last_call: str | None,
                     add_generation_prompt: bool) -> tuple[str, str | None]:
        message = messages[i]
        if message.role == "user":
            return f"{START}user{MESSAGE}{message.content}{END}", last_call
        if message.role == "tool":
            if last_call is None:
                raise RenderError("gpt-oss: a tool message needs an earlier assistant tool call")
            return (f"{START}functions.{last_call} to=assistant{CHANNEL}commentary{MESSAGE}"
                    f"{tojson(message.content)}{END}"), last_call
        if message.role != "assistant":
            return "", last_call
        if message.tool_calls:
            return self.call_text(messages, i), message.tool_calls[0].name
        final = f"{START}assistant{CHANNEL}final{MESSAGE}{message.content}"
        if i == len(messages) - 1 and not add_generation_prompt:
            analysis = self.analysis(message.reasoning) if message.reasoning is not None else ""
            return analysis + final + RETURN, None
        return final + END, None

    def call_text(self, messages: list[Message], i: int) -> str:
        message = messages[i]
        later_final = any(m.role == "assistant" and not m.tool_calls for m in messages[i + 1:])
        if message.content and message.reasoning:
            raise RenderError("gpt-oss: an assistant tool-call message cannot have both content and reasoning")
        thought = message.content or message.reasoning
        text = self.analysis(thought) if thought and not later_final else ""
        call = message.tool_calls[0]
        return (text + f"{START}assistant to=functions.{call.name}{CHANNEL}commentary json{MESSAGE}"
                + arguments_json(call, as_given=False) + CALL)

    @staticmethod
    def analysis(text: str) -> str:
        return f"{START}assistant{CHANNEL}analysis{MESSAGE}{text}{END}"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        last_call = self.last_call_name(previous_ids)
        out = []
        for i in range(len(new_messages)):
            text, last_call = self.message_text(new_messages, i, last_call, True)
            out.append(Piece(text))
        return out + [Piece(f"{START}assistant")]

    def cut_close(self, previous_ids: Sequence[int]) -> str:
        """A turn cut short: ``<|end|>`` closes the open message (unless it was sampled just before the cut).

        A turn cut on the analysis channel also gets an empty final message,
        ``<|start|>assistant<|channel|>final<|message|><|end|>``: the template never writes an
        assistant turn of analysis alone, but writes one whose reasoning ended there as the
        analysis message followed by that final message (``<|return|>`` as the last turn,
        ``<|end|>`` in history, which is where a bridged turn is).
        """
        begin = self._last_start(previous_ids)
        message = self._decode([int(i) for i in previous_ids[begin + 1:]]) if begin is not None else ""
        text = "" if message.endswith(END) else END
        header = message.partition(MESSAGE)[0]
        if re.search(r"<\|channel\|>analysis\b", header) and "to=" not in header:
            text += f"{START}assistant{CHANNEL}final{MESSAGE}{END}"
        return text

    def _last_start(self, previous_ids: Sequence[int]) -> int | None:
        start_id = self._token_id(START)
        return next((k for k in range(len(previous_ids) - 1, -1, -1) if previous_ids[k] == start_id), None)

    def last_call_name(self, previous_ids: Sequence[int]) -> str | None:
        """The function the last assistant message called, read from its header tokens."""
        begin = self._last_start(previous_ids)
        if begin is None:
            return None
        found = re.search(r"to=functions\.([^\s<]+)", self.tokenizer.decode(list(previous_ids[begin:])))
        return found.group(1) if found else None

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = [] if finished else ["completion ended without an end token (<|return|>, <|call|>, "
                                        "<|endoftext|>): cut by max tokens?"]
        reasoning, content, calls = [], [], []
        for header, body in split_messages(text):
            channel = re.search(r"<\|channel\|>(\w+)", header)
            target = re.search(r"to=functions\.([^\s<]+)", header)
            if target:
                call, problem = parse_json_arguments(target.group(1), body, header + MESSAGE + body)
                calls.append(call) if call is not None else problems.append(problem)
            elif channel and channel.group(1) == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return Message(role="assistant", content="".join(content),
                       reasoning="".join(reasoning) if reasoning else None,
                       tool_calls=tuple(calls), problems=tuple(problems))


def split_messages(text: str) -> list[tuple[str, str]]:
    """``(header, body)`` per harmony message in a completion (which starts after ``<|start|>assistant``)."""
    parts = []
    for chunk in re.split(r"<\|end\|><\|start\|>assistant", text):
        header, _, body = chunk.partition(MESSAGE)
        parts.append((header, body.removesuffix(END)))
    return parts
