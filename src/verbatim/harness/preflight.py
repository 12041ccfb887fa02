"""Pre-flight of ``verbatim run``: the opening prompts, checked against the model before anything starts.

A renderer whose token ids the model does not have (``--renderer llama3`` on SmolLM2) or an opening
prompt that cannot fit ``--max-model-len`` with ``--max-tokens`` would fail every rollout: both are bad
input, refused with one line (exit code 2) before the engine starts or a file is written. The first
``PREFLIGHT_TASKS`` groups' tasks are rendered, within ``PREFLIGHT_S``. An env that cannot reset or
render a task is not refused (its rollouts record the failure), unless it calls the task bad
(:class:`InputError`, as the built-in envs' task parsing does).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from verbatim.errors import InputError
from verbatim.harness.env_output import checked_reset
from verbatim.harness.run import Run

PREFLIGHT_TASKS = 64
PREFLIGHT_S = 30.0
"""A pre-flight still busy after this (an env that hangs in ``reset``) lets the run start: it records them."""


def model_vocab_size(model_dir: str | Path | None) -> int | None:
    """``vocab_size`` from a Hugging Face folder's ``config.json`` (or its ``text_config``); None if unknown."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    for section in (config, config.get("text_config")) if isinstance(config, dict) else ():
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def preflight(run: Run, *, vocab_size: int | None, max_model_len: int, max_tokens: int,
              timeout_s: float = PREFLIGHT_S) -> None:
    """Raise :class:`InputError` for the first opening prompt the model cannot take."""
    refused: list[InputError] = []

    def work() -> None:
        try:
            for index, group in enumerate(run.groups[:PREFLIGHT_TASKS]):
                ids = _opening_prompt(run, group[0].task, group[0].seed, index)
                if ids:
                    _check(ids, index, run, vocab_size, max_model_len, max_tokens)
        except InputError as exc:
            refused.append(exc)

    thread = threading.Thread(target=work, name="verbatim-preflight", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if refused:
        raise refused[0]


def _opening_prompt(run: Run, task: dict[str, Any], seed: int, index: int) -> list[int] | None:
    """The token ids of a task's first prompt; None when the env or renderer fails (the rollout records it)."""
    try:
        reset = checked_reset(run.env.make().reset(dict(task), seed))
        tools = list(reset.tools) if reset.tools else None
        prompt = run.renderer.render(list(reset.messages), tools=tools, add_generation_prompt=True)
        return [int(t) for t in prompt.token_ids]
    except InputError as exc:
        raise InputError(f"task {index}: {exc.message}", hint=exc.hint) from None
    except Exception:  # noqa: BLE001 - not bad input: the rollouts record it
        return None


def _check(ids: list[int], index: int, run: Run, vocab_size: int | None, max_model_len: int,
           max_tokens: int) -> None:
    low, high = min(ids), max(ids)
    if vocab_size is not None and (low < 0 or high >= vocab_size):
        bad = low if low < 0 else high
        model, renderer = Path(run.manifest.model).name, run.manifest.renderer
        raise InputError(f"the opening prompt of task {index} has token id {bad}, outside the vocabulary of "
                         f"{model} ({vocab_size} tokens) with the {renderer} renderer",
                         hint="pass the --renderer that matches --model; see docs/renderers.md")
    if len(ids) + max_tokens > max_model_len:
        raise InputError(f"the opening prompt of task {index} is {len(ids)} tokens; with --max-tokens "
                         f"{max_tokens} it does not fit --max-model-len {max_model_len}",
                         hint="raise --max-model-len or lower --max-tokens")
