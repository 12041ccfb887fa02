"""``--config FILE`` for ``verbatim run`` and ``verbatim train``: a TOML or YAML file of flags.

Its keys are the flags' names (``max_turns`` or ``max-turns``; an alias such as ``tasks`` for
``--task-file`` too), its values of the flag's type: a number, a string, true/false, a list for a
repeatable flag (``url = ["http://…", "http://…"]``), and for ``env_arg`` a table (``high = 5``) or a
list of ``KEY=VALUE`` strings. The file's values become the command's defaults (click's
``default_map``), so a flag given on the command line wins over it, and a repeatable one given there
replaces the file's whole list. An unknown key, a value of the wrong type or out of range, a file
that does not parse: one line (``InputError``, exit 2) naming the key or the line.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import typer
from pydantic import ValidationError

from verbatim.errors import DependencyError, InputError
from verbatim.jobs.flag_table import FlagTable

CONFIG_HELP = "A .toml or .yaml file of flags (keys: the flags' names); flags on the command line win over it."
KEY_VALUE_FLAGS = frozenset({"env_arg"})
"""Repeatable ``KEY=VALUE`` flags: a table in the file is written as those pairs (values as JSON)."""


def config_loader(table: FlagTable) -> Callable[[typer.Context, typer.CallbackParam, str | None], str | None]:
    """The ``--config`` option's callback for a command of ``table``'s flags (eager, so it runs before the other
    options are read): the file's values become the command's defaults."""

    def load_config(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
        if value:
            values = read_config(Path(value))
            ctx.default_map = {**(ctx.default_map or {}), **config_defaults(ctx, values, value, table)}
        return value

    return load_config


def read_config(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or YAML (``.yaml``/``.yml``) file's top-level table."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        data = _parse_toml(text, path)
    elif suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, path)
    else:
        raise InputError(f"the config file {path} must end in .toml, .yaml or .yml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: a config file holds a table of flags (KEY = VALUE), not a {_kind(data)}")
    return data


def config_defaults(ctx: typer.Context, values: dict[str, Any], source: str, table: FlagTable) -> dict[str, Any]:
    """``values`` by the command's parameter names, each checked against its option's type and its field's
    bounds."""
    options = _options_by_key(ctx)
    defaults: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        option = options.get(str(key))
        if option is None:
            close = difflib.get_close_matches(str(key), list(options), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"see 'verbatim {ctx.info_name} --help'"
            raise InputError(f"{source}: unknown key {key!r} (not a flag of 'verbatim {ctx.info_name}')", hint=hint)
        if option.name in spelled:
            raise InputError(f"{source}: {option.opts[0]} is given twice (as {spelled[option.name]!r} and {key!r})")
        spelled[option.name] = str(key)
        if value is not None:  # YAML's null: the flag's own default
            defaults[option.name] = _option_value(ctx, option, value, f"{source}: {key}")
            _check_field(table, option.name, defaults[option.name], f"{source}: {key}")
    return defaults


def _options_by_key(ctx: typer.Context) -> dict[str, Any]:
    """Every option but --config, by its parameter name and its long flags, with '_' or '-' alike."""
    keys: dict[str, Any] = {}
    for param in ctx.command.params:
        if param.name in (None, "config") or not any(opt.startswith("--") for opt in param.opts):
            continue
        for name in (param.name, *(opt.removeprefix("--") for opt in param.opts if opt.startswith("--"))):
            keys[name.replace("-", "_")] = keys[name.replace("_", "-")] = param
    return keys


def _option_value(ctx: typer.Context, option: Any, value: Any, where: str) -> Any:
    """``value`` as the option's default: of its type, then checked as the command line's would be
    (ranges: ``--max-turns`` is at least 1)."""
    value = _typed(option, value, where)
    try:
        option.process_value(ctx, value)
    except typer.BadParameter as exc:
        raise InputError(f"{where}: {exc.message}") from None
    return value


def _check_field(table: FlagTable, name: str, value: Any, where: str) -> None:
    """A value its own field refuses (``max_turns = 0``), named by the file's key; a rule across fields waits
    for the whole config (the command line may still change the other field)."""
    flag = table.by_key()[name]
    try:
        table.config({name: value})
    except ValidationError as exc:
        for error in exc.errors():
            found, shown, wanted = table.refused(error)
            if found is flag:
                raise InputError(f"{where} = {shown} {wanted}") from None


def _typed(option: Any, value: Any, where: str) -> Any:
    if not option.multiple:
        return _checked(option, value, where)
    if option.name in KEY_VALUE_FLAGS and isinstance(value, dict):
        value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
    if not isinstance(value, list):
        what = "a table or a list of KEY=VALUE strings" if option.name in KEY_VALUE_FLAGS else "a list"
        raise InputError(f"{where} must be {what} (the flag repeats), not {_kind(value)} {_shown(value)}")
    return [_checked(option, item, f"{where}[{i}]") for i, item in enumerate(value)]


def _checked(option: Any, value: Any, where: str) -> Any:
    """``value`` if its type is the option's: no true/false for a number, no number for a string."""
    kind = _value_type(option)
    if kind is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise InputError(f"{where} must be {want}, not {_kind(value)} {_shown(value)}")
    return value


def _value_type(option: Any) -> Any:
    """The Python type of one of the option's values (``int`` for ``--max-turns``, ``str`` for ``--url``)."""
    descriptor = getattr(option, "type_descriptor", None)
    if descriptor is None:  # pragma: no cover - typer before its own coercion layer: click's type names
        return {"integer": int, "integer range": int, "float": float, "float range": float,
                "boolean": bool}.get(option.type.name, str)
    annotation = descriptor.annotation
    return get_args(annotation)[0] if option.multiple and get_args(annotation) else annotation


def _shown(value: Any) -> str:
    """``value`` as the file would write it (``true``, ``"3"``)."""
    return json.dumps(value, default=str, ensure_ascii=False)


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}
    return names.get(type(value), type(value).__name__)


def _parse_toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise DependencyError("reading a .toml config file needs Python 3.11 or later",
                              hint="use a .yaml file instead") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path} is not valid TOML: {exc}") from None


def _parse_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(f"{path} is not valid YAML{where}: {problem}") from None
