"""Regenerate tests/data/o200k_harmony_golden.json: openai-harmony's own token ids for a few gpt-oss texts.

The ids come from openai-harmony's encoder (``HarmonyEncodingName.HARMONY_GPT_OSS``), never from verbatim:
harmony renders its own conversations (system, developer with function tools, analysis, a constrained
tool call, a tool result, a final answer) and encodes texts that gpt_oss.jinja writes. It is pointed at
the o200k_base.tiktoken that verbatim ships (``TIKTOKEN_ENCODINGS_BASE``), so it downloads nothing; that
file's sha256 is checked against the hash harmony pins before anything runs. Needs ``pip install
openai-harmony`` (0.0.8 was used; vllm's ``oss-harmony`` fork gives the same ids):
    .venv/bin/python scripts/regen_o200k_golden.py
and review the diff. tests/test_renderers_o200k.py compares verbatim's tokenizer with this file.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "o200k_harmony_golden.json"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "City name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    "days": {"type": "array", "items": {"type": "object", "properties": {"date": {"type": "string"}}}}},
    "required": ["city"]}
TEXTS = [
    "Hello world! Don't SHOUT, I'LL listen… naïve café, Straße, ΑΒΓ, русский, 日本語のテキスト, 한국어, 🙂👍🏽",
    "def f(x):\n\treturn x**2  # two  spaces\r\n\n\n    indented = [1, 22, 333, 4444, 55555]\n",
    "<|start|>user<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>",
    "https://example.com/a/b?c=1&d=2 — 3.14159 1,234,567 1e-9 $100 50% x+y=z",
]


def harmony_conversations(h) -> list[tuple[str, list[int]]]:  # noqa: ANN001 (openai_harmony module)
    enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    system = (h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)
              .with_conversation_start_date("2024-07-26"))
    tools = [h.ToolDescription.new("get_weather", "Gets the weather.", parameters=WEATHER)]
    developer = h.DeveloperContent.new().with_instructions("Answer briefly.").with_function_tools(tools)
    simple = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.USER, "What is 2 + 2?")])
    agent = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Paris, in °C?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"),
                                          '{"temp": 21, "sky": "sunny"}').with_channel("commentary"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "It is 21 °C and sunny.").with_channel("final")])
    return [("harmony: system + user, for completion",
             enc.render_conversation_for_completion(simple, h.Role.ASSISTANT)),
            ("harmony: tools, analysis, constrained call, result, final (training)",
             enc.render_conversation_for_training(agent))]


def template_texts() -> list[tuple[str, str]]:
    """Texts the official template writes for two corpus conversations (one with tools and calls)."""
    import transformers.utils.chat_template_utils as chat_utils

    from verbatim.paths import chat_templates_dir
    from verbatim.renderers.conversations import load_conversations
    from verbatim.renderers.tokenizers import o200k_harmony_tokenizer

    class FrozenClock(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return dt.datetime(2024, 7, 26, 12, 0, 0)

    chat_utils.datetime = FrozenClock
    template = (chat_templates_dir() / "gpt_oss.jinja").read_text(encoding="utf-8")
    corpus = load_conversations(REPO / "tests" / "data" / "conversations.jsonl")
    picked = [next(c for c in corpus if c.tools), next(c for c in corpus if c.messages[0]["role"] == "system")]
    return [(f"gpt_oss.jinja: corpus {c.note!r}", o200k_harmony_tokenizer().apply_chat_template(
        c.messages, tools=list(c.tools or []) or None, chat_template=template, tokenize=False,
        add_generation_prompt=True)) for c in picked]


def harmony_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("openai-harmony", "oss-harmony"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "openai_harmony (version unknown)"


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from verbatim.paths import tokenizer_file
    from verbatim.renderers.tokenizers import o200k_base_ranks

    shipped = tokenizer_file("o200k", "o200k_base.tiktoken.gz")
    o200k_base_ranks(shipped)  # raises unless the sha256 is the one harmony pins
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "o200k_base.tiktoken").write_bytes(gzip.decompress(shipped.read_bytes()))
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder
        import openai_harmony as h

        enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        cases = [(note, ids) for note, ids in harmony_conversations(h)]
        cases += [(f"text {i}", enc.encode(text, allowed_special="all")) for i, text in enumerate(TEXTS)]
        cases += [(note, enc.encode(text, allowed_special="all")) for note, text in template_texts()]
        named = {i: enc.decode([i]) for i in (199998, 199999, 200002, 200003, 200005, 200006, 200007, 200008,
                                              200012)}
        records = [{"source": note, "text": enc.decode_utf8(ids), "ids": ids} for note, ids in cases]
    golden = {"encoder": f"{harmony_version()} HARMONY_GPT_OSS", "special_ids": named, "cases": records}
    head = json.dumps({k: v for k, v in golden.items() if k != "cases"}, ensure_ascii=False)[:-1]
    cases = ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)  # one case per line
    GOLDEN.write_text(f'{head}, "cases": [\n{cases}\n]}}\n', encoding="utf-8")
    print(f"wrote {GOLDEN}: {len(records)} cases, {sum(len(r['ids']) for r in records)} ids")


if __name__ == "__main__":
    main()
