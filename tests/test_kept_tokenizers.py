"""Converted vocabularies are kept in verbatim's home and read back exactly (renderers/tokenizers.py)."""

from __future__ import annotations

import os

import pytest

from verbatim.paths import tokenizer_file
from verbatim.renderers import tokenizers

TEXT = "Hello <|endoftext|> wörld\n\n  ’ 12345 <|user|> ok 🤖 こんにちは"


def phi3():
    return tokenizers._gguf_tokenizer("phi3", tokenizer_file("phi3", "ggml-vocab-phi-3.gguf"))


def seen(tokenizer) -> tuple:
    ids = tokenizer.encode(TEXT)
    return (ids, tokenizer.decode(ids), len(tokenizer), tokenizer.special_tokens_map, tokenizer.all_special_ids,
            tokenizer.backend_tokenizer.to_str())


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VERBATIM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_conversion_is_kept_and_read_back_as_it_was_converted(home, monkeypatch):
    converted = phi3()
    kept = tokenizers.kept_conversion("phi3", tokenizer_file("phi3", "ggml-vocab-phi-3.gguf"))
    assert kept.parent == home / "tokenizers" and kept.is_file()
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no partial file left beside it

    def no_conversion(*_args):
        raise AssertionError("converted again although a kept conversion is there")

    monkeypatch.setattr("transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer",
                        no_conversion)
    assert seen(phi3()) == seen(converted)


def test_a_damaged_kept_conversion_is_converted_again_and_replaced(home):
    want = seen(phi3())
    kept = tokenizers.kept_conversion("phi3", tokenizer_file("phi3", "ggml-vocab-phi-3.gguf"))
    kept.write_text('{"specials": {}, "backend": "{not json')
    assert seen(phi3()) == want
    assert seen(phi3()) == want and kept.stat().st_size > 1000


def test_the_key_follows_the_source_file(home, tmp_path):
    source = tmp_path / "vocab.gguf"
    source.write_bytes(tokenizer_file("phi3", "ggml-vocab-phi-3.gguf").read_bytes())
    first = tokenizers.kept_conversion("phi3", source)
    os.utime(source, ns=(1, 1))
    assert tokenizers.kept_conversion("phi3", source) != first
    assert tokenizers.kept_conversion("phi3", source) != tokenizers.kept_conversion("gemma3", source)


def test_a_home_that_cannot_be_written_still_gives_the_tokenizer(home):
    home.write_text("a file where the folder would be")  # mkdir fails as it would in a read-only home, root too
    assert len(phi3()) > 30000 and home.is_file()
