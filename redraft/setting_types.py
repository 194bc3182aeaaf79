"""A setting's type: how a value is read, converted, checked and named.

The helpers behind :class:`redraft.settings.Settings`: a field's type split into its optional
part, its union members and its sequence shape; a command-line string or a YAML value converted
to that type; the check that a value has it; and how the type is named in help and errors.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redraft.settings import Range


def _split_optional(tp) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; ``int`` -> ``(int, False)``; a wider union (``Literal["auto"]
    | int | None``) -> that union without ``None`` (``Literal["auto"] | int``, True)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), optional
    return tp, tp is Any


def _members(tp) -> tuple[tuple, tuple] | None:
    """A union's ``(literal values, other member types)`` (``Literal["auto"] | bool`` ->
    ``(("auto",), (bool,))``); None for any other type."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    values, others = [], []
    for a in typing.get_args(tp):
        if typing.get_origin(a) is typing.Literal:
            values += typing.get_args(a)
        elif a is not type(None):
            others.append(a)
    return tuple(values), tuple(others)


def _sequence(tp) -> tuple[type, Any, int | None] | None:
    """``tuple[float, float]`` -> ``(tuple, float, 2)``; ``list[str]`` / ``tuple[str, ...]`` ->
    ``(list|tuple, str, None)``; a bare ``tuple`` -> ``(tuple, Any, None)``; else None."""
    origin = typing.get_origin(tp) or tp
    if origin not in (list, tuple):
        return None
    args = typing.get_args(tp)
    if not args:
        return origin, Any, None
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return tuple, args[0], len(args)
    return origin, args[0], None


def _type_name(tp) -> str:
    union = _members(tp)
    if union is not None:
        return " or ".join([repr(v) for v in union[0]] + [_type_name(m) for m in union[1]])
    return (
        getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")
    )


def _convert(tp, value):
    """``value`` (already YAML-parsed) as type ``tp``; ValueError/TypeError when it is not one."""
    if tp is Any:
        return value
    union = _members(tp)
    if union is not None:  # a literal as given, else the first member type that takes the value
        values, others = union
        if isinstance(value, str) and value in values:
            return value
        for member in others:
            try:
                return _convert(member, value)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"expected {_kind(tp, False, None)}")
    seq = _sequence(tp)
    if seq is not None:
        container, item, _ = seq
        if isinstance(value, str):
            value = [s.strip() for s in value.split(",") if s.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list")
        return container(_convert(item, _parsed(item, v)) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if isinstance(value, bool) and tp in (int, float):
        raise ValueError("expected a number")
    if tp is int:
        if isinstance(value, str) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        return int(value)
    if tp is float:
        if isinstance(value, str):
            return float(value)  # '3e-4': YAML 1.1 reads it as a string
        if not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list, tuple)):
            raise ValueError("expected a string")
        return str(value)
    return value


def _parsed(tp, value):
    """A command-line string read as YAML for a non-string field (``'3e-4'``, ``'true'``,
    ``'[0.8, 0.95]'``, ``'12'``); a string field keeps its text."""
    if not isinstance(value, str) or tp is str:
        return value
    import yaml

    if not value.strip():
        return None
    if _sequence(tp) is not None and not value.lstrip().startswith("["):
        return value  # a comma list, split by _convert
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:  # a control character, an unclosed bracket: not a value
        raise ValueError(f"cannot be read ({type(exc).__name__})") from None
    return value if isinstance(parsed, (dict, list)) and _sequence(tp) is None else parsed


def _kind(tp, optional: bool, r: Range | None) -> str:
    union = _members(tp)
    if union is not None:
        kinds = [repr(v) for v in union[0]] + [_kind(m, False, r) for m in union[1]]
        return ", ".join(kinds[:-1]) + " or " + kinds[-1] + (" or none" if optional else "")
    what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, "a valid value"
    )
    return (
        what
        + (f" {r}" if r is not None and tp in (int, float) else "")
        + (" or none" if optional else "")
    )


def _type_ok(tp, v) -> bool:
    union = _members(tp)
    if union is not None:
        return v in union[0] or any(_type_ok(m, v) for m in union[1])
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    seq = _sequence(tp)
    if seq is not None:
        return isinstance(v, (list, tuple)) and (seq[2] is None or len(v) == seq[2])
    return True
