"""bridge: append-only continuation, equal to the template's render for prefix-stable families.

For families whose official template re-renders history differently, a test
shows the first token where the template departs from the append-only history
and names the cause (with the linter's classifier).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verbatim.datamodel import Message
from verbatim.errors import RenderError
from verbatim.renderers import drift
from verbatim.renderers.conversations import load_conversations
from verbatim.renderers.drift_causes import Evidence, classify
from verbatim.renderers.registry import FAMILIES, get_renderer
from verbatim.renderers.replay import replay

CORPUS = Path(__file__).parent / "data" / "conversations.jsonl"
STABLE = sorted(name for name in FAMILIES if FAMILIES[name].load().prefix_stable)
UNSTABLE = sorted(set(FAMILIES) - set(STABLE))


def by_note(note: str) -> tuple[list[Message], list[dict] | None]:
    conversation = next(c for c in load_conversations(CORPUS) if c.note == note)
    return conversation.as_messages(), list(conversation.tools) if conversation.tools else None


def up_to_last_prompt(messages: list[Message]) -> list[Message]:
    last = max(i for i, m in enumerate(messages) if m.role != "assistant")
    return messages[:last + 1]


def starts_with_whitespace(messages: list[Message]) -> bool:
    return any(m.role == "assistant" and m.content[:1].isspace() for m in messages)


def test_families_are_split_into_stable_and_not() -> None:
    assert set(STABLE) == {"smollm2", "qwen2.5", "qwen3-instruct-2507", "llama3", "gemma3", "phi4", "kimi-k2",
                           "gemma2", "deepseek-v3.1"}
    assert len(UNSTABLE) == 14


@pytest.mark.parametrize("family", STABLE)
def test_bridged_history_equals_the_template_render(family: str, default_model_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    compared = 0
    for conversation in load_conversations(CORPUS):
        messages = up_to_last_prompt(conversation.as_messages())
        if messages[0].role == "assistant" or starts_with_whitespace(messages):
            continue  # a reply that starts with whitespace merges with the prompt's last token: see below
        try:
            ids = replay(renderer, messages, tools=conversation.tools)
        except RenderError:  # the family cannot take this conversation (e.g. Gemma has no tool role)
            continue
        full = renderer.render(messages, tools=conversation.tools, add_generation_prompt=True).token_ids
        assert ids == list(full), f"{family}: {conversation.note!r}"
        compared += 1
    assert compared >= (23 if family == "gemma2" else 30)  # Gemma 2 refuses system messages and tool roles


def test_a_reply_starting_with_whitespace_is_a_bpe_boundary_merge(default_model_dir: Path) -> None:
    renderer = get_renderer("smollm2", model_dir=default_model_dir)
    messages = [Message(role="user", content="hi"), Message(role="assistant", content="   "),
                Message(role="user", content="ok")]
    ids = replay(renderer, messages)
    full = list(renderer.render(messages, add_generation_prompt=True).token_ids)
    cause, at = divergence_cause(renderer, ids, full, messages)
    assert at is not None and cause == "bpe_boundary_merge"
    assert renderer.tokenizer.decode(ids) == renderer.tokenizer.decode(full)  # same text, other tokens


def divergence_cause(renderer, ours: list[int], theirs: list[int], messages: list[Message],
                     tools: list[dict] | None = None) -> tuple[str, int | None]:
    at = drift.first_divergence(ours, theirs)
    if at is None:
        return "", None
    decode = renderer.tokenizer.decode
    evidence = Evidence(kind="history", cut=(0, len(messages)), earlier=decode(ours), later=decode(theirs),
                        position=len(decode(ours[:at])), earlier_dates=(),
                        messages=renderer.template_messages(messages), tools=tools or (),
                        eos_token=str(renderer.tokenizer.eos_token))
    return classify(evidence), at


UNSTABLE_CASES = [
    ("qwen3", "reasoning, multi turn", "reasoning_stripped"),
    ("qwen3", "two turns with system", "reasoning_stripped"),  # the empty think block of a past turn
    ("deepseek-r1", "reasoning, multi turn", "reasoning_stripped"),
    ("deepseek-v3", "single tool call and result", "tool_call_reserialized"),
    ("mistral-v3", "two turns with system", "system_moved"),
    ("mistral-v7-tekken", "tools defined, multi turn", "system_moved"),
    ("mistral-nemo", "two turns with system", "system_moved"),
    ("deepseek-v3.1-thinking", "reasoning, multi turn", "reasoning_stripped"),  # sampled after <think>
    ("gpt-oss", "two turns with system", "eos_in_history"),
    ("gpt-oss", "reasoning, multi turn", "reasoning_stripped"),
    ("qwen3.6", "reasoning, multi turn", "reasoning_stripped"),
    ("qwq", "reasoning, multi turn", "reasoning_stripped"),  # the prompt's <think>\n and what followed it
    ("glm-4.5", "reasoning, multi turn", "reasoning_stripped"),
]


@pytest.mark.parametrize(("family", "note", "cause"), UNSTABLE_CASES)
def test_template_rerender_departs_from_history_with_a_named_cause(family: str, note: str, cause: str,
                                                                    default_model_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    messages, tools = by_note(note)
    messages = up_to_last_prompt(messages)
    ours = replay(renderer, messages, tools=tools)
    theirs = list(renderer.render(messages, tools=tools, add_generation_prompt=True).token_ids)
    found, at = divergence_cause(renderer, ours, theirs, messages, tools)
    assert at is not None, f"{family} is documented as not prefix-stable, yet {note!r} did not diverge"
    assert found == cause, (f"{family} {note!r}: first divergence at token {at}: ours "
                            f"{renderer.tokenizer.decode(ours[at:at + 6])!r}, template "
                            f"{renderer.tokenizer.decode(theirs[at:at + 6])!r}, classified {found}")
    assert ours[:at] == theirs[:at]


@pytest.mark.parametrize("family", ["phi3", "phi3.5", "phi4-mini"])
def test_phi_history_is_stable_but_the_template_appends_eos(family: str, default_model_dir: Path,
                                                            chat_templates_dir: Path) -> None:
    """The bridge never writes end-of-text; the template does after every non-generation render."""
    renderer = get_renderer(family, model_dir=default_model_dir)
    messages, _ = by_note("two turns with system")
    prompt = up_to_last_prompt(messages)
    assert replay(renderer, prompt) == list(renderer.render(prompt, add_generation_prompt=True).token_ids)
    text = (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")
    template = drift.TemplateRenderer(text, renderer.tokenizer)
    conversation = next(c for c in load_conversations(CORPUS) if c.note == "two turns with system")
    verdict = drift.analyze(template, conversation, 0)
    history = [v for v in verdict.violations if v.kind == "history"]
    assert [v.cause for v in history] == ["eos_in_history"]
    earlier = template.render(conversation.messages[:history[0].cut[0]], None, add_generation_prompt=False)
    at = history[0].first_divergence
    assert earlier.ids[at:] == renderer.encode(renderer.tokenizer.eos_token)  # the first token that departs


PROMPT_OPENS_THINK = {"deepseek-r1": "\n</think>\n\n", "qwen3.6": "\n</think>\n\n", "qwq": "\n</think>\n\n",
                      "deepseek-v3.1-thinking": "</think>"}
"""Families whose generation prompt opens a think block, and what closes it (tests/test_renderers_cut.py)."""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bridge_closes_a_truncated_reply(family: str, default_model_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    prompt = [Message(role="user", content="Tell me a long story.")]
    ids = list(renderer.render(prompt, add_generation_prompt=True).token_ids)
    cut_reply = renderer.encode("Once upon a time there was")  # max tokens hit: no stop token
    previous = tuple(ids + cut_reply)
    added = renderer.bridge(previous, [Message(role="user", content="Go on.")])
    assert previous == tuple(ids + cut_reply)  # nothing before is touched
    close = renderer.cut_close(previous)  # a think block the prompt opened is closed before the turn end
    assert close == PROMPT_OPENS_THINK.get(family, "") + renderer.close_text
    assert added[:len(renderer.encode(close))] == renderer.encode(close)
    finished = renderer.bridge(ids + cut_reply + [renderer.stop_token_ids[0]], [Message(role="user", content="Go on.")])
    assert added[len(added) - len(finished):] == finished  # a finished reply gets the same tokens, minus the close
    if renderer.prefix_stable:
        whole = prompt + [Message(role="assistant", content="Once upon a time there was"),
                          Message(role="user", content="Go on.")]
        assert list(previous) + added == list(renderer.render(whole, add_generation_prompt=True).token_ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bridge_refuses_what_it_cannot_continue(family: str, default_model_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    user = Message(role="user", content="hi")
    ids = list(renderer.render([user], add_generation_prompt=True).token_ids)
    with pytest.raises(RenderError, match="previous tokens"):
        renderer.bridge([], [user])
    with pytest.raises(RenderError, match="at least one"):
        renderer.bridge(ids, [])
    with pytest.raises(RenderError, match="role 'assistant'"):
        renderer.bridge(ids, [Message(role="assistant", content="I speak for the model")])


def test_family_specific_refusals(default_model_dir: Path) -> None:
    user, tool = Message(role="user", content="a"), Message(role="tool", content="42", tool_call_id="call00001")
    gemma = get_renderer("gemma3", model_dir=default_model_dir)
    ids = list(gemma.render([user], add_generation_prompt=True).token_ids)
    with pytest.raises(RenderError, match="alternate|exactly one user"):
        gemma.bridge(ids, [user, user])
    with pytest.raises(RenderError, match="no tool role"):
        gemma.bridge(ids, [tool])
    phi3 = get_renderer("phi3", model_dir=default_model_dir)
    with pytest.raises(RenderError, match="no 'tool' role"):
        phi3.bridge(list(phi3.render([user], add_generation_prompt=True).token_ids), [tool])
    mistral = get_renderer("mistral-v3", model_dir=default_model_dir)
    with pytest.raises(RenderError, match="9 alphanumerics"):
        mistral.bridge([1, 2], [Message(role="tool", content="x", tool_call_id="short")])


# ---------------------------------------------------------------------------
# hypothesis: generated conversations
# ---------------------------------------------------------------------------

WORDS = st.text(alphabet=st.sampled_from(list("abcdefghij XYZ0123456789.,!?-'éß東京🙂\n")), min_size=1, max_size=40)
TRIMMED = WORDS.map(lambda text: text.strip()).filter(bool)


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    messages = []
    if draw(st.booleans()):
        messages.append(Message(role="system", content=draw(TRIMMED)))
    for _ in range(draw(st.integers(1, 4))):
        messages.append(Message(role="user", content=draw(TRIMMED)))
        messages.append(Message(role="assistant", content=draw(TRIMMED)))
    messages.append(Message(role="user", content=draw(TRIMMED)))
    return messages


HYPOTHESIS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@HYPOTHESIS
@given(messages=conversations())
def test_bridge_is_a_pure_extension(family: str, messages: list[Message], default_model_dir: Path,
                                    chat_templates_dir: Path) -> None:
    renderer = get_renderer(family, model_dir=default_model_dir)
    if family == "gemma2":  # its template refuses a system message
        messages = [m for m in messages if m.role != "system"]
    ids = replay(renderer, messages)  # prompt, then reply + bridge, turn after turn
    first_reply = next(i for i, m in enumerate(messages) if m.role == "assistant")
    prefix = list(renderer.render(messages[:first_reply], add_generation_prompt=True).token_ids)
    assert ids[:len(prefix)] == prefix  # the first prompt is never rewritten
    history = tuple(ids)
    added = renderer.bridge(history, [Message(role="user", content="one more")])
    assert tuple(ids) == history and added  # nothing before changes; something is appended
    assert renderer.tokenizer.decode(ids + added).startswith(renderer.tokenizer.decode(ids)[:-1])
    if renderer.prefix_stable:  # equal to the official template's full render, not just to ours
        template = (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")
        expected = renderer.tokenizer.apply_chat_template(
            renderer.template_messages(messages), chat_template=template, add_generation_prompt=True,
            tokenize=True, return_dict=False, **renderer.template_kwargs())
        assert ids == list(expected)


@pytest.mark.parametrize("family", ["qwen3"])
@HYPOTHESIS
@given(messages=conversations(), reasoning=st.lists(TRIMMED, min_size=4, max_size=4))
def test_qwen3_keep_reasoning_renders_the_bridged_history(family: str, messages: list[Message],
                                                          reasoning: list[str], default_model_dir: Path) -> None:
    """With keep_reasoning, a full render equals what the append-only history holds."""
    replies = iter(reasoning)
    messages = [m.model_copy(update={"reasoning": next(replies)}) if m.role == "assistant" else m for m in messages]
    renderer = get_renderer(family, model_dir=default_model_dir, keep_reasoning=True)
    assert replay(renderer, messages) == list(renderer.render(messages, add_generation_prompt=True).token_ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bridge_takes_the_ledger_view(family: str, default_model_dir: Path) -> None:
    """A read-only int32 array (what Ledger.view() returns) works like a list."""
    import numpy as np

    renderer = get_renderer(family, model_dir=default_model_dir)
    messages, tools = by_note("single tool call and result")
    messages = messages[:3] if family not in ("gemma3", "phi3", "phi3.5", "phi4") else by_note("4 turns")[0][:3]
    messages = by_note("5 turns")[0][:2] if family == "gemma2" else messages  # no system role
    history = replay(renderer, messages, tools=tools)
    view = np.array(history, dtype=np.int32)
    view.flags.writeable = False
    follow = [Message(role="user", content="and tomorrow?")]
    assert renderer.bridge(view, follow, tools=tools) == renderer.bridge(history, follow, tools=tools)


CURRENT_TURN = ["qwen3", "deepseek-r1", "deepseek-v3", "mistral-v3", "mistral-v7-tekken", "gpt-oss", "phi3",
                "phi3.5", "phi4-mini", "qwen3.6", "qwq", "glm-4.5", "mistral-nemo", "deepseek-v3.1-thinking"]


@pytest.mark.parametrize("family", CURRENT_TURN)
def test_unstable_families_match_the_template_on_the_current_turn(family: str, default_model_dir: Path,
                                                                  chat_templates_dir: Path) -> None:
    """Earlier turns differ (documented causes above); the tokens bridge appends are the template's own."""
    renderer = get_renderer(family, model_dir=default_model_dir)
    messages, _ = by_note("reasoning, multi turn")  # system, user, reply with reasoning, user, reply
    held = replay(renderer, messages[:3])
    repeats_system = family in ("mistral-v3", "mistral-nemo")  # they write the system prompt into the newest turn
    new = [messages[0], messages[3]] if repeats_system else messages[3:4]
    added = renderer.bridge(held, new)
    template = (chat_templates_dir / renderer.templates[0]).read_text(encoding="utf-8")
    full = renderer.tokenizer.apply_chat_template(
        renderer.template_messages(messages[:4]), chat_template=template, add_generation_prompt=True,
        tokenize=True, return_dict=False, **renderer.template_kwargs())
    assert list(full[-len(added):]) == added
