"""The `verbatim` command: the Typer app (`cli/app.py`) and its sub-apps; `main` is the console script."""

from verbatim.cli.app import main

__all__ = ["main"]
