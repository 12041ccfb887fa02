"""bench rollouts: table shape and the docs section it rewrites (pure parts; the numbers come from a real run)."""

from __future__ import annotations

from verbatim.bench.rollouts import SCENARIOS, DialogueFactory, HarnessResult, markdown, write_section


def _row(name: str, prefill: int) -> HarnessResult:
    return HarnessResult(harness=name, requests=4, prompt_tokens=1000, cached_tokens=1000 - prefill,
                         prefill_tokens=prefill, min_prefill_tokens=200, generated_tokens=50, wall_s=2.0)


def test_table_reports_the_ratio_against_verbatim():
    table = markdown([(SCENARIOS[0], [_row("verbatim", 250), _row("re-render baseline", 1000)])])
    lines = table.splitlines()
    assert len(lines) == 4
    assert "| 1.00x |" in lines[2] and "| 4.00x |" in lines[3]
    assert lines[0].count("|") == lines[2].count("|")
    assert "| 25.0 |" in lines[2]  # generated tokens per second


def test_section_is_appended_once_then_replaced(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Renderers\n\nkeep me\n")
    write_section(doc, "| first |")
    write_section(doc, "| second |")
    text = doc.read_text()
    assert "keep me" in text and "| second |" in text and "| first |" not in text
    assert text.count("## Rollouts (verbatim bench rollouts)") == 1


def test_dialogue_workload_lasts_exactly_its_turns():
    from verbatim.datamodel import Message

    env = DialogueFactory().make()
    env.reset(DialogueFactory().tasks(1, 0)[0], 0)
    done = [env.step(Message(role="assistant", content="ok")).done for _ in range(10)]
    assert done == [False] * 9 + [True]
