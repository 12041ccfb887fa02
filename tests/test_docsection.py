"""Benchmarks rewrite only their own marked section of a document."""

from __future__ import annotations

from verbatim.bench.docsection import replace_section, write_section

DOC = ("# Benchmarks\n\nintro\n\n<!-- a:begin -->\nold a\n<!-- a:end -->\n\nprose after a\n\n"
       "<!-- b:begin -->\nb\n<!-- b:end -->\n")


def test_a_section_is_replaced_in_place_and_everything_else_kept():
    text = replace_section(DOC, "a", "new a", heading="## A")
    assert "new a" in text and "old a" not in text and "## A" not in text
    assert text.replace("new a", "old a") == DOC


def test_a_missing_section_is_appended_with_heading_and_intro():
    text = replace_section(DOC, "c", "c body", heading="## C", intro="what c is")
    assert text.startswith(DOC.rstrip("\n"))
    assert text.endswith("## C\n\nwhat c is\n\n<!-- c:begin -->\nc body\n<!-- c:end -->\n")
    assert replace_section(text, "c", "c2") == text.replace("c body", "c2")


def test_write_section_creates_the_document(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section(doc, "a", "x", heading="## A")
    write_section(doc, "a", "y", heading="## A")
    assert doc.read_text() == "# Benchmarks\n\n## A\n\n<!-- a:begin -->\ny\n<!-- a:end -->\n"
