"""Dotted ``key=value`` overrides and typed field values: the one implementation behind
``loom train``'s run config (`loom.train.config`) and ``loom simulate``'s scenario files
(`loom.sim.scenario`), so both read an override and check a value's type the same way.

It lives beside `Plan` because both config layers sit above ``loom.plan`` and the simulator may
not import the training package (pyproject.toml's layer contract).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


# a check of a dataclass's converted fields before it is built: (class, where, fields)
FieldsCheck = Callable[[type, str, dict[str, Any]], None]

_EXAMPLE = {int: "a whole number such as 10", float: "a number such as 0.5", str: 'quoted text such as "demo"',
            bool: "true or false"}


def parse_override(item: str) -> tuple[list[str], Any]:
    """``dotted.key=value`` as (key parts, TOML value; a bare word is a string)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: write it as dotted.key=value, e.g. run.steps=10")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return key.split("."), value


def set_dotted(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    """Set ``data[parts[0]][parts[1]]...`` to ``value``, creating missing tables; ``item`` (the
    override as given) names a key on the way that holds a value, not a table."""
    node = data
    for i, p in enumerate(parts[:-1]):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            where = ".".join(parts[:i + 1])
            raise ConfigError(f"override {item!r}: {where} is not a table but a value; override {where} itself "
                              f"(e.g. {where}=...) or a key of a table")
    node[parts[-1]] = value


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override to the parsed tables ``data``."""
    parts, value = parse_override(item)
    set_dotted(data, parts, value, item)


def typed_value(tp: Any, v: Any, where: str, check: FieldsCheck | None = None) -> Any:
    """``v`` as type ``tp`` (a dataclass, ``list[...]``, ``dict[...]``, ``X | None``, a scalar
    type), or the one-line `ConfigError` naming ``where``: the check every field of a config
    passes. ``check`` sees every dataclass's converted fields before it is built."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if v is None or v is False or (isinstance(v, str) and v.lower() == "none"):
            if type(None) in args:
                return None
        return typed_value(inner[0], v, where, check)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, v, where, check)
    if origin in (list, tuple):
        if not isinstance(v, list):
            raise ConfigError(f"{where} = {v!r}: must be a list; write it as [a, b, ...]")
        return list(v) if origin is list else tuple(v)
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where} = {v!r}: must be a table; write it as {{key = value, ...}}")
        return dict(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (int, float, str, bool) and not (isinstance(v, tp) and not (tp is int and isinstance(v, bool))):
        raise ConfigError(f"{where} = {v!r}: must be of type {tp.__name__}; write {_EXAMPLE[tp]}")
    return v


def build_dataclass(cls: type, data: Any, where: str, check: FieldsCheck | None = None) -> Any:
    """``cls`` from the table ``data`` (at ``where``, "" for the top level): unknown keys and
    wrong types are refused naming the field; ``check`` runs on the converted fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} = {data!r}: must be a table; write [{where}] with key = value lines")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in [{where or 'top level'}]; known: {sorted(names)}; "
                          f"remove or rename them")
    kwargs = {k: typed_value(hints[k], v, f"{where}.{k}" if where else k, check) for k, v in data.items()}
    if check is not None:
        check(cls, where, kwargs)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ConfigError(f"[{where or 'top level'}]: {e}; correct that value of [{where or 'top level'}]") from e
