"""Every family renders every corpus conversation exactly as its official template does, token for token."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from verbatim.errors import RenderError
from verbatim.renderers.conversations import load_conversations
from verbatim.renderers.registry import FAMILIES, get_renderer

CORPUS = Path(__file__).parent / "data" / "conversations.jsonl"
FROZEN = dt.datetime(2024, 7, 26, 12, 0, 0)  # the date the renderers default to (Mistral Small, gpt-oss)
CASES = [(name, template) for name in sorted(FAMILIES) for template in FAMILIES[name].load().templates]
FEWER = {"gemma2": 48}  # renders compared, where the template refuses many conversations (system, tool roles)


class FrozenClock(dt.datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206
        return FROZEN


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.utils.chat_template_utils as chat_utils

    monkeypatch.setattr(chat_utils, "datetime", FrozenClock)


def test_corpus_covers_the_required_kinds() -> None:
    conversations = load_conversations(CORPUS)
    assert len(conversations) >= 40
    messages = [m for c in conversations for m in c.messages]
    turns = [sum(m["role"] == "user" for m in c.messages) for c in conversations]
    assert min(turns) == 1 and max(turns) == 12
    assert any(c.messages[0]["role"] == "system" for c in conversations)
    assert any(c.messages[0]["role"] != "system" for c in conversations)
    assert any(c.tools for c in conversations)
    assert any(m.get("tool_calls") for m in messages) and any(m["role"] == "tool" for m in messages)
    assert any(m.get("reasoning_content") for m in messages) and any("</think>" in m["content"] for m in messages)
    assert any(any(ord(ch) > 0x1F000 for ch in m["content"]) for m in messages)  # emoji
    assert any(m["content"] != m["content"].strip() for m in messages)
    assert any("  " in m["content"] for m in messages)
    assert any(m["content"] == "" for m in messages)
    assert any(len(m["content"]) > 5000 for m in messages)


@pytest.mark.parametrize(("family", "template"), CASES, ids=[f"{f}:{t}" for f, t in CASES])
def test_render_matches_the_official_template(family: str, template: str, default_model_dir: Path,
                                              chat_templates_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    text = (chat_templates_dir / template).read_text(encoding="utf-8")
    matched, refused, failures = 0, 0, []
    for number, conversation in enumerate(load_conversations(CORPUS)):
        messages = conversation.as_messages()
        for generation in (False, True):
            try:
                expected = renderer.tokenizer.apply_chat_template(
                    renderer.template_messages(messages), tools=list(conversation.tools or []) or None,
                    chat_template=text, add_generation_prompt=generation, tokenize=True, return_dict=False,
                    **renderer.template_kwargs())
            except Exception as exc:  # the template refuses this conversation: so must we
                with pytest.raises(RenderError):
                    renderer.render(messages, tools=conversation.tools, add_generation_prompt=generation)
                refused += 1
                assert "raise" in type(exc).__name__.lower() or exc.__class__.__module__.startswith("jinja2")
                continue
            ours = renderer.render(messages, tools=conversation.tools, add_generation_prompt=generation)
            if list(ours.token_ids) == list(expected):
                matched += 1
            else:
                at = next((i for i, (a, b) in enumerate(zip(ours.token_ids, expected)) if a != b),
                          min(len(ours), len(expected)))
                failures.append(f"#{number} {conversation.note!r} generation={generation}: first difference at "
                                f"token {at}: ours {renderer.tokenizer.decode(ours.token_ids[at:at + 8])!r}, "
                                f"template {renderer.tokenizer.decode(expected[at:at + 8])!r}")
    assert not failures, "\n".join(failures[:5])
    assert matched >= FEWER.get(family, 60), f"only {matched} renders compared ({refused} refused by the template)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_message_index_marks_each_message(family: str, default_model_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    number = 3 if family == "gemma2" else 2  # system + two turns; Gemma 2 refuses system: three turns
    messages = load_conversations(CORPUS)[number].as_messages()
    rendered = renderer.render(messages, add_generation_prompt=True)
    indices = set(rendered.message_index)
    assert {1, 2, 3, 4} <= indices  # every non-system message owns tokens
    # the generation prompt belongs to the next message (Mistral has none: its last turn ends the prompt;
    # DeepSeek V3.1 writes one only after a user message)
    no_prompt = family.startswith(("mistral", "deepseek-v3.1"))
    assert rendered.message_index[-1] == (len(messages) - 1 if no_prompt else len(messages))
    owned = [i for i in rendered.message_index if i != -1]
    assert owned == sorted(owned)  # tokens come in message order
    assert len(rendered.token_ids) == len(rendered.message_index)
