"""What an options dataclass says about its fields, and the one check that reads it. Pure Python.

A field that is a command-line option carries `option(...)` metadata: its choices, its limits, whether it is a size
(``4MiB``), its option name where that is not the field's name. `check_fields(self)` in a dataclass's
`__post_init__` checks each such field against its type annotation and its metadata and raises `ConfigError(field)`;
the CLI reads the same metadata to type a config file's values, list the choices in `--help` and find which option
fills which field (cli/config.py), so an option's type, choices and limits are written once, on its field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from conveyor.core.errors import ConfigError

OPTION = "conveyor.option"  # the metadata key of a field that is an option


@dataclasses.dataclass(frozen=True)
class OptionMeta:
    """`name`: the option's key where it is not the field's name (InputOptions.format is input_format);
    `choices`: the values it takes (None, where the field may be None, is not listed); `positive`: > 0;
    `minimum`: >= this; `size`: a byte count written like 4MiB; `switch`: the option is true or false and the field
    holds 0 or None (--prompt-logprobs: a number of alternatives); `config_file`: a --config file may set it;
    `flag`: the commands take it on the command line (else it is a config file's key only)."""

    name: str | None = None
    choices: tuple[Any, ...] = ()
    positive: bool = False
    minimum: float | None = None
    size: bool = False
    switch: bool = False
    config_file: bool = True
    flag: bool = True


def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field that is an option: `field(default=...)` with its OptionMeta."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={OPTION: OptionMeta(**meta)})


def option_meta(f: dataclasses.Field) -> OptionMeta | None:
    return f.metadata.get(OPTION)


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that are options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if OPTION in f.metadata]


def check_fields(obj: Any) -> None:
    """Check every option field of dataclass instance `obj` (type, choices, limits); a whole number given for a
    float field becomes a float. ConfigError naming the field."""
    for f in option_fields(type(obj)):
        value = getattr(obj, f.name)
        checked = check_value(type(obj), f.name, value)
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def check_value(cls: type, name: str, value: Any) -> Any:
    """`value` checked for field `name` of dataclass `cls` (its annotation, its OptionMeta); returned as the field
    holds it (an int for a float field becomes a float). None passes where the field may be None."""
    kinds, optional = _kinds(cls)[name]
    meta = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get(OPTION) or OptionMeta()
    if value is None:
        if optional:
            return None
        raise ConfigError(name, f"{name}: a value is required")
    if meta.choices and value not in meta.choices:
        allowed = [str(c) for c in meta.choices if c is not None]
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(name, f"{name}: {value!r} is not one of {', '.join(allowed)}{hint}", value)
    typed = _typed(name, value, kinds)
    if meta.positive and not typed > 0:
        raise ConfigError(name, f"{name}: must be positive, got {value!r}", value)
    if meta.minimum is not None and typed < meta.minimum:
        raise ConfigError(name, f"{name}: must be >= {meta.minimum:g}, got {value!r}", value)
    return typed


def field_kinds(cls: type, name: str) -> tuple[type, ...]:
    """The plain types (int, float, bool, str, tuple) field `name` of `cls` holds; () where its annotation is
    another type."""
    return _kinds(cls)[name][0]


_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", tuple: "a list"}


def _typed(name: str, value: Any, kinds: tuple[type, ...]) -> Any:
    if not kinds:  # an annotation this check does not read (a nested dataclass): the field checks itself
        return value
    if isinstance(value, bool):
        if bool in kinds:
            return value
    elif isinstance(value, kinds):
        return value
    elif float in kinds and isinstance(value, int):
        return float(value)
    expected = " or ".join(_NAMES[k] for k in kinds)
    raise ConfigError(name, f"{name}: expected {expected}, got {value!r}", value)


@functools.cache
def _kinds(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Field name -> (the plain types its annotation allows, whether it may be None)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        optional = type(None) in args
        kinds = []
        for arg in args:
            base = typing.get_origin(arg) or arg
            if base in _NAMES:
                kinds.append(base)
            elif isinstance(base, type) and issubclass(base, str):  # a str-valued enum (Task): given as its name
                kinds.append(str)
            elif arg is not type(None) and arg is not typing.Any:
                kinds = []  # a type not read here: leave the whole field to its own check
                break
        out[name] = (tuple(kinds), optional)
    return out
