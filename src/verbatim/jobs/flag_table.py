"""A job's flags, derived from its config model through one table (flag name ↔ field path).

Every leaf field of the config, nested models walked, is a flag named after it (``max_turns`` →
``--max-turns``); its type, default, bounds and help (the field's docstring) are the field's, written once
there. The table holds only the exceptions: another name or aliases, a conversion between the flag's text
and the field's value (``--token-mask-band 0.5,5`` ↔ ``(0.5, 5.0)``), a field that is no flag (derived from
others). The same table turns flags into the config (:meth:`FlagTable.config`), the config back into flags
(:meth:`FlagTable.values`: the run folder's ``config.toml``, which ``--config`` reads), and a refused value
into one line naming its flag (:meth:`FlagTable.refusal`).
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from verbatim.errors import InputError


@dataclass(frozen=True)
class Spec:
    """The table's word on one field, where the rule (flag named after the field, value as it is) does not do."""

    name: str | None = None
    """The flag, ``--…`` (default: the field's name with ``-`` for ``_``)."""
    aliases: tuple[str, ...] = ()
    parse: Callable[[Any], Any] | None = None
    """The flag's value → the field's (a text ``LOW,HIGH`` → a pair)."""
    show: Callable[[Any], Any] | None = None
    """The field's value → the flag's (its inverse: what ``config.toml`` writes, and ``--help``'s default)."""
    kind: type | None = None
    """The type of one of the flag's values where it is not the field's (``str`` for a pair written as text)."""
    multiple: bool | None = None
    """Whether the flag repeats, where the field's type does not say it (a mapping of ``KEY=VALUE`` flags)."""
    derived: bool = False
    """No flag: the field follows from others (the config derives it)."""


DERIVED = Spec(derived=True)


@dataclass(frozen=True)
class Flag:
    """One flag of a job: the field it sets, and how its values read and show."""

    path: tuple[str, ...]
    name: str
    aliases: tuple[str, ...]
    kind: type
    multiple: bool
    optional: bool
    """The field takes None (a flag left out may mean "not set")."""
    default: Any
    """The flag's default, as the flag shows it."""
    help: str
    bounds: tuple[tuple[str, Any], ...] = ()
    """The field's numeric bounds: ``(("gt", 0), ("le", 1))``."""
    parse: Callable[[Any], Any] | None = None
    show: Callable[[Any], Any] | None = None

    def range_formula(self) -> str | None:
        """The bounds as click's ``--help`` shows a range: ``0<x<=1``, ``x>=1``."""
        found = dict(self.bounds)
        high = f"<{_number(found['lt'])}" if "lt" in found else f"<={_number(found['le'])}" if "le" in found else ""
        if not high:  # a lower bound alone reads from x, as click's: x>=1
            return f"x>{_number(found['gt'])}" if "gt" in found else f"x>={_number(found['ge'])}" if "ge" in found \
                else None
        low = f"{_number(found['gt'])}<" if "gt" in found else f"{_number(found['ge'])}<=" if "ge" in found else ""
        return f"{low}x{high}"

    def range_words(self) -> str | None:
        """The bounds in words: ``in (0, 1]``, ``at least 1``, ``above 0``."""
        found = dict(self.bounds)
        low = ("(", found["gt"]) if "gt" in found else ("[", found["ge"]) if "ge" in found else None
        high = (found["lt"], ")") if "lt" in found else (found["le"], "]") if "le" in found else None
        if low and high:
            return f"in {low[0]}{_number(low[1])}, {_number(high[0])}{high[1]}"
        words = {"gt": "above", "ge": "at least", "lt": "below", "le": "at most"}
        return " and ".join(f"{words[name]} {_number(bound)}" for name, bound in self.bounds) or None

    @property
    def key(self) -> str:
        """The flag's name as a parameter and as a config file's key: ``max_turns``."""
        return self.name.removeprefix("--").replace("-", "_")

    def field_value(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.parse is not None:
            try:
                return self.parse(value)
            except ValueError as exc:  # a text the flag cannot read: named by the flag
                raise InputError(f"{self.name} {value} {exc}") from None
        return tuple(value) if self.multiple else value

    def flag_value(self, value: Any) -> Any:
        if self.show is not None:
            return self.show(value)
        if isinstance(value, enum.Enum):
            return value.value
        return list(value) if self.multiple and value is not None else value


@dataclass(frozen=True)
class FlagTable:
    """The flags of ``model`` (a frozen pydantic config), by the rule and the exceptions in ``specs`` (keyed by
    dotted field path: ``"learner.loss.clip_eps"``)."""

    model: type[BaseModel]
    specs: Mapping[str, Spec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flags = tuple(_walk(self.model, (), self.specs))
        unknown = set(self.specs) - {".".join(f.path) for f in flags} - _derived(self.specs)
        if unknown:
            raise ValueError(f"the flag table of {self.model.__name__} names no such fields: {sorted(unknown)}")
        names = [n for f in flags for n in (f.name, *f.aliases)]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise ValueError(f"{self.model.__name__}: two fields would be the flag {sorted(twice)}")
        object.__setattr__(self, "flags", flags)
        object.__setattr__(self, "_keys", {f.key: f for f in flags})
        object.__setattr__(self, "_paths", {f.path: f for f in flags})

    flags: tuple[Flag, ...] = field(init=False, default=())
    _keys: Mapping[str, Flag] = field(init=False, default_factory=dict, repr=False)
    _paths: Mapping[tuple[str, ...], Flag] = field(init=False, default_factory=dict, repr=False)

    def by_path(self, path: tuple[str, ...]) -> Flag | None:
        return self._paths.get(path)

    def by_key(self) -> Mapping[str, Flag]:
        return self._keys

    def config(self, values: Mapping[str, Any]) -> Any:
        """The config that flags ``values`` (by :attr:`Flag.key`; a missing one keeps its default) describe;
        a value the config refuses: :class:`ValidationError` (:meth:`refusal` names its flag)."""
        keys = self.by_key()
        nested: dict[str, Any] = {}
        for key, value in values.items():
            put(nested, keys[key].path, keys[key].field_value(value))
        return self.model.model_validate(nested)

    def values(self, config: BaseModel) -> dict[str, Any]:
        """Every flag's value in ``config``, as the flag shows it (None: the flag is not set)."""
        found = {}
        for flag in self.flags:
            value: Any = config
            for part in flag.path:
                value = getattr(value, part)
            found[flag.key] = None if value is None and flag.show is None else flag.flag_value(value)
            if found[flag.key] is None and flag.default is not None:
                raise ValueError(f"{flag.name}: None, whose default is {flag.default!r}, needs a Spec.show")
        return found

    def nest(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """A config recorded before it had sections (``{"max_tokens": 48, "plan": {…}}``) in today's shape: each
        key that is no field of the model goes where the field of that name, or of that flag, is now. A key
        that names neither stays where it is (a comparison shows it)."""
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            info = self.model.model_fields.get(key)
            kept = info is not None and (isinstance(value, Mapping) or _model_of(info.annotation) is None)
            flag = None if kept else next((f for f in self.flags if f.path[-1] == key or f.key == key), None)
            put(nested, flag.path if flag is not None else (key,), value)
        return nested

    def refusal(self, exc: ValidationError) -> str | None:
        """The config's first refusal as one line naming the flag: ``--clip-eps 1.5 must be below 1``; None
        where it names no flag's field."""
        flag, shown, wanted = self.refused(exc.errors()[0])
        if flag is None:  # a rule across fields (a model's own check): its message names the flags
            return wanted or None
        return f"{flag.name} {shown} {wanted}"

    def refused(self, error: Mapping[str, Any]) -> tuple[Flag | None, str, str]:
        """One of pydantic's errors as (its flag, the value as the flag shows it, what the value must be)."""
        loc = tuple(part for part in error.get("loc", ()) if isinstance(part, str))
        flag = next((self.by_path(loc[:n]) for n in range(len(loc), 0, -1) if self.by_path(loc[:n])), None)
        wanted = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
        if flag is not None and str(error.get("type", "")).startswith(("greater", "less")) and flag.range_words():
            wanted = f"must be {flag.range_words()}"
        wanted = wanted.replace("Input should be", "must be").replace("greater than or equal to", "at least")
        wanted = wanted.replace("greater than", "above").replace("less than or equal to", "at most")
        wanted = wanted.replace("less than", "below")
        value = error.get("input")
        if flag is not None and isinstance(value, (tuple, list, enum.Enum)):
            value = flag.flag_value(value)
        return flag, format(value, "g") if isinstance(value, float) else str(value), wanted


def put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """``value`` at the field path ``path`` of a nested dict (``("learner", "lr")`` → ``tree["learner"]["lr"]``),
    the sections on the way made where missing."""
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _number(value: Any) -> str:
    """A bound as the flag takes it: an integer whole (4294967295), a float short (1e-05)."""
    return format(value, "g") if isinstance(value, float) else str(value)


def _derived(specs: Mapping[str, Spec]) -> set[str]:
    return {path for path, spec in specs.items() if spec.derived}


def _walk(model: type[BaseModel], prefix: tuple[str, ...], specs: Mapping[str, Spec]) -> list[Flag]:
    flags: list[Flag] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        spec = specs.get(".".join(path), Spec())
        if spec.derived:
            continue
        nested = _model_of(info.annotation)
        if nested is not None:
            flags.extend(_walk(nested, path, specs))
        else:
            flags.append(_flag(path, info, spec))
    return flags


def _flag(path: tuple[str, ...], info: FieldInfo, spec: Spec) -> Flag:
    where = ".".join(path)
    annotation, optional = _unwrapped(info.annotation)
    multiple = spec.multiple if spec.multiple is not None else _is_sequence(annotation)
    kind = spec.kind or _value_kind(typing.get_args(annotation)[0] if multiple and typing.get_args(annotation)
                                     else annotation, where)
    if not info.description:
        raise ValueError(f"{where} has no docstring: a flag's help is its field's docstring")
    default = info.get_default(call_default_factory=True)
    bounds = tuple((name, getattr(rule, name)) for rule in info.metadata for name in ("gt", "ge", "lt", "le")
                   if getattr(rule, name, None) is not None)
    flag = Flag(path=path, name=spec.name or "--" + path[-1].replace("_", "-"), aliases=spec.aliases, kind=kind,
                multiple=multiple, optional=optional, default=None, help=" ".join(info.description.split()),
                bounds=bounds, parse=spec.parse, show=spec.show)
    shown = None if default is None else flag.flag_value(default)
    return Flag(**{**flag.__dict__, "default": shown})


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _unwrapped(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` → (X, True); an ``Annotated`` type → its base."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrapped(args[0])[0], True
    return annotation, False


def _is_sequence(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (tuple, list) and typing.get_args(annotation)[-1:] == (Ellipsis,) \
        or typing.get_origin(annotation) is list


def _value_kind(annotation: Any, where: str) -> type:
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return type(next(iter(annotation)).value)
    if annotation in (bool, int, float, str):
        return annotation
    raise ValueError(f"{where}: a field of type {annotation} needs a Spec saying how its flag reads (parse, kind)")
