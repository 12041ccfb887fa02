"""Mistral instruct formats: v3 (SentencePiece, Mistral-7B-Instruct-v0.3), Nemo (v3 on tekken,
Mistral-Nemo-Instruct-2407) and v7-tekken (Mistral Small 3.2).

Both write ``<s>`` once, ``[INST] … [/INST]`` per user turn and ``</s>`` after
each assistant turn, and have no generation prompt: the model starts right
after ``[/INST]`` (or ``[/TOOL_RESULTS]``). Roles must alternate user/assistant.

Where the official templates are not prefix-stable:
- v3 puts the system prompt into the *last* user turn, and only when the
  conversation ends with that user turn; ``[AVAILABLE_TOOLS]`` also goes before
  the last user turn. ``bridge`` matches this on the current turn: tools go before
  the newest user message, and a system message passed with the new messages is
  written into it; the copy an earlier render wrote stays where it is.
- Nemo is v3 without the spaces around ``[INST]``/``[TOOL_CALLS]``/``[TOOL_RESULTS]``
  and without trimming the assistant's text: the same moves, the same ``bridge``.
- v7-tekken writes the system prompt once at the top (stable) but injects a
  default one that contains today's date when none is given; ``today`` fixes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, parse_json_arguments, tojson, tool_call_from_object

BOS, EOS = "<s>", "</s>"


def check_alternation(messages: list[Message], family: str) -> None:
    """The templates' rule: after the optional system message, user and assistant alternate."""
    turn = 0
    for message in messages:
        if message.role == "tool" or message.tool_calls:
            continue
        if (message.role == "user") != (turn % 2 == 0):
            raise RenderError(f"{family}: after the optional system message, roles must alternate "
                              "user/assistant/user/assistant/...")
        turn += 1


def check_call_id(call_id: str | None, family: str) -> str:
    if not isinstance(call_id, str) or len(call_id) != 9:
        raise RenderError(f"{family}: tool call ids must be strings of 9 alphanumerics, got {call_id!r}")
    return call_id


class MistralV3(ChatFormat):
    name = "mistral-v3"
    templates = ("mistral_7b_instruct_v0_3.jinja",)
    prefix_stable = False  # the system prompt and tool list move to the newest user turn
    end_tokens = ((2, EOS),)  # mistralai/Mistral-7B-Instruct-v0.3 generation_config.json: eos_token_id 2
    close_text = EOS
    markup = ("[TOOL_CALLS]",)
    bridge_roles = ("user", "tool", "system")
    strip_content = True  # the template writes `" " + content.strip()`, so parsing trims too
    gap = " "  # after [INST], [TOOL_RESULTS], [TOOL_CALLS] and before an assistant reply (Nemo: none)

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        system = messages[0].content if messages[0].role == "system" else None
        start = 0 if system is None else 1
        body = messages[start:]
        check_alternation(body, self.name)
        users = [m for m in body if m.role == "user"]
        out = [Piece(BOS)]
        for offset, message in enumerate(body):
            is_last = offset == len(body) - 1
            with_tools = tools if users and message == users[-1] else None
            prefix = system if (is_last and system is not None) else None
            out.append(Piece(self.message_text(message, with_tools, prefix), start + offset))
        return out

    def message_text(self, message: Message, tools: list[dict] | None, system: str | None) -> str:
        if message.role == "user":
            listing = self.tools_text(tools) if tools else ""
            prompt = f"{system}\n\n{message.content}" if system is not None else message.content
            return f"{listing}[INST]{self.gap}{prompt}[/INST]"
        if message.role == "tool":
            call_id = check_call_id(message.tool_call_id, self.name)
            return (f'[TOOL_RESULTS]{self.gap}{{"content": {message.content}, "call_id": "{call_id}"}}'
                    "[/TOOL_RESULTS]")
        if message.role == "assistant" and message.tool_calls:
            return "[TOOL_CALLS]" + self.gap + self.calls_json(message) + EOS
        if message.role == "assistant":
            content = message.content.strip() if self.strip_content else message.content
            return self.gap + content + EOS
        raise RenderError(f"{self.name}: only user, assistant and tool roles (and one leading system "
                          "message) are supported")

    def calls_json(self, message: Message) -> str:
        calls = [f'{{"name": {tojson(c.name)}, "arguments": {arguments_json(c, as_given=False)}, '
                 f'"id": "{check_call_id(c.id, self.name)}"}}' for c in message.tool_calls]
        return "[" + ", ".join(calls) + "]"

    def tools_text(self, tools: list[dict]) -> str:
        return f"[AVAILABLE_TOOLS]{self.gap}[" + ", ".join(self.tool_text(t) for t in tools) + "][/AVAILABLE_TOOLS]"

    @staticmethod
    def tool_text(tool: dict) -> str:
        fields = [f'"{key}": "{value}"' if isinstance(value, str) else f'"{key}": {tojson(value)}'
                  for key, value in tool["function"].items() if key != "return"]
        return '{"type": "function", "function": {' + ", ".join(fields) + "}}"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        """Tools go before the newest user message; a system message given here goes into it, when it is last.

        That is the template's current turn. The system prompt already written into an
        earlier user turn stays there: history is never rewritten.
        """
        systems = [m.content for m in new_messages if m.role == "system"]
        turns = [m for m in new_messages if m.role != "system"]
        users = [m for m in turns if m.role == "user"]
        out = []
        for index, message in enumerate(turns):
            is_last = index == len(turns) - 1
            system = systems[-1] if systems and is_last and message.role == "user" else None
            out.append(Piece(self.message_text(message, tools if users and message is users[-1] else None, system)))
        return out

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = [] if finished else ["completion ended without </s> (cut by max tokens?)"]
        if "[TOOL_CALLS]" not in text:
            return Message(role="assistant", content=text.strip() if self.strip_content else text,
                           problems=tuple(problems))
        content, raw = text.split("[TOOL_CALLS]", 1)
        calls = []
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append(f"malformed tool call (invalid JSON: {exc.msg}): {raw[:80]!r}")
            values = []
        for value in values if isinstance(values, list) else [values]:
            call, problem = tool_call_from_object(value, json.dumps(value, ensure_ascii=False))
            if call is not None:
                calls.append(call.model_copy(update={"raw": "[TOOL_CALLS]" + raw}))
            else:
                problems.append(problem)
        return Message(role="assistant", content=content.strip() if self.strip_content else content,
                       tool_calls=tuple(calls), problems=tuple(problems))


class MistralNemo(MistralV3):
    """Mistral-Nemo-Instruct-2407: v3's template with no spaces inside the markers, on the v3 tekken vocabulary."""

    name = "mistral-nemo"
    templates = ("mistral_nemo_instruct_2407.jinja",)
    end_tokens = ((2, EOS),)  # mistralai/Mistral-Nemo-Instruct-2407 generation_config.json: eos_token_id 2
    strip_content = False  # the template writes `content + eos_token`, untrimmed
    gap = ""


TEKKEN_DEFAULT_SYSTEM = (
    "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup "
    "headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The current date is {today}."
    "\n\nWhen you're not sure about some information or when the user's request requires up-to-date or "
    "specific data, you must use the available tools to fetch the information. Do not hesitate to use tools "
    "whenever they can provide a more accurate or complete response. If no relevant tools are available, then "
    "clearly state that you don't have the information and avoid making up anything.\n\nIf the user's question "
    "is not clear, ambiguous, or does not provide enough context for you to accurately answer the question, you "
    "do not try to answer it right away and you rather ask the user to clarify their request (e.g. \"What are "
    "some good restaurants around me?\" => \"Where are you?\" or \"When is the next flight to Tokyo\" => \"Where "
    "do you travel from?\").\nYou are always very attentive to dates, and when asked about information at "
    "specific dates, you discard information that is at another date.\nYou follow these instructions in all "
    "languages, and always respond to the user in the language they use or request.\nNext sections describe "
    "the capabilities that you have.\n\n# WEB BROWSING INSTRUCTIONS\n\nYou cannot perform any web search or "
    "access internet to open URLs, links etc. If it seems like the user is expecting you to do so, you clarify "
    "the situation and ask the user to copy paste the text directly in the chat.\n\n# MULTI-MODAL "
    "INSTRUCTIONS\n\nYou have the ability to read images, but you cannot generate images. You also cannot "
    "transcribe audio files or videos.\nYou cannot read nor transcribe audio files or videos.\n\n# TOOL CALLING "
    "INSTRUCTIONS\n\nYou may have access to tools that you can use to fetch information or perform actions. You "
    "must use these tools in the following situations:\n\n1. When the request requires up-to-date "
    "information.\n2. When the request requires specific data that you do not have in your knowledge base.\n3. "
    "When the request involves actions that you cannot perform without tools.\n\nAlways prioritize using tools "
    "to provide the most accurate and helpful response. If tools are not available, inform the user that you "
    "cannot perform the requested action at the moment."
)


class MistralTekken(MistralV3):
    name = "mistral-v7-tekken"
    templates = ("mistral_small_3_2_2506.jinja",)
    prefix_stable = False  # the tool list moves to the newest user turn; the default system prompt has a date
    end_tokens = ((2, EOS),)  # mistralai/Mistral-Small-3.2-24B-Instruct-2506 generation_config.json: eos_token_id 2
    markup = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    bridge_roles = ("user", "tool")

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        users = [m for m in new_messages if m.role == "user"]
        return [Piece(self.message_text(m, tools if users and m is users[-1] else None, None))
                for m in new_messages]

    def __init__(self, tokenizer: Any, *, today: str = "2024-07-26") -> None:
        super().__init__(tokenizer)
        self.today = today

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        has_system = messages[0].role == "system"
        system = messages[0].content if has_system else TEKKEN_DEFAULT_SYSTEM.format(today=self.today)
        body = messages[1:] if has_system else messages
        check_alternation(body, self.name)
        users = [m for m in body if m.role == "user"]
        start = 1 if has_system else 0
        out = [Piece(BOS), Piece(f"[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]", 0 if has_system else PREAMBLE)]
        for offset, message in enumerate(body):
            with_tools = tools if users and message == users[-1] else None
            out.append(Piece(self.message_text(message, with_tools, None), start + offset))
        return out

    def message_text(self, message: Message, tools: list[dict] | None, system: str | None) -> str:
        if message.role == "system":
            return f"[SYSTEM_PROMPT]{message.content}[/SYSTEM_PROMPT]"
        if message.role == "user":
            listing = f"[AVAILABLE_TOOLS]{tojson(tools)}[/AVAILABLE_TOOLS]" if tools else ""
            return f"{listing}[INST]{message.content}[/INST]"
        if message.role == "tool":
            call_id = check_call_id(message.tool_call_id, self.name)
            return f"[TOOL_RESULTS]{call_id}[TOOL_CONTENT]{message.content}[/TOOL_RESULTS]"
        if message.tool_calls:
            return "".join(f"[TOOL_CALLS]{c.name}[CALL_ID]{check_call_id(c.id, self.name)}[ARGS]"
                           f"{arguments_json(c, as_given=False)}" for c in message.tool_calls) + EOS
        return message.content + EOS

    def parse_text(self, text: str, *, finished: bool) -> Message:
        problems = [] if finished else ["completion ended without </s> (cut by max tokens?)"]
        content, *blocks = text.split("[TOOL_CALLS]")
        calls = []
        for block in blocks:
            name, _, rest = block.partition("[CALL_ID]")
            call_id, _, arguments = rest.partition("[ARGS]") if rest else ("", "", "")
            if not rest:
                name, _, arguments = block.partition("[ARGS]")
            call, problem = parse_json_arguments(name, arguments, "[TOOL_CALLS]" + block, call_id or None)
            calls.append(call) if call is not None else problems.append(problem)
        return Message(role="assistant", content=content, tool_calls=tuple(calls), problems=tuple(problems))
