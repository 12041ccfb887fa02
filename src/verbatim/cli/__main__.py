"""`python -m verbatim.cli`: the same as the `verbatim` command."""

from verbatim.cli.app import main

main()
