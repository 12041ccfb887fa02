"""Benchmarks rewrite only their own marked section of a named document, ending it with the machine."""

from __future__ import annotations

import pytest

from verbatim.bench import docsection
from verbatim.bench.docsection import replace_section, require_section, write_section
from verbatim.errors import InputError

DOC = ("# Benchmarks\n\nintro\n\n<!-- a:begin -->\nold a\n<!-- a:end -->\n\nprose after a\n\n"
       "<!-- b:begin -->\nb\n<!-- b:end -->\n")


def test_a_section_is_replaced_in_place_and_everything_else_kept():
    text = replace_section(DOC, "a", "new a")
    assert "new a" in text and "old a" not in text
    assert text.replace("new a", "old a") == DOC


def test_a_missing_section_is_an_input_error_not_an_append():
    with pytest.raises(InputError, match="c:begin"):
        replace_section(DOC, "c", "c body")
    with pytest.raises(InputError):  # an end marker before the begin marker is no section
        replace_section("<!-- c:end -->\n<!-- c:begin -->\n", "c", "x")


def test_write_section_ends_the_section_with_the_machine_line(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_section(doc, "a", "x", machine_line="Machine (detected): M1.")
    write_section(doc, "a", "y\n", machine_line="Machine (detected): M2.")
    text = doc.read_text()
    assert "<!-- a:begin -->\ny\n\nMachine (detected): M2.\n<!-- a:end -->" in text
    assert "M1" not in text and text.endswith("prose after a\n\n<!-- b:begin -->\nb\n<!-- b:end -->\n")


def test_write_section_detects_the_machine_when_not_given(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    asked = []
    monkeypatch.setattr(docsection.machine, "provenance", lambda libraries: asked.append(libraries) or "M.")
    write_section(doc, "b", "z", libraries=("torch",))
    assert asked == [("torch",)] and "<!-- b:begin -->\nz\n\nM.\n<!-- b:end -->" in doc.read_text()


def test_a_missing_file_or_section_is_a_one_line_error_that_says_what_to_add(tmp_path):
    with pytest.raises(InputError) as missing:
        require_section(tmp_path / "nope.md", "a")
    assert "no such file" in missing.value.one_line() and "<!-- a:begin -->" in missing.value.one_line()
    doc = tmp_path / "other.md"
    doc.write_text("# Other\n")
    with pytest.raises(InputError) as unmarked:
        write_section(doc, "a", "x", machine_line="M.")
    line = unmarked.value.one_line()
    assert "\n" not in line and "<!-- a:begin -->" in line and "<!-- a:end -->" in line and "add" in line
    assert doc.read_text() == "# Other\n"


def test_the_command_a_section_names_is_the_line_a_reader_would_type():
    line = docsection.command_line("learn", steps=None, seed=[1, 0], repeats=3, ablation=False, model="default",
                                   json=True, write="docs/benchmarks.md", empty=[])
    assert line == "verbatim bench learn --seed 1 --seed 0 --repeats 3 --no-ablation --json --write docs/benchmarks.md"
    assert docsection.command_line("router", seed=0, model="0.5b") == "verbatim bench router --seed 0 --model 0.5b"
