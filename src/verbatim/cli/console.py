"""The command line's two consoles: results on stdout, errors and warnings on stderr.

Every sub-app prints through these, so settings are set once. Rich looks up
``sys.stdout``/``sys.stderr`` at print time, so tests that capture streams see the output.
"""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
