"""The flags of ``verbatim run`` and ``verbatim train``, built from their configs' flag tables
(:data:`~verbatim.jobs.config.RUN_FLAGS`, :data:`~verbatim.jobs.config.TRAIN_FLAGS`): each flag's name,
default and help are its field's, so a field added to a config is a flag without an edit here.

A command gets the table's flags plus ``--summary-json``, ``--force`` (replace an existing summary file)
and ``--config`` (which are not settings of the run); its body receives the config, built and checked by the
same table, and a value the config refuses is one line naming its flag (exit 2), before anything starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import click
import typer
from pydantic import BaseModel, ValidationError
from typer.core import TyperCommand

from verbatim.cli.config_file import CONFIG_HELP, config_loader
from verbatim.errors import InputError
from verbatim.jobs.flag_table import Flag, FlagTable

SUMMARY_JSON = "summary_json"
FORCE = "force"
CONFIG = "config"

PANELS = {"play": "What to play", "": "The run", "sampling": "Sampling", "plan": "The loop",
          "learner": "The learner", "placement": "The team: where the trainer runs",
          "evaluation": "Evaluation on held-out tasks", "engine": "The engine",
          "routing": "Routing over replicas", "output": "Output"}
"""``--help``'s sections: a flag's config section (its field path's first part; "" for a top-level field), in
this order."""
OUTPUT = PANELS["output"]


def job_command(table: FlagTable, body: Callable[[Any, str | None, bool], None], doc: str) -> Callable[..., None]:
    """A Typer command whose options are ``table``'s flags (in the config's order) and which calls
    ``body(config, summary_json, force)``."""
    params = [_parameter(flag) for flag in sorted(table.flags, key=_panel_rank)]
    params += [
        inspect.Parameter(SUMMARY_JSON, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],  # noqa: UP045
                          default=typer.Option(None, "--summary-json", help="Also write the summary as JSON here.",
                                               rich_help_panel=OUTPUT)),
        inspect.Parameter(FORCE, inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--force", help="Replace an existing --summary-json file.",
                                               rich_help_panel=OUTPUT)),
        inspect.Parameter(CONFIG, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],  # noqa: UP045
                          default=typer.Option(None, "--config", is_eager=True, callback=config_loader(table),
                                               help=CONFIG_HELP, rich_help_panel=OUTPUT)),
    ]

    def command(**values: Any) -> None:
        summary_json, force = values.pop(SUMMARY_JSON), values.pop(FORCE)
        values.pop(CONFIG)
        body(config_of(table, values), summary_json, force)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = doc
    return command


def config_of(table: FlagTable, values: dict[str, Any]) -> BaseModel:
    """The config the flags ``values`` describe; a refused value: one line naming its flag."""
    with flag_errors(table):
        return table.config(values)


@contextmanager
def flag_errors(table: FlagTable) -> Iterator[None]:
    """A config's refusal of a flag's value, as that flag: ``--clip-eps 1.5 must be below 1``."""
    try:
        yield
    except ValidationError as exc:
        line = table.refusal(exc)
        if line is None:
            raise
        raise InputError(line) from None


class SectionedHelp(TyperCommand):
    """A job command whose plain-text ``--help`` lists its flags in their sections (each option's
    ``rich_help_panel``, :data:`PANELS`), then its epilog (a first run)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "rich_help_panel", None) or OUTPUT, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)


def panel(flag: Flag) -> str:
    """The ``--help`` section of ``flag``."""
    section = flag.path[0] if len(flag.path) > 1 else ""
    return PANELS.get(section, section.replace("_", " ").capitalize())


def _panel_rank(flag: Flag) -> int:
    titles = list(PANELS.values())
    return titles.index(panel(flag)) if panel(flag) in titles else len(titles)


def _parameter(flag: Flag) -> inspect.Parameter:
    names = [flag.name, *flag.aliases]
    if flag.kind is bool and (flag.optional or flag.default is True):
        names = [f"{flag.name}/--no-{flag.name.removeprefix('--')}"]
    annotation: Any = list[flag.kind] if flag.multiple else flag.kind
    default = (flag.default or []) if flag.multiple else flag.default
    if default is None:
        annotation = Optional[annotation]  # noqa: UP045 - typer reads the annotation at run time
    shown = flag.help if flag.range_formula() is None else f"{flag.help}  [{flag.range_formula()}]"
    option = typer.Option(default, *names, help=shown, show_default=default not in (None, []),
                          rich_help_panel=panel(flag))
    return inspect.Parameter(flag.key, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
