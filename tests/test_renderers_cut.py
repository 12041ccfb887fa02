"""A completion cut by max tokens while the model reasons (issue 14, item 3).

The sampled tokens stay as they are; ``bridge`` closes the reasoning the way the
family's official template writes an assistant turn whose reasoning ended there
(``\\n</think>\\n\\n`` for Qwen3, Qwen3.6, QwQ and DeepSeek-R1, ``</think>`` for GLM-4.5
and DeepSeek-V3.1 thinking, ``<|end|>`` and an empty final message for gpt-oss), then
ends the turn. Where the template drops reasoning from history (R1, QwQ, V3.1), the
turn is the one the model samples for a reasoning that ended there (``completion_ids``).
``parse_completion`` reports the cut and keeps the partial reasoning.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from verbatim.datamodel import Message
from verbatim.renderers.completion import close_think
from verbatim.renderers.registry import get_renderer

USER, MORE = Message(role="user", content="Plan the call."), Message(role="user", content="Go on.")
PARTIAL = "Let me plan the call"


def template_ids(renderer, template: str, messages: list[Message], *, generation: bool) -> list[int]:
    return list(renderer.tokenizer.apply_chat_template(
        renderer.template_messages(messages), chat_template=template, add_generation_prompt=generation,
        tokenize=True, return_dict=False, **renderer.template_kwargs()))


def cut_history(renderer, sampled: str) -> tuple[list[int], list[int], Message]:
    """(prompt + the cut completion, what bridge appends for one more user message, the parsed completion)."""
    prompt = list(renderer.render([USER], add_generation_prompt=True).token_ids)
    cut = renderer.encode(sampled)
    assert not set(cut) & set(renderer.stop_token_ids)
    return prompt + cut, renderer.bridge(prompt + cut, [MORE]), renderer.parse_completion(cut)


def closed_turn(parsed: Message) -> Message:
    return Message(role="assistant", content=parsed.content, reasoning=parsed.reasoning)


@pytest.mark.parametrize(("sampled", "same_tokens"), [
    ("<think>\n" + PARTIAL, True),
    ("<think>\n" + PARTIAL + "\n", True),  # the newline the template writes before </think> was sampled
    ("<think>\n" + PARTIAL + "\n</think>", True),  # closed just before the cut: only the newlines are missing
    # cut right after the opener: the template's empty think block, whose "\n\n" is one token where the
    # sampled "\n" and the appended one stay two (bpe_boundary_merge): the same text
    ("<think>\n", False),
])
def test_qwen3_cut_while_reasoning_closes_the_think_block(sampled: str, same_tokens: bool, default_model_dir: Path,
                                                          chat_templates_dir: Path) -> None:
    renderer = get_renderer("qwen3", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == sampled.removeprefix("<think>").removesuffix("</think>").strip("\n")
    assert parsed.content == "" and any("without <|im_end|>" in p for p in parsed.problems)
    if "</think>" not in sampled:
        assert any("unterminated think block" in p for p in parsed.problems)
    history, decode, im_end = held + added, renderer.tokenizer.decode, renderer.stop_token_ids[0]
    for name in renderer.templates:  # the official template's turn whose reasoning ended there
        template = (chat_templates_dir / name).read_text(encoding="utf-8")
        turn = template_ids(renderer, template, [USER, closed_turn(parsed)], generation=False)
        assert decode(history).startswith(decode(turn)), name
        assert history[:len(turn)] == turn or not same_tokens, name
        full = template_ids(renderer, template, [USER, closed_turn(parsed), MORE], generation=True)
        after = history[history.index(im_end, len(held)) + 1:]  # then the template's next turn
        assert after == full[len(full) - len(after):] and decode(after).startswith("\n<|im_start|>user")
    keep = get_renderer("qwen3", model_dir=default_model_dir, keep_reasoning=True)
    assert keep.bridge(held, [MORE]) == added
    if parsed.reasoning:  # keep_reasoning renders what the history holds (it writes no empty block for a past turn)
        assert history == list(keep.render([USER, closed_turn(parsed), MORE], add_generation_prompt=True).token_ids)


def test_qwen3_without_thinking_is_closed_as_before(default_model_dir: Path) -> None:
    """The prompt's empty think block is closed: a cut answer gets <|im_end|> alone."""
    renderer = get_renderer("qwen3", model_dir=default_model_dir, enable_thinking=False)
    held, added, _ = cut_history(renderer, "Once upon a")
    assert renderer.tokenizer.decode(added) == ("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n"
                                                "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("sampled", [PARTIAL, "\n" + PARTIAL + "\n\n"])
def test_deepseek_r1_cut_while_reasoning_closes_the_think_block(sampled: str, default_model_dir: Path,
                                                                chat_templates_dir: Path) -> None:
    """R1's prompt opens <think>; the template cuts reasoning from history, so the turn is the sampled form."""
    renderer = get_renderer("deepseek-r1", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == sampled.strip("\n") and parsed.content == ""
    assert any("unterminated think block" in p for p in parsed.problems)
    prompt = list(renderer.render([USER], add_generation_prompt=True).token_ids)
    turn = prompt + renderer.completion_ids([USER, closed_turn(parsed)], 1)
    history = held + added
    if sampled == PARTIAL:
        assert history[:len(turn)] == turn  # reasoning + "\n</think>\n\n" + <｜end▁of▁sentence｜>
    else:  # newlines the model sampled stay: nothing is removed, none added before </think>
        assert renderer.tokenizer.decode(history).count(sampled + "</think>\n\n<｜end▁of▁sentence｜>") == 1
    template = (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")
    assistant = Message(role="assistant", content=f"<think>\n{parsed.reasoning}\n</think>\n\n")
    full = template_ids(renderer, template, [USER, assistant, MORE], generation=True)
    end = renderer.encode("<｜end▁of▁sentence｜>")[0]
    after = history[history.index(end, len(prompt)) + 1:]
    assert after == full[len(full) - len(after):] and renderer.tokenizer.decode(after).startswith("<｜User｜>")


def official_template(renderer, chat_templates_dir: Path) -> str:
    return (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")


def next_turn_is_the_templates(renderer, template: str, history: list[int], turn_end: int, closed: Message,
                               user_turn: str) -> None:
    """The tokens after the cut turn (``history[turn_end:]``) are the template's: its user turn, then its prompt."""
    full = template_ids(renderer, template, [USER, closed, MORE], generation=True)
    after = history[turn_end:]
    assert after == full[len(full) - len(after):] and renderer.tokenizer.decode(after).startswith(user_turn)


@pytest.mark.parametrize("sampled", [PARTIAL, PARTIAL + "\n", PARTIAL + "\n</think>"])
def test_qwen36_cut_while_reasoning_closes_the_think_block(sampled: str, default_model_dir: Path,
                                                           chat_templates_dir: Path) -> None:
    """Qwen3.6's prompt opens <think>\\n; its template keeps the last turn's reasoning (and every turn's with
    preserve_thinking), so the bridged history is the template's own text, token for token."""
    renderer = get_renderer("qwen3.6", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == PARTIAL and parsed.content == "" and parsed.problems
    template, history = official_template(renderer, chat_templates_dir), held + added
    turn = template_ids(renderer, template, [USER, closed_turn(parsed)], generation=False)
    assert history[:len(turn)] == turn  # ... "\n</think>\n\n<|im_end|>\n"
    next_turn_is_the_templates(renderer, template, history, len(turn), closed_turn(parsed), "<|im_start|>user")
    keep = get_renderer("qwen3.6", model_dir=default_model_dir, keep_reasoning=True)
    assert keep.bridge(held, [MORE]) == added
    assert history == template_ids(keep, template, [USER, closed_turn(parsed), MORE], generation=True)


@pytest.mark.parametrize("sampled", [PARTIAL, PARTIAL + "\n</think>"])
def test_qwq_cut_while_reasoning_closes_the_think_block(sampled: str, default_model_dir: Path,
                                                        chat_templates_dir: Path) -> None:
    """QwQ's template never writes reasoning (as R1's): the turn is what QwQ samples for it, then <|im_end|>."""
    renderer = get_renderer("qwq", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == PARTIAL and parsed.content == "" and parsed.problems
    prompt = list(renderer.render([USER], add_generation_prompt=True).token_ids)
    turn = prompt + renderer.completion_ids([USER, closed_turn(parsed)], 1)  # reasoning\n</think>\n\n<|im_end|>
    history = held + added
    assert history[:len(turn)] == turn
    next_turn_is_the_templates(renderer, official_template(renderer, chat_templates_dir), history, len(turn),
                               closed_turn(parsed), "\n<|im_start|>user")


@pytest.mark.parametrize("sampled", ["\n<think>" + PARTIAL, "\n<think>"])
def test_glm_cut_while_reasoning_closes_the_think_block(sampled: str, default_model_dir: Path,
                                                        chat_templates_dir: Path) -> None:
    """GLM-4.5 writes the last turn's reasoning tight, <think>reasoning</think>, and has no end-of-turn token:
    the closer alone, then the next turn's opener."""
    renderer = get_renderer("glm-4.5", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == sampled.removeprefix("\n<think>") and parsed.content == ""
    template, history = official_template(renderer, chat_templates_dir), held + added
    turn = template_ids(renderer, template, [USER, closed_turn(parsed)], generation=False)
    assert history[:len(turn)] == turn and renderer.tokenizer.decode(turn).endswith("</think>")
    next_turn_is_the_templates(renderer, template, history, len(turn), closed_turn(parsed), "<|user|>\nGo on.")


@pytest.mark.parametrize("sampled", [PARTIAL, "\n" + PARTIAL])
def test_deepseek_v31_thinking_cut_while_reasoning_closes_the_think_block(sampled: str, default_model_dir: Path,
                                                                          chat_templates_dir: Path) -> None:
    """V3.1's thinking prompt opens <think>; its template drops reasoning from history (as R1's), so the turn is
    what the model samples for it: reasoning</think>, empty content, <｜end▁of▁sentence｜>."""
    renderer = get_renderer("deepseek-v3.1-thinking", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == sampled and parsed.content == "" and parsed.problems
    prompt = list(renderer.render([USER], add_generation_prompt=True).token_ids)
    turn = prompt + renderer.completion_ids([USER, closed_turn(parsed)], 1)
    history = held + added
    assert history[:len(turn)] == turn and renderer.tokenizer.decode(turn).endswith("</think><｜end▁of▁sentence｜>")
    next_turn_is_the_templates(renderer, official_template(renderer, chat_templates_dir), history, len(turn),
                               closed_turn(parsed), "<｜User｜>Go on.")


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.utils.chat_template_utils as chat_utils

    class FrozenClock(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return dt.datetime(2024, 7, 26, 12, 0, 0)  # the renderer's default `today`

    monkeypatch.setattr(chat_utils, "datetime", FrozenClock)


@pytest.mark.parametrize("sampled", ["<|channel|>analysis<|message|>" + PARTIAL,
                                     "<|channel|>analysis<|message|>" + PARTIAL + "<|end|>"])
def test_gpt_oss_cut_on_the_analysis_channel_gets_an_empty_final(sampled: str, default_model_dir: Path,
                                                                 chat_templates_dir: Path, frozen_clock) -> None:
    renderer = get_renderer("gpt-oss", model_dir=default_model_dir)
    held, added, parsed = cut_history(renderer, sampled)
    assert parsed.reasoning == PARTIAL and parsed.content == ""
    assert any("without an end token" in p for p in parsed.problems)
    template = (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")
    turn = template_ids(renderer, template, [USER, closed_turn(parsed)], generation=False)
    ret, end = renderer.encode("<|return|>") + renderer.encode("<|end|>")
    assert turn[-1] == ret
    history = held + added
    assert history[:len(turn)] == turn[:-1] + [end]  # the template's turn, its <|return|> as history writes it
    full = template_ids(renderer, template, [USER, closed_turn(parsed), MORE], generation=True)
    assert history[len(turn):] == full[len(full) - len(history) + len(turn):]


def test_gpt_oss_cut_on_the_final_channel_is_closed_by_end(default_model_dir: Path) -> None:
    renderer = get_renderer("gpt-oss", model_dir=default_model_dir)
    _, added, parsed = cut_history(renderer, "<|channel|>final<|message|>Once upon a")
    assert renderer.tokenizer.decode(added).startswith("<|end|><|start|>user")
    assert parsed.content == "Once upon a" and parsed.problems


@pytest.mark.parametrize(("sampled", "appended"), [
    ("\nplan", "\n</think>\n\n"), ("\nplan\n", "</think>\n\n"), ("", "\n\n</think>\n\n"),
    ("\nplan\n\n\n", "</think>\n\n"),  # newlines the template strips stay; none is added
    ("\nplan\n</think>", "\n\n"), ("\nplan\n</think>\n", "\n"), ("\nplan\n</think>\n\nok", ""),
])
def test_close_think_appends_only(sampled: str, appended: str) -> None:
    assert close_think(sampled) == appended


@pytest.mark.parametrize(("sampled", "appended"), [("plan", "</think>"), ("", "</think>"), ("plan</think>", ""),
                                                   ("plan</think>\nok", "")])
def test_close_think_tight_appends_the_closer_only(sampled: str, appended: str) -> None:
    assert close_think(sampled, padded=False) == appended
