"""verbatim bench render: bridge vs re-render timing, and the docs section it writes."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from verbatim.bench.render import bench_render, markdown_table, synthetic_conversation
from verbatim.bench.render_report import SECTION, write_section
from verbatim.cli.app import app
from verbatim.renderers.registry import get_renderer


def test_bench_rows_grow_with_the_history(default_model_dir: Path, chat_templates_dir: Path) -> None:
    renderer = get_renderer("smollm2", model_dir=default_model_dir)
    template = (chat_templates_dir / "smollm2_instruct.jinja").read_text(encoding="utf-8")
    rows = bench_render(renderer, template, (2, 20), repeats=4)
    assert [r.turns for r in rows] == [2, 20]
    assert rows[0].history_tokens < rows[1].history_tokens
    assert all(r.bridge_ms > 0 and r.rerender_ms > 0 for r in rows)
    assert rows[1].rerender_ms > rows[1].bridge_ms  # re-rendering 20 turns costs more than appending one message
    assert markdown_table(rows).count("\n") == 3
    assert len(synthetic_conversation(5)) == 1 + 2 * 5 + 1


def test_write_section_leaves_other_sections_alone(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n## Rollouts\n\nkeep me\n\n## Renderers\n\n<!-- {SECTION}:begin -->\nOLD-TABLE\n"
                   f"<!-- {SECTION}:end -->\n\n## Later\n\nalso keep\n")
    write_section(doc, "smollm2", "t.jinja", "verbatim bench render", "| a |", machine_line="Machine: M.")
    write_section(doc, "smollm2", "t.jinja", "verbatim bench render", "| b |", machine_line="Machine: M.")
    text = doc.read_text()
    assert "| b |" in text and "| a |" not in text and "OLD-TABLE" not in text
    assert text.startswith("# Benchmarks\n\n## Rollouts\n\nkeep me\n\n## Renderers\n\n")
    assert text.endswith("| b |\n\nMachine: M.\n<!-- bench-render:end -->\n\n## Later\n\nalso keep\n")
    assert "`verbatim bench render`" in text


def test_bench_render_command(tmp_path: Path, default_model_dir: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n<!-- {SECTION}:begin -->\n<!-- {SECTION}:end -->\n")
    result = CliRunner().invoke(app, ["bench", "render", "--turns", "2,3", "--repeats", "2", "--write", str(doc)])
    assert result.exit_code == 0, result.output
    text = doc.read_text()
    assert "| 3 |" in text and "bridge (ms/turn)" in result.stdout
    assert f"`verbatim bench render --renderer smollm2 --turns 2,3 --repeats 2 --write {doc}`" in text
    assert "Machine (detected): " in text and ("cores (" in text or "core (" in text)
    bad = CliRunner().invoke(app, ["bench", "render", "--turns", "two"])
    assert bad.exit_code == 2
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("# Plain\n")
    refused = CliRunner().invoke(app, ["bench", "render", "--write", str(unmarked)])
    assert refused.exit_code == 2 and "bench-render:begin" in refused.output and unmarked.read_text() == "# Plain\n"
