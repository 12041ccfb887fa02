"""The `verbatim` command: the Typer app and its sub-apps."""

from verbatim.cli.app import app, main

__all__ = ["app", "main"]
