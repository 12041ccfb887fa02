"""QwQ-32B: Qwen2.5's ChatML and tools, with reasoning opened by the generation prompt.

The generation prompt is ``<|im_start|>assistant\\n<think>\\n``, so the model samples
``reasoning\\n</think>\\n\\nanswer<|im_end|>``. The template itself never writes
reasoning: it ignores ``reasoning_content``, cuts every assistant turn but the last
to the text after ``</think>`` (``.lstrip('\\n')``), and writes the last one as its
content stands. A re-rendered history therefore lacks the ``<think>\\n`` and the
reasoning the model sampled (``generation_prompt_dropped``, ``reasoning_stripped``).
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.datamodel import Message
from verbatim.renderers.chatml import IM_END, IM_START, QWEN_END_TOKENS, QwenChat, hermes_call, parse_hermes_calls
from verbatim.renderers.completion import split_think
from verbatim.renderers.qwen3 import reasoning_and_content


class QwQ(QwenChat):
    name = "qwq"
    templates = ("qwq_32b.jinja",)
    prefix_stable = False  # the prompt's <think>\n and the sampled reasoning never reappear in history
    end_tokens = QWEN_END_TOKENS  # Qwen/QwQ-32B generation_config.json: eos_token_id [151645, 151643]
    markup = ("<tool_call>", "</tool_call>", "<think>", "</think>")
    default_system = None
    # A reply cut while reasoning gets "\n</think>\n\n" before <|im_end|>: what QwQ samples for a reasoning that
    # ended there (the template writes no reasoning, so it has no form of its own; as DeepSeek-R1).
    think = ("<think>", "</think>")
    turn_starts = (IM_START,)

    def tools_system_text(self, system: str | None) -> str:
        return (system or "") + "\n\n"

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n<think>\n"

    def qwen_message_text(self, messages: list[Message], i: int) -> str:
        message = messages[i]
        if message.role != "assistant":
            return super().qwen_message_text(messages, i)
        last = i == len(messages) - 1
        content = message.content if last else message.content.split("</think>")[-1].lstrip("\n")
        if not message.tool_calls:
            return f"{IM_START}assistant\n{content}{IM_END}\n"
        text = f"{IM_START}assistant" + (f"\n{content}" if message.content else "")
        return text + "".join("\n" + hermes_call(call) for call in message.tool_calls) + f"{IM_END}\n"

    def completion_text(self, messages: Sequence[Message], index: int, *,
                        tools: Sequence[dict] | None = None) -> str:
        """What the model samples after the prompt's ``<think>\\n``: reasoning, answer, calls, ``<|im_end|>``.

        The template's own turn cannot serve: it has no reasoning and does not start with the prompt.
        """
        message = messages[index]
        reasoning, content = reasoning_and_content(message)
        parts = ([content] if content else []) + [hermes_call(call) for call in message.tool_calls]
        return f"{reasoning}\n</think>\n\n" + "\n".join(parts) + IM_END

    def parse_text(self, text: str, *, finished: bool) -> Message:
        reasoning, rest, problems = split_think(text, opened=True)
        content, calls, call_problems = parse_hermes_calls(rest.lstrip("\n"))
        problems += call_problems
        if not finished:
            problems.append("completion ended without <|im_end|> (cut by max tokens?)")
        return Message(role="assistant", content=content, reasoning=(reasoning or "").strip("\n"),
                       tool_calls=tuple(calls), problems=tuple(problems))
