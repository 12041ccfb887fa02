"""GLM-4.5 (zai-org GLM-4-MoE): role tokens and no end-of-turn token.

``[gMASK]<sop>`` opens every render; turns are ``<|system|>\\n…``, ``<|user|>\\n…``,
``<|assistant|>\\n<think>…</think>\\n…`` and ``<|observation|>`` + ``<tool_response>``
blocks. Nothing closes a turn: the model ends its reply by sampling the token that
opens the next one, ``<|user|>`` (an answer) or ``<|observation|>`` (after tool calls),
both in the official ``eos_token_id`` list with ``<|endoftext|>``. That token is the
next turn's opener, so ``bridge`` does not write it again; after any other end (or a
cut reply) it writes the opener in full. Reasoning is kept only after the last user
message; earlier turns get an empty ``<think></think>`` (``reasoning_stripped``).
Tool calls are XML: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n…</tool_call>``
(a string value as it is, others through ``tojson``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message, ToolCall
from verbatim.renderers.base import ChatFormat, Piece
from verbatim.renderers.completion import extract_tagged, loose_value, split_think, tojson
from verbatim.renderers.qwen3 import reasoning_and_content

SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_RULES = ("</tools>\n\nFor each function call, output the function name and arguments within the following "
               "XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
               "</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>")
ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def xml_call(call: ToolCall) -> str:
    arguments = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value if isinstance(value, str) else tojson(value)}"
                        "</arg_value>\n" for key, value in call.arguments.items())
    return f"\n<tool_call>{call.name}\n{arguments}</tool_call>"


class GLM45(ChatFormat):
    name = "glm-4.5"
    templates = ("glm4_5_moe.jinja",)
    prefix_stable = False  # reasoning before the last user message becomes <think></think>
    # zai-org/GLM-4.5 generation_config.json: eos_token_id [151329, 151336, 151338]
    end_tokens = ((151329, "<|endoftext|>"), (151336, USER), (151338, OBSERVATION))
    close_text = ""  # no end-of-turn token: a cut reply is followed by the next opener
    markup = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>")
    think = ("<think>", "</think>")  # a reply cut while reasoning gets "</think>", as the template writes it
    think_padded = False  # <think>reasoning</think>, no newline after it when the content is empty
    turn_starts = (SYSTEM, USER, ASSISTANT, OBSERVATION)

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking else {"enable_thinking": False}

    def generation_prompt(self) -> str:
        return ASSISTANT + ("" if self.enable_thinking else "\n<think></think>")

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = [Piece("[gMASK]<sop>")]
        if tools:
            out.append(Piece(f"{SYSTEM}\n{TOOLS_INTRO}" + "".join(tojson(t) + "\n" for t in tools) + TOOLS_RULES))
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        for i, message in enumerate(messages):
            opens = i == 0 or messages[i - 1].role != "tool"
            out.append(Piece(self.turn_text(message, thinking=i > last_user, opens=opens), i))
        if add_generation_prompt:
            out.append(Piece(self.generation_prompt(), len(messages)))
        return out

    def turn_text(self, message: Message, *, thinking: bool = False, opens: bool = True) -> str:
        """``message``'s turn; ``opens``: a tool result that starts a run of them writes ``<|observation|>``."""
        if message.role == "user":
            nothink = "" if self.enable_thinking or message.content.endswith("/nothink") else "/nothink"
            return f"{USER}\n{message.content}{nothink}"
        if message.role == "system":
            return f"{SYSTEM}\n{message.content}"
        if message.role == "tool":
            return (OBSERVATION if opens else "") + f"\n<tool_response>\n{message.content}\n</tool_response>"
        if message.role == "assistant":
            return ASSISTANT + self.reply_text(message, thinking=thinking)
        return ""

    def reply_text(self, message: Message, *, thinking: bool) -> str:
        reasoning, content = reasoning_and_content(message)
        text = f"\n<think>{reasoning.strip()}</think>" if thinking and reasoning else "\n<think></think>"
        text += f"\n{content.strip()}" if content.strip() else ""
        return text + "".join(xml_call(call) for call in message.tool_calls)

    def completion_text(self, messages: Sequence[Message], index: int, *,
                        tools: Sequence[dict] | None = None) -> str:
        """The turn after the prompt, ended by the opener the model samples: ``<|observation|>`` after calls."""
        prompt, own = self._turn_texts(messages, index, tools)
        return own[len(prompt):] + (OBSERVATION if messages[index].tool_calls else USER)

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        sampled = self.tokenizer.convert_ids_to_tokens(int(previous_ids[-1]))
        out = []
        for i, message in enumerate(new_messages):
            text = self.turn_text(message, opens=i == 0 or new_messages[i - 1].role != "tool")
            if i == 0 and sampled in (USER, OBSERVATION) and text.startswith(sampled):
                text = text[len(sampled):]  # the model already wrote this opener as its stop token
            out.append(Piece(text))
        return out + [Piece(self.generation_prompt())]

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text)
        if reasoning is not None:
            reasoning, rest = reasoning.strip(), rest.lstrip("\n")
        content, bodies, call_problems = extract_tagged(rest, "<tool_call>", "</tool_call>")
        calls = []
        for body in bodies:
            call, problem = parse_call(body)
            calls.append(call) if call is not None else call_problems.append(problem)
        problems += call_problems
        if not finished:
            problems.append("completion ended without <|user|> or <|observation|> (cut by max tokens?)")
        return Message(role="assistant", content=content.strip() if bodies else content, reasoning=reasoning,
                       tool_calls=tuple(calls), problems=tuple(problems))


def parse_call(body: str) -> tuple[ToolCall | None, str | None]:
    """One ``NAME\\n<arg_key>…</arg_key>\\n<arg_value>…</arg_value>…`` call body."""
    name, _, arguments = body.partition("\n")
    if not name.strip() or ARGUMENT.sub("", arguments).strip():
        return None, f"malformed tool call (expected a name and <arg_key>/<arg_value> pairs): {body[:80]!r}"
    values = {key: loose_value(value) for key, value in ARGUMENT.findall(arguments)}
    return ToolCall(name=name.strip(), arguments=values, raw=f"<tool_call>{body}</tool_call>"), None


