"""Typed, documented dataclass fields (peft-style configs): `option(...)` declares a field with its
help text and allowed values, `check_fields(obj)` validates every field's value against its
annotation on construction, so a wrongly typed value is one clear error, never a TypeError later."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field

from hf_fedtask.errors import ConfigError


def option(default, help: str, choices: tuple | None = None, minimum: float | None = None,
           maximum: float | None = None, exclusive_minimum: bool = False, exclusive_maximum: bool = False,
           **kwargs):
    """A dataclass field with `help` (shown by `--help`), optional `choices` and a range (`minimum`,
    `maximum`, inclusive unless `exclusive_minimum` / `exclusive_maximum`; for a list, of each element)."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum,
                "exclusive_minimum": exclusive_minimum, "exclusive_maximum": exclusive_maximum}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


def field_type(cls, name: str) -> tuple[type, bool, bool]:
    """(element type, is_list, optional) of `cls`'s field `name`, e.g. `list[str] | None` -> (str, True, True)."""
    hint = typing.get_type_hints(cls)[name]
    args = list(typing.get_args(hint)) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else [hint]
    optional = type(None) in args
    args = [a for a in args if a is not type(None)]
    base = args[0]
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], True, optional
    return base, False, optional


def _coerce(value, kind: type, where: str):
    """`value` as `kind`, accepting ints for floats; anything else of the wrong type is an error."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ConfigError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def check_fields(obj, source: str = "config") -> None:
    """Validate (and normalize ints to floats where a float is expected) every field of dataclass `obj`."""
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        kind, is_list, optional = field_type(type(obj), f.name)
        value = getattr(obj, f.name)
        where = f"{source}: {f.name}"
        if value is None:
            if not optional:
                raise ConfigError(f"{where}: a value is required")
            continue
        if is_list:
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{where}: expected a list, got {value!r}")
            value = [_coerce(v, kind, where) for v in value]
        else:
            value = _coerce(value, kind, where)
        values = value if is_list else [value]
        choices = f.metadata.get("choices")
        if choices and any(v not in choices for v in values):
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        low, high = f.metadata.get("minimum"), f.metadata.get("maximum")
        open_low, open_high = f.metadata.get("exclusive_minimum"), f.metadata.get("exclusive_maximum")
        if any((low is not None and (v <= low if open_low else v < low))
               or (high is not None and (v >= high if open_high else v > high)) for v in values):
            raise ConfigError(f"{where}: must be {_bounds(low, high, open_low, open_high)}, got {value!r}")
        object.__setattr__(obj, f.name, value)


def allowed_values(f: dataclasses.Field) -> str | None:
    """What `f` accepts, for help texts: `{a, b}`, `(>= 1)`, `(in (0.0, 1.0])`; None if any value of its type."""
    meta = f.metadata or {}
    if meta.get("choices"):
        return "{" + ", ".join(map(str, meta["choices"])) + "}"
    if meta.get("minimum") is not None or meta.get("maximum") is not None:
        bounds = _bounds(meta.get("minimum"), meta.get("maximum"), meta.get("exclusive_minimum"),
                         meta.get("exclusive_maximum"))
        return f"({bounds})"
    return None


def _bounds(low, high, open_low: bool, open_high: bool = False) -> str:
    """A range in words: `in (0, 1]`, `>= 1`, `< 5`."""
    if low is not None and high is not None:
        return f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f"{'>' if open_low else '>='} {low}"
    return f"{'<' if open_high else '<='} {high}"
