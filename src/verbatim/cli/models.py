"""``verbatim models``: list the bundled models, prepare one (a GGUF converted once into a Hugging Face
folder, offline), and write a tiny random model of a family for tests and trials.

Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

import typer
from rich.table import Table

from verbatim.cli.console import console
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN
from verbatim.harness.tiny_models import TINY_FAMILIES

models_app = typer.Typer(help="List and prepare models (the bundled default needs no download).",
                         no_args_is_help=True, rich_markup_mode=None)


@models_app.command("list")
def models_list() -> None:
    """List the bundled models and whether each is prepared."""
    from verbatim.engine import models

    for name, bundled in sorted(models.BUNDLED.items()):
        table = Table(title=name + (" (default)" if name == models.DEFAULT_MODEL else ""), title_justify="left",
                      show_header=False, box=None)
        table.add_column("field", no_wrap=True, style="bold")
        table.add_column("value")
        table.add_row("context", f"{DEFAULT_MAX_MODEL_LEN} tokens, as every command uses unless --max-model-len "
                                 f"says otherwise (the model's own maximum: {bundled.max_context})")
        table.add_row("prepared", str(models.prepared_path(name)) if models.is_prepared(name)
                      else "no (verbatim models prepare)")
        table.add_row("package", bundled.distribution)
        table.add_row("about", bundled.description)
        console.print(table)
    console.print("Any Hugging Face model folder can be passed as --model PATH too.")


@models_app.command("prepare")
def models_prepare(
    name: str = typer.Argument(None, help="Bundled model name (default: the default model)."),
) -> None:
    """Convert a bundled GGUF model into a Hugging Face folder (once, offline)."""
    from verbatim.engine import models

    path = models.prepare(name or models.DEFAULT_MODEL)
    console.print(str(path))


@models_app.command("tiny")
def models_tiny(
    family: str = typer.Argument(..., help=f"One of: {', '.join(TINY_FAMILIES)}."),
    out: str = typer.Option(..., "--out", help="The model folder to write (missing, empty or an earlier tiny one)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the random weights: the same seed writes the same file."),
) -> None:
    """Write a tiny random model folder of a family: 2 layers, hidden 64, head_dim 32, float32, with
    the family's real tokenizer and official chat template, for --model DIR with no download
    (gemma2 takes Gemma 3's 262k vocabulary: Gemma 2's own is not shipped)."""
    from verbatim.harness.tiny_models import build_tiny_folder

    made = build_tiny_folder(family, out, seed)
    console.print(f"{made.path}  ({made.family.name}: {made.family.model_type}, vocab {made.vocab_size}, "
                  f"renderer {made.family.renderer}, template {made.template}.jinja, seed {seed})")
