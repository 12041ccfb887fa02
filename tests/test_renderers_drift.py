"""The template drift linter: golden verdicts for every shared template, causes, CLI contract."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.errors import InputError
from verbatim.renderers import drift
from verbatim.renderers.conversations import DEFAULT_CONVERSATIONS, Conversation, load_conversations
from verbatim.renderers.templates import official_templates, read_template, resolve_template, resolve_tokenizer

GOLDEN = Path(__file__).parent / "data" / "lint_golden.json"
runner = CliRunner()


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict]]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_golden_covers_every_shared_template(golden: dict, chat_templates_dir: Path) -> None:
    assert set(golden) == {p.stem for p in chat_templates_dir.glob("*.jinja")} == set(official_templates())


@pytest.mark.parametrize("stem", sorted(official_templates()))
def test_verdicts_match_the_golden_file(stem: str, golden: dict, default_tokenizer) -> None:
    renderer = drift.TemplateRenderer(read_template(official_templates()[stem]), default_tokenizer)
    verdicts = drift.lint(renderer, load_conversations(DEFAULT_CONVERSATIONS))
    assert [v.as_json() for v in verdicts] == golden[stem], "regenerate with scripts/regen_lint_golden.py if intended"


def test_every_cause_comes_from_a_real_template(golden: dict) -> None:
    found = Counter(v["cause"] for verdicts in golden.values() for verdict in verdicts
                    for v in verdict["violations"])
    assert set(found) == set(drift.CAUSES), f"causes never produced: {set(drift.CAUSES) - set(found)}"


@pytest.mark.parametrize(("stem", "cause"), [
    ("qwen3", "reasoning_stripped"), ("mistral_small_3_2_2506", "date_injected"),
    ("mistral_7b_instruct_v0_3", "system_moved"), ("deepseek_r1", "tool_call_reserialized"),
    ("phi3_mini", "eos_in_history"), ("qwq_32b", "generation_prompt_dropped"), ("qwq_32b", "whitespace_trimmed"),
    ("smollm2_instruct", "default_system_injected"), ("llama3_1_instruct", "bpe_boundary_merge"),
    ("llama3_instruct", "other"), ("deepseek_v3", "tool_calls_dropped"),
])
def test_the_documented_template_produces_its_cause(stem: str, cause: str, golden: dict) -> None:
    assert cause in {v["cause"] for verdict in golden[stem] for v in verdict["violations"]}


def test_stable_templates_stay_stable(golden: dict) -> None:
    for stem in ("gemma3", "mixtral_8x7b_instruct_v0_1"):
        assert all(v["prefix_stable"] in (True, None) for v in golden[stem])
    refused = [v for v in golden["gemma2"] if v["prefix_stable"] is None]
    assert refused and all("unsupported" in v for v in refused)  # gemma2 refuses system messages


def test_miss_tokens_count_the_earlier_render_after_the_divergence(default_tokenizer, chat_templates_dir) -> None:
    template = read_template(chat_templates_dir / "phi3_mini.jinja")
    renderer = drift.TemplateRenderer(template, default_tokenizer)
    conversation = load_conversations(DEFAULT_CONVERSATIONS)[1]
    verdict = drift.analyze(renderer, conversation, 1)
    violation = verdict.violations[0]
    earlier = renderer.render(conversation.messages[:violation.cut[0]], None, add_generation_prompt=False)
    assert violation.miss_tokens == len(earlier.ids) - violation.first_divergence > 0


# ---------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------


def lint(*args: str):
    return runner.invoke(app, ["lint", "template", *args])


def test_cli_json_is_one_object_per_conversation() -> None:
    result = lint("--template", "qwen3", "--json")
    assert result.exit_code == 1, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["conversation"] for line in lines] == list(range(len(load_conversations(DEFAULT_CONVERSATIONS))))
    violation = next(v for line in lines for v in line["violations"])
    assert set(violation) >= {"kind", "cut", "first_divergence", "cause", "miss_tokens"}
    assert violation["cause"] in drift.CAUSES


def test_cli_exit_0_when_stable_and_a_table_for_people(tmp_path: Path) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    result = lint("--template", "mixtral_8x7b_instruct_v0_1", "--conversations", str(chats))
    assert result.exit_code == 0, result.output
    assert "1/1 conversations prefix-stable" in result.stdout


def test_cli_takes_a_template_path_and_a_tokenizer_name(chat_templates_dir: Path) -> None:
    result = lint("--template", str(chat_templates_dir / "qwen3.jinja"), "--tokenizer", "qwen3", "--json")
    assert result.exit_code == 1, result.output
    causes = {v["cause"] for line in result.stdout.splitlines() for v in json.loads(line)["violations"]}
    assert causes == {"reasoning_stripped"}  # with Qwen's own tokenizer, no BPE noise


def test_the_table_prints_tokens_that_look_like_console_markup() -> None:
    """Mistral's ``[/INST]`` in the context column is text, not a closing style tag."""
    result = lint("--template", "mistral_nemo_instruct_2407", "--tokenizer", "mistral-nemo")
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.exception
    assert "mistral_nemo_instruct_2407: 5/11 conversations prefix-stable" in " ".join(result.stdout.split())
    assert "INST]" in result.stdout


@pytest.mark.parametrize(("content", "needle"), [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', ":2: invalid JSON"),
    ('{"messages": "nope"}\n', ":1: expected an object with a 'messages' list"),
    ('{"messages": [{"content": "no role"}]}\n', ":1: message 0 needs a string 'role'"),
    ("\n", "holds no conversations"),
])
def test_cli_bad_conversations_name_the_line(tmp_path: Path, content: str, needle: str) -> None:
    chats = tmp_path / "bad.jsonl"
    chats.write_text(content)
    result = lint("--template", "qwen3", "--conversations", str(chats))
    assert result.exit_code == 2
    assert needle in result.output and result.output.count("\n") == 1


def test_cli_bad_templates_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    assert "does not parse" in lint("--template", str(broken)).output
    assert lint("--template", str(broken)).exit_code == 2
    crashing = tmp_path / "crash.jinja"
    crashing.write_text("{{ messages[0].content + 1 }}")
    result = lint("--template", str(crashing))
    assert result.exit_code == 2 and "raised on conversation 0" in result.output
    result = lint("--template", "qwen-3-typo")
    assert result.exit_code == 2 and "did you mean" in result.output
    assert lint("--template", "qwen3", "--tokenizer", "nope").exit_code == 2


def test_resolve_template_by_renderer_name() -> None:
    assert resolve_template("llama3")[0] == "llama3_1_instruct"
    with pytest.raises(InputError):
        resolve_template("definitely-not-a-template")


def test_refusals_are_per_conversation(default_tokenizer, chat_templates_dir: Path) -> None:
    renderer = drift.TemplateRenderer(read_template(chat_templates_dir / "gemma2.jinja"), default_tokenizer)
    system = Conversation(messages=({"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                    {"role": "assistant", "content": "a"}))
    verdict = drift.analyze(renderer, system, 0)
    assert verdict.prefix_stable is None and "System role not supported" in verdict.unsupported
    plain = Conversation(messages=({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}))
    accepted = drift.analyze(renderer, plain, 1)
    assert accepted.unsupported is None
    assert drift.exit_code([verdict, accepted]) == 0  # one refusal among linted conversations is fine
    assert drift.exit_code([verdict]) == 2  # refusing everything lints nothing


# ---------------------------------------------------------------------------
# lint precision (issue 14, items 7-10)
# ---------------------------------------------------------------------------


def _json_lines(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_llama3_2_is_stable_with_its_date_pinned_by_default() -> None:
    """Its template reads the clock only when date_string is missing; the lint pins it as the renderer does."""
    result = lint("--template", "llama3_2_instruct", "--tokenizer", "llama3", "--json")
    assert result.exit_code == 0, result.output
    assert all(line["prefix_stable"] for line in _json_lines(result))
    unpinned = lint("--template", "llama3_2_instruct", "--tokenizer", "llama3", "--json", "--no-pin-defaults")
    assert {v["cause"] for line in _json_lines(unpinned) for v in line["violations"]} == {"date_injected"}


COUNTING = "{% for m in messages %}{{ m.content }}{% endfor %}{% if not pinned %}{{ messages|length }}{% endif %}"


def test_var_pins_a_template_variable(tmp_path: Path) -> None:
    template = tmp_path / "counting.jinja"
    template.write_text(COUNTING)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"},
                                              {"role": "user", "content": "again"},
                                              {"role": "assistant", "content": "yes"}]}) + "\n")
    assert lint("--template", str(template), "--conversations", str(chats)).exit_code == 1
    assert lint("--template", str(template), "--conversations", str(chats), "--var", "pinned=true").exit_code == 0
    assert lint("--template", str(template), "--conversations", str(chats), "--var", "pinned=false").exit_code == 1
    result = lint("--template", str(template), "--conversations", str(chats), "--var", "pinned")
    assert result.exit_code == 2 and "KEY=VALUE" in result.output and result.output.count("\n") == 1


def test_the_cause_is_the_first_real_divergence_not_the_date(default_model_dir: Path) -> None:
    """gpt-oss writes the clock's date into its system turn; the analysis channel it drops is the real drift."""
    renderer = drift.TemplateRenderer(resolve_template("gpt_oss")[1], resolve_tokenizer("gpt-oss", default_model_dir))
    conversation = next(c for c in load_conversations(DEFAULT_CONVERSATIONS) if "preamble" in c.note)
    verdict = drift.analyze(renderer, conversation, 0)
    causes = {(v.kind, v.cut): v.cause for v in verdict.violations}
    assert causes[("history", (2, 4))] == causes[("generation_prompt", (3, 4))] == "reasoning_stripped"
    dropped = next(v for v in verdict.violations if v.kind == "history")
    assert "".join(dropped.earlier).startswith("<|channel|>analysis")  # the preamble, written as analysis


def test_a_malformed_conversation_is_its_own_problem(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    untyped = {"messages": [{"role": "user", "content": "list"},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"function": {"name": "ls", "arguments": {"path": "."}}}]},
                            {"role": "tool", "content": "a.txt"}, {"role": "assistant", "content": "a.txt"}]}
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps(c) for c in (good, untyped, good)) + "\n")
    result = lint("--template", "deepseek_r1", "--conversations", str(chats), "--json")
    lines = _json_lines(result)
    assert [line["conversation"] for line in lines] == [0, 1, 2], result.output
    assert lines[0]["violations"] and lines[2] == {**lines[0], "conversation": 2}
    assert lines[1]["prefix_stable"] is None and "type" in lines[1]["problem"]
    assert result.exit_code == 1  # drift found in the others; the problem is reported, not fatal


def test_history_and_generation_prompt_stability_are_reported_apart() -> None:
    lines = _json_lines(lint("--template", "qwq_32b", "--json"))
    for line in lines:
        history = not any(v["kind"] == "history" for v in line["violations"])
        prompt = not any(v["kind"] == "generation_prompt" for v in line["violations"])
        assert (line["history_stable"], line["generation_prompt_stable"]) == (history, prompt)
        assert line["prefix_stable"] == (history and prompt)
    pairs = {(line["history_stable"], line["generation_prompt_stable"]) for line in lines}
    assert pairs >= {(True, False), (False, True)}  # qwq: the prompt's <think> is dropped; a past reply trimmed


# ---------------------------------------------------------------------------
# tool calls a template drops (issue 14, item 6)
# ---------------------------------------------------------------------------

CALL_ONLY = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call00001",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."}]}


def test_deepseek_v3_drops_calls_with_empty_content_and_the_lint_says_so(tmp_path: Path) -> None:
    """The template writes a call only for content None; given content "" it writes an empty answer instead."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(CALL_ONLY) + "\n" + json.dumps({**CALL_ONLY, "messages": [
        {**m, "content": None} if m.get("tool_calls") else m for m in CALL_ONLY["messages"]]}) + "\n")
    result = lint("--template", "deepseek_v3", "--tokenizer", "deepseek-v3", "--conversations", str(chats), "--json")
    empty, none = _json_lines(result)
    assert result.exit_code == 1, result.output
    assert [(v["kind"], v["cut"], v["cause"]) for v in empty["violations"]] == [
        ("tool_calls", [1, 2], "tool_calls_dropped")]
    assert "".join(empty["violations"][0]["context"]["later"]).startswith("<｜Assistant｜><｜end▁of▁sentence｜>")
    assert empty["tool_calls_kept"] is False and empty["prefix_stable"] is True  # dropped alike in every render
    assert none["tool_calls_kept"] is True and none["violations"] == []
    table = lint("--template", "deepseek_v3", "--tokenizer", "deepseek-v3", "--conversations", str(chats))
    assert table.exit_code == 1 and "tool calls dropped in 1" in " ".join(table.stdout.split())


def test_the_deepseek_v3_renderer_writes_the_calls_the_template_drops(default_model_dir: Path,
                                                                      chat_templates_dir: Path) -> None:
    """The departure is explicit: render follows the sampled calls, and the template's own lint names the cause."""
    from verbatim.renderers.conversations import Conversation
    from verbatim.renderers.registry import get_renderer

    renderer = get_renderer("deepseek-v3", model_dir=default_model_dir)
    conversation = Conversation(**CALL_ONLY)
    ours = renderer.render(conversation.as_messages(), add_generation_prompt=False).token_ids
    template = read_template(chat_templates_dir / "deepseek_v3.jinja")
    as_given = renderer.tokenizer.apply_chat_template(list(conversation.messages), chat_template=template,
                                                      tokenize=True, return_dict=False)
    as_none = renderer.tokenizer.apply_chat_template(renderer.template_messages(conversation.as_messages()),
                                                     chat_template=template, tokenize=True, return_dict=False)
    assert list(ours) == list(as_none) != list(as_given)
    assert "get_weather" in renderer.tokenizer.decode(ours) and "get_weather" not in renderer.tokenizer.decode(as_given)
    verdict = drift.analyze(drift.TemplateRenderer(template, renderer.tokenizer), conversation, 0)
    assert [v.cause for v in verdict.violations] == ["tool_calls_dropped"]
    assert renderer.departures == {"tool_calls_dropped"}


def test_cli_a_template_that_refuses_every_conversation_is_an_error(tmp_path: Path) -> None:
    refusing = tmp_path / "refuse.jinja"
    refusing.write_text('{{ raise_exception("this template accepts nothing") }}')
    result = lint("--template", str(refusing))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refused all 11 conversations" in lines[0], result.stderr
    assert "this template accepts nothing" in lines[0]
