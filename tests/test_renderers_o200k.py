"""gpt-oss's real vocabulary: the shipped o200k_base ranks are the file harmony pins, and give harmony's own ids."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from verbatim.errors import InputError
from verbatim.paths import tokenizer_file
from verbatim.renderers.registry import get_renderer
from verbatim.renderers.tokenizers import o200k_base_ranks, o200k_harmony_tokenizer

GOLDEN = Path(__file__).parent / "data" / "o200k_harmony_golden.json"  # scripts/regen_o200k_golden.py
PINNED = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony 0.0.8, tiktoken 0.14


def test_the_shipped_ranks_are_the_file_harmony_pins(tmp_path: Path) -> None:
    shipped = tokenizer_file("o200k", "o200k_base.tiktoken.gz")
    data = gzip.decompress(shipped.read_bytes())
    assert hashlib.sha256(data).hexdigest() == PINNED
    damaged = tmp_path / "o200k_base.tiktoken.gz"
    damaged.write_bytes(gzip.compress(data.replace(b" 0\n", b" 1\n", 1)))
    with pytest.raises(InputError, match="sha256"):
        o200k_base_ranks(damaged)


def test_the_tokenizer_gives_harmony_ids() -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    tokenizer = o200k_harmony_tokenizer()
    for token_id, text in golden["special_ids"].items():
        assert tokenizer.convert_tokens_to_ids(text) == int(token_id)
    assert len(golden["cases"]) >= 8
    for case in golden["cases"]:
        assert tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"], case["source"]
        assert tokenizer.decode(case["ids"]) == case["text"]
    assert len(tokenizer) == 200019  # o200k_base's 199998 ranks + the 21 added tokens of gpt-oss's tokenizer


def test_gpt_oss_renders_with_the_real_vocabulary(default_model_dir: Path) -> None:
    renderer = get_renderer("gpt-oss", model_dir=default_model_dir)
    assert renderer.tokenizer is o200k_harmony_tokenizer()
    assert renderer.stop_token_ids == (200002, 199999, 200012)
