"""Regenerate tests/data/lint_golden.json: the drift verdict of every shared template on the default set.

Run after a deliberate change to the linter, its causes or the default conversation set:
    .venv/bin/python scripts/regen_lint_golden.py
and review the diff. Tests compare against this file and never write it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "lint_golden.json"


def golden_verdicts() -> dict[str, list[dict]]:
    from verbatim.engine.models import prepare
    from verbatim.renderers import drift
    from verbatim.renderers.conversations import DEFAULT_CONVERSATIONS, load_conversations
    from verbatim.renderers.templates import official_templates, read_template
    from verbatim.renderers.tokenizers import smollm2_tokenizer

    tokenizer = smollm2_tokenizer(str(prepare()))
    conversations = load_conversations(DEFAULT_CONVERSATIONS)
    return {stem: [v.as_json() for v in drift.lint(drift.TemplateRenderer(read_template(path), tokenizer),
                                                   conversations)]
            for stem, path in official_templates().items()}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VERBATIM_HOME", str(REPO / ".cache" / "test-home"))
    verdicts = golden_verdicts()
    lines = [f"{json.dumps(stem)}: [\n" + ",\n".join("  " + json.dumps(v, ensure_ascii=False) for v in found) + "\n]"
             for stem, found in verdicts.items()]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")  # one verdict per line
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
