"""One settings schema: a dataclass whose fields carry their help, range and choices.

Every settings object of redraft (``TrainConfig``, ``DecoderConfig``, the bench's and the
server's settings) is a dataclass that mixes in :class:`Settings` and declares each field with
:func:`setting`::

    @dataclass
    class Mine(Settings):
        KIND = "mine setting"                       # how an unknown key is named in errors
        lr: float = setting(1e-3, "Peak learning rate.", range=Range(0, lo_open=True))
        loss: str = setting("ce", "The loss.", choices=("ce", "kd"))
        limit: int | None = setting(None, "At most this many records.", range=Range(1))

From that one declaration the mixin:

* reads a mapping (a YAML file, keyword arguments) with :meth:`Settings.from_dict`: an unknown
  key is a ``ConfigError`` naming the file and the closest known keys;
* converts command-line strings and YAML values to the field's real type
  (:meth:`Settings.coerce`: ``int | None``, ``bool``, ``float``, ``str``, ``tuple[float, float]``,
  ``list[str]`` from a comma list);
* checks every value in one loop (:meth:`Settings.validate`: type, range, choices, then the
  class's own cross-field :meth:`Settings.check`);
* generates the argparse flags (:meth:`Settings.add_arguments`: ``--kebab-case``,
  ``--x/--no-x`` for booleans, choices and ``(default: ...)`` in the help; every flag defaults to
  ``None`` so :meth:`Settings.given` tells what the user typed).

:func:`load_yaml` is the one YAML reader: it splits a file's keys between several schemas (a
bench recipe holds bench and decoder settings) and rejects a key none of them owns.

How a field's type reads, converts, checks and names a value is :mod:`redraft.setting_types`.
Nothing here imports torch, so command-line ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from redraft.errors import ConfigError
from redraft.setting_types import (
    _convert,
    _kind,
    _members,
    _parsed,
    _sequence,
    _split_optional,
    _type_ok,
)


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric setting: ``lo <= v`` (``lo < v`` when ``lo_open``), and
    ``v <= hi`` (``v < hi`` when ``hi_open``); finite. ``None`` is allowed when the field's type
    is optional (``int | None``), whatever its range."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return above and below

    def __str__(self) -> str:
        s = f"{'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            s += f" and {'<' if self.hi_open else '<='} {self.hi}"
        return s


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    range: Range | None = None,
    choices: typing.Iterable | None = None,
    hint: str = "",
    flag: str | None = None,
    flags: tuple[str, ...] = (),
    metavar: str | tuple[str, ...] | None = None,
    repeat: bool = False,
    literal: bool = False,
    cli: bool = True,
    default_factory: Any = dataclasses.MISSING,
):
    """A dataclass field with its schema: ``help`` (the flag's help), ``range`` (numeric bounds),
    ``choices`` (the allowed values), ``hint`` (appended to an out-of-range error, e.g.
    ``" (0 turns clipping off)"``), ``flag`` (the option string when it is not ``--<key>``, e.g.
    ``"--drafter"`` for ``drafters``), ``flags`` (extra option strings, e.g. ``("--steps",)``),
    ``metavar``, ``repeat`` (a list given by repeating the flag), ``literal`` (an optional string
    taken as typed: ``none`` is not read as None, e.g. a secret), and ``cli=False`` for a setting
    that has no flag (a file-only key)."""
    meta = {
        "help": help,
        "range": range,
        "choices": tuple(choices) if choices is not None else None,
        "hint": hint,
        "flag": flag,
        "flags": tuple(flags),
        "metavar": metavar,
        "repeat": repeat,
        "literal": literal,
        "cli": cli,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(key: str) -> str:
    """``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + key.replace("_", "-")


# ------------------------------------------------------------------------------ the mixin


class Settings:
    """Mixin for a settings dataclass whose fields are declared with :func:`setting`."""

    KIND = "setting"  # "Unknown training setting 'x' in recipe.yaml"

    # ---- the schema
    @classmethod
    def schema(cls) -> dict[str, dataclasses.Field]:
        return _schema(cls)

    @classmethod
    def field_type(cls, key: str) -> tuple[Any, bool]:
        """The field's type without ``None`` and whether ``None`` is allowed."""
        return _split_optional(_hints(cls)[key])

    @classmethod
    def help(cls, key: str) -> str:
        return cls.schema()[key].metadata.get("help", "")

    @classmethod
    def unknown(cls, key, where: str, known=None) -> ConfigError:
        """The error for a key the schema does not hold: names it, where it was, the closest keys."""
        known = sorted(known if known is not None else cls.schema())
        close = difflib.get_close_matches(str(key), known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return ConfigError(
            f"Unknown {cls.KIND} {key!r} in {where}.{hint} Known settings: {', '.join(known)}.",
            param=str(key),
        )

    @classmethod
    def subject(cls, key: str, value) -> str:
        """How an error names a setting and its value: ``--lr -1.0`` (a class whose settings are
        mostly flags); :class:`DecoderConfig` says ``decoder setting budget=-1``."""
        return f"{cls.flag(key)} {value!r}"

    @classmethod
    def flag(cls, key: str) -> str:
        """The option string of setting ``key`` (``--max-steps``; ``--drafter`` for ``drafters``)."""
        return cls.schema()[key].metadata.get("flag") or flag_name(key)

    # ---- values in
    @classmethod
    def coerce(cls, key: str, value: Any, where: str = "the command line") -> Any:
        """``value`` (a command-line string or a YAML value) as the type of field ``key``.
        ``'none'``/``'null'``/empty is ``None`` for an optional field."""
        if key not in cls.schema():
            raise cls.unknown(key, where)
        tp, optional = cls.field_type(key)
        try:
            value = _parsed(tp, value)
        except Exception as exc:  # yaml.YAMLError, without importing yaml here
            raise ConfigError(
                f"Setting {key}={value!r} in {where} cannot be read ({type(exc).__name__}).",
                param=key,
            ) from None
        literal = cls.schema()[key].metadata.get("literal", False)
        if value is None or (
            optional
            and not literal
            and isinstance(value, str)
            and value.lower() in ("none", "null")
        ):
            return None
        try:
            return _convert(tp, value)
        except (TypeError, ValueError) as exc:
            r = cls.schema()[key].metadata.get("range")
            valid = f"; valid: {r}" if r is not None else ""
            raise ConfigError(
                f"{cls.subject(key, value)} ({key} in {where}) has the wrong type "
                f"({cls.schema()[key].type}): {exc}{valid}.",
                param=key,
            ) from exc

    @classmethod
    def check_keys(cls, values: dict, where: str) -> None:
        for key in values:
            if key not in cls.schema():
                raise cls.unknown(key, where)

    @classmethod
    def from_dict(cls, values: dict, where: str | None = None, coerce: bool = False):
        """Build from a mapping (a preset, keyword arguments), validated; an unknown key is an
        error naming it and ``where`` (default: "the <KIND>s"). ``coerce``: convert strings and
        YAML values to the fields' types first (strict otherwise: ``"3"`` is not an int)."""
        where = where or f"the {cls.KIND}s"
        cls.check_keys(values, where)
        if coerce:
            values = {k: cls.coerce(k, v, where) for k, v in values.items()}
        return cls(**values).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes):
        """A copy with ``changes`` applied (unknown keys are errors), validated."""
        return type(self).from_dict({**self.to_dict(), **changes})

    # ---- checks
    def validate(self):
        """Check every field's type, range and choices (a ConfigError names the setting, the
        value and what is valid; ``param`` is the key), then :meth:`check`. Returns ``self``."""
        for key, f in self.schema().items():
            v = getattr(self, key)
            tp, optional = self.field_type(key)
            if (v is None and optional) or self.skip_check(key):
                continue
            if _members(tp) is not None and not _type_ok(tp, v):
                v = self._coerce_union(key, tp, optional, v)
                setattr(self, key, v)
            meta, r = f.metadata, f.metadata.get("range")
            if (
                r is not None
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and not r.holds(v)
            ):
                union = _members(tp)
                other = f" (or {' or '.join(map(repr, union[0]))})" if union and union[0] else ""
                raise ConfigError(
                    f"{self.subject(key, v)} is out of range: must be {r}{meta.get('hint', '')}"
                    f"{other}.",
                    param=key,
                )
            if not _type_ok(tp, v):
                raise ConfigError(
                    f"{self.subject(key, v)}: use {_kind(tp, optional, r)}.", param=key
                )
            choices = meta.get("choices")
            if choices is not None and v not in choices:
                raise ConfigError(
                    f"{self.subject(key, v)}: use one of {', '.join(map(str, choices))}.", param=key
                )
        self.check()
        return self

    def _coerce_union(self, key: str, tp, optional: bool, v):
        """A union field's value given as a string in Python (``"12"`` -> 12, ``"true"`` -> True;
        a literal such as ``"auto"`` as is); a ConfigError naming what is valid when no member
        takes it. (Flags and YAML values are read by :meth:`coerce` before they get here.)"""
        if isinstance(v, str):
            word = v.strip().lower()
            v = {"true": True, "false": False}.get(word, v)
            if isinstance(v, str) and word.lstrip("-").isdecimal():  # not "²": int() refuses
                v = int(word)
        try:
            return _convert(tp, v)
        except (TypeError, ValueError):
            r = self.schema()[key].metadata.get("range")
            raise ConfigError(
                f"{self.subject(key, v)}: use {_kind(tp, optional, r)}.", param=key
            ) from None

    def skip_check(self, key: str) -> bool:
        """True to skip the schema check of ``key`` (a setting another one overrides)."""
        return False

    def check(self) -> None:
        """Cross-field and special rules of a subclass (raise ConfigError)."""

    # ---- the command line
    @classmethod
    def add_arguments(
        cls,
        parser,
        title: str | None = None,
        description: str | None = None,
        *,
        only=None,
        exclude=(),
        shown: dict | None = None,
        help_suffix: dict | None = None,
    ):
        """One flag per setting (``only``: a subset; ``exclude``: skipped) in a new argument group
        of ``parser`` (or ``parser`` itself when ``title`` is None). Every flag defaults to None;
        the help ends with the default (``shown[key]`` when given, e.g. a recipe's value)."""
        grp = parser.add_argument_group(title, description) if title else parser
        for key, f in cls.schema().items():
            if (
                not f.metadata.get("cli", True)
                or key in exclude
                or (only is not None and key not in only)
            ):
                continue
            grp.add_argument(
                cls.flag(key),
                *f.metadata.get("flags", ()),
                dest=key,
                default=None,
                help=cls._flag_help(key, shown),
                **cls._flag_kwargs(key),
            )
        return grp

    @classmethod
    def _flag_help(cls, key: str, shown: dict | None) -> str:
        f = cls.schema()[key]
        if shown is not None and key in shown:
            value = shown[key]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        if value is None or (isinstance(value, (list, tuple)) and not value):
            text = "none"
        elif isinstance(
            value, (list, tuple)
        ):  # as it is typed: B1 B2 for nargs=2, else a comma list
            fixed = (_sequence(cls.field_type(key)[0]) or (None, None, None))[2]
            text = (" " if fixed else ",").join(map(str, value))
        else:
            text = str(value)
        return f"{f.metadata.get('help', '')} (default: {text})".replace("%", "%%")

    @classmethod
    def _flag_kwargs(cls, key: str) -> dict:
        meta = cls.schema()[key].metadata
        tp, _ = cls.field_type(key)
        if tp is bool:
            return {"action": argparse.BooleanOptionalAction}
        kw: dict = {"metavar": meta.get("metavar") or key.upper()}
        seq = _sequence(tp)
        if seq is not None and seq[2] is not None:
            kw["nargs"] = seq[2]
        if meta.get("repeat"):
            kw["action"] = "append"
        if meta.get("choices") and not meta.get("metavar"):
            # shown like argparse's choices, but checked by validate(): one error path for a flag,
            # a YAML key and a keyword argument alike
            kw["metavar"] = "{" + ",".join(map(str, meta["choices"])) + "}"
        return kw

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, defaults: dict | None = None, where: str = "the command line"
    ):
        """The settings of a command line: ``defaults`` (the command's own, e.g. another dtype)
        under the flags the user typed, read as the fields' types and validated. The values are
        written back onto ``args`` (for the flags it has), so the command reads ``args.dtype``."""
        values = {**(defaults or {}), **cls.given(args)}
        obj = cls.from_dict(values, where, coerce=True)
        for key in cls.schema():
            if hasattr(args, key):
                setattr(args, key, getattr(obj, key))
        return obj

    @classmethod
    def given(cls, args: argparse.Namespace) -> dict:
        """The settings the user typed on the command line (every flag defaults to None)."""
        out = {}
        for key in cls.schema():
            v = getattr(args, key, None)
            if v is not None:
                out[key] = list(v) if isinstance(v, list) else v
        return out


@functools.cache
def _schema(cls) -> dict:
    return {f.name: f for f in fields(cls)}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


# ------------------------------------------------------------------------------ YAML


def read_yaml_mapping(path, what: str = "settings file") -> dict:
    """A YAML file that must hold a mapping; errors name the file and say what is wrong."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {p} is not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read ({exc.strerror or exc}).") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {p} must be a mapping of settings, got {type(raw).__name__}.")
    return raw


def split_keys(values: dict, classes, where: str, ignore=()) -> list[dict]:
    """``values`` split between ``classes`` (a key goes to the first class that owns it), one
    dict per class; a key no class owns (and not in ``ignore``) is an error naming ``where``
    and the closest keys of them all."""
    out: list[dict] = [{} for _ in classes]
    for key, value in values.items():
        if key in ignore:
            continue
        owner = next((i for i, c in enumerate(classes) if key in c.schema()), None)
        if owner is None:
            known = set(ignore).union(*(c.schema() for c in classes))
            first = classes[0] if len(classes) == 1 else Settings
            raise first.unknown(key, where, known)
        out[owner][key] = value
    return out


def load_yaml(path, *classes, what: str = "settings file", ignore=()) -> list[dict]:
    """One YAML file's keys split between the settings ``classes`` (raw values, one dict per
    class); an unknown key is an error naming the file."""
    return split_keys(read_yaml_mapping(path, what), classes, str(path), ignore)
