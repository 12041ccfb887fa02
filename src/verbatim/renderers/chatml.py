"""ChatML families: SmolLM2, Qwen2.5 and Qwen3-Instruct-2507.

Turns are ``<|im_start|>role\\n … <|im_end|>\\n``; the model stops at
``<|im_end|>`` and the template writes the ``\\n`` after it, which ``bridge``
adds. SmolLM2's template writes only ``content`` (no tool syntax) and injects a
default system prompt; the Qwen templates add tools to the system turn, write
tool calls as ``<tool_call>`` JSON and merge consecutive tool results into one
``user`` turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message, ToolCall
from verbatim.renderers.base import PREAMBLE, ChatFormat, Piece
from verbatim.renderers.completion import arguments_json, extract_tagged, parse_json_call, tojson

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
QWEN_END_TOKENS = ((151645, IM_END), (151643, "<|endoftext|>"))
"""``eos_token_id`` of Qwen2.5-*-Instruct, Qwen3-* and Qwen3-*-Instruct-2507 (their generation_config.json)."""

QWEN_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


def turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


class ChatML(ChatFormat):
    """SmolLM2-Instruct: plain ChatML with SmolLM's default system prompt."""

    name = "smollm2"
    templates = ("smollm2_instruct.jinja",)
    prefix_stable = True
    end_tokens = ((2, IM_END),)  # HuggingFaceTB/SmolLM2-*-Instruct generation_config.json: eos_token_id 2
    close_text = IM_END
    markup = ("<tool_call>", "</tool_call>")  # not tokens of SmolLM2's vocabulary: parsed as text there
    after_stop = "\n"
    default_system: str | None = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = []
        if self.default_system is not None and messages[0].role != "system":
            out.append(Piece(turn("system", self.default_system)))
        out += [Piece(self.message_text(m), i) for i, m in enumerate(messages)]
        if add_generation_prompt:
            out.append(Piece(self.generation_prompt(), len(messages)))
        return out

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        return [Piece(self.message_text(m)) for m in new_messages] + [Piece(self.generation_prompt())]

    def message_text(self, message: Message) -> str:
        return turn(message.role, message.content)

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n"

    def parse_text(self, text: str, *, finished: bool) -> Message:
        content, calls, problems = parse_hermes_calls(text)
        if not finished:
            problems.append("completion ended without <|im_end|> (cut by max tokens?)")
        return Message(role="assistant", content=content, tool_calls=tuple(calls), problems=tuple(problems))


def hermes_call(call: ToolCall, *, as_given: bool = False) -> str:
    """A tool call as Qwen's templates write it (see :func:`arguments_json` for ``as_given``)."""
    arguments = arguments_json(call, as_given=as_given)
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'


def parse_hermes_calls(text: str) -> tuple[str, list, list[str]]:
    """Content, tool calls and problems for text holding ``<tool_call>\\n{json}\\n</tool_call>`` blocks."""
    content, bodies, problems = extract_tagged(text, "<tool_call>", "</tool_call>")
    calls = []
    for body in bodies:
        call, problem = parse_json_call(body.strip())
        if call is not None:
            calls.append(call.model_copy(update={"raw": f"<tool_call>{body}</tool_call>"}))
        else:
            problems.append(problem)
    return (content.rstrip("\n") if bodies else content), calls, problems


class QwenChat(ChatML):
    """Qwen2.5-Instruct: ChatML with a default system prompt, tools, tool calls and merged tool results."""

    name = "qwen2.5"
    templates = ("qwen2_5_instruct.jinja",)
    prefix_stable = True
    end_tokens = QWEN_END_TOKENS
    default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

    def pieces(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool) -> list[Piece]:
        out = [self.system_piece(messages, tools)]
        start = 1 if messages[0].role == "system" else 0
        out += [Piece(self.qwen_message_text(messages, i), i) for i in range(start, len(messages))]
        if add_generation_prompt:
            out.append(Piece(self.generation_prompt(), len(messages)))
        return out

    def system_piece(self, messages: list[Message], tools: list[dict] | None) -> Piece:
        first = messages[0]
        system = first.content if first.role == "system" else None
        owner = 0 if system is not None else PREAMBLE
        if tools:
            return Piece(f"{IM_START}system\n{self.tools_system_text(system)}" + self.tools_text(tools), owner)
        if system is not None:
            return Piece(turn("system", system), owner)
        return Piece(turn("system", self.default_system) if self.default_system else "")

    def tools_system_text(self, system: str | None) -> str:
        return (system if system is not None else self.default_system) + "\n\n"

    def tools_text(self, tools: list[dict]) -> str:
        return QWEN_TOOLS_INTRO + "".join("\n" + tojson(tool) for tool in tools) + QWEN_TOOLS_OUTRO

    def qwen_message_text(self, messages: list[Message], i: int) -> str:
        message = messages[i]
        if message.role == "tool":
            first = i == 0 or messages[i - 1].role != "tool"
            last = i == len(messages) - 1 or messages[i + 1].role != "tool"
            opener = f"{IM_START}user" if first else ""
            return f"{opener}\n<tool_response>\n{message.content}\n</tool_response>" + (f"{IM_END}\n" if last else "")
        if message.role == "assistant" and message.tool_calls:
            return self.tool_call_turn(message.content, message)
        return self.message_text(message)

    def tool_call_turn(self, content: str, message: Message) -> str:
        text = f"{IM_START}assistant" + (f"\n{content}" if content else "")
        for call in message.tool_calls:
            text += "\n" + hermes_call(call, as_given=self.arguments_as_given)
        return text + f"{IM_END}\n"

    def bridge_pieces(self, previous_ids: Sequence[int], new_messages: list[Message],
                      tools: list[dict] | None) -> list[Piece]:
        out = [Piece(self.qwen_message_text(new_messages, i)) for i in range(len(new_messages))]
        return out + [Piece(self.generation_prompt())]


class Qwen3Instruct(QwenChat):
    """Qwen3-*-Instruct-2507 (non-thinking): Qwen's ChatML with tools and no default system prompt."""

    name = "qwen3-instruct-2507"
    templates = ("qwen3_instruct_2507.jinja",)
    default_system = None
    arguments_as_given = True

    def tools_system_text(self, system: str | None) -> str:
        return system + "\n\n" if system is not None else ""
