"""Settings declared once, as fields of frozen dataclasses that carry their own help.

A method's run-time settings, its build options and a trainer's configuration are each one dataclass; the field's
default is the default, its metadata holds the help text and the command-line name. The CLI makes its options
from these fields and a profile's section of a method holds the same names, so a default or a help line is written
in one place and never drifts.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

from specexport.errors import UserError


def setting(default, help: str, *, flags: tuple[str, ...] = (), build: bool = True, option: bool = True):
    """A dataclass field with its help. `flags`: command-line names (default --the-field-name; a bool may be a
    pair, "--x/--no-x"); `build=False`: a run-time choice only, never saved in a bundle or a profile (Medusa's lossy
    typical acceptance); `option=False`: set by the library's callers (tests, scripts), never a command-line option."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags, "build": build, "option": option})


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: type  # int, float, str, bool, Path, or tuple (of ints)
    default: object
    help: str
    flags: tuple[str, ...]
    build: bool
    optional: bool  # None is a value (e.g. "no draft given: use the shipped one")
    option: bool = True  # False: no command-line option

    @property
    def flag(self) -> str:
        return self.flags[0].split("/")[0]


def fields(cls) -> list[Field]:
    """The settings of a dataclass, with their kinds read from the annotations."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = _kind(hints[f.name])
        out.append(Field(f.name, kind, f.default, f.metadata.get("help", ""),
                         tuple(f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)),
                         f.metadata.get("build", True), optional, f.metadata.get("option", True)))
    return out


def _kind(hint) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if type(None) in args:
        return _kind(next(a for a in args if a is not type(None)))[0], True
    origin = typing.get_origin(hint)
    return (tuple if origin is tuple else hint), False


def with_given(settings, given: dict, where: str = "settings"):
    """`settings` with the `given` values (names of its fields) replaced, each checked against its kind."""
    known = {f.name: f for f in fields(type(settings))}
    values = {}
    for name, value in given.items():
        f = known.get(name)
        if f is None:
            raise UserError(f"{where}: unknown setting '{name}' (known: {', '.join(known)})")
        values[name] = coerce(f, value, where)
    return dataclasses.replace(settings, **values)


def from_section(cls, section: dict, where: str):
    """`cls`'s defaults with the values a bundle's manifest (or a profile's section) saved for its fields."""
    saved = {f.name: section[f.name] for f in fields(cls) if f.build and f.name in section}
    return with_given(cls(), saved, where)


def coerce(f: Field, value, where: str):
    """A value for field `f` from the command line, a manifest or a profile: lists become tuples, ints floats."""
    if value is None and f.optional:
        return None
    if f.kind is tuple and isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
        return tuple(value)
    if f.kind is float and _is_int(value):
        return float(value)
    if f.kind is Path and isinstance(value, (str, os.PathLike)):
        return Path(value)
    if (f.kind is int and _is_int(value)) or (f.kind in (float, str, bool) and type(value) is f.kind):
        return value
    raise UserError(f"{where}: {f.flag.lstrip('-')} must be {_describe(f.kind)}, got {value!r:.40}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            tuple: "a list of integers", Path: "a path"}[kind]
