"""What the commands share: the options made from settings dataclasses, small parsers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from specexport.errors import UserError
from specexport.options import Field, fields


class IntList(click.ParamType):
    """Comma-separated integers, e.g. 2,1,1 (an empty string is the empty list)."""

    name = "INTS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(x) for x in value.split(",") if x.strip())
        except ValueError:
            self.fail(f"must be comma-separated integers, got '{value}'", param, ctx)


PARAM = "setting_"  # the prefix of a setting's keyword argument: no clash with a command's own (run's top_k)


class SettingOptions:
    """The fields of several settings dataclasses (one per method, or per trainer) as one set of click options:
    one option per field name, its help the owners' helps, its default shown per owner. Every option defaults to
    None (not given), so a value given can be told from a default, checked against the chosen owner, and merged
    over a bundle's or a profile's settings. The command gets them as keyword arguments PARAM + field name."""

    def __init__(self, classes: dict[str, type], build: bool = False, taken: tuple[str, ...] = ()):
        self.owners: dict[str, list[str]] = {}
        self.field: dict[str, Field] = {}
        self.helps: dict[str, list[str]] = {}
        self.defaults: dict[str, dict[str, object]] = {}
        for owner, cls in classes.items():
            for f in fields(cls):
                if not f.option or (build and not f.build):
                    continue
                self.owners.setdefault(f.name, []).append(owner)
                self.field.setdefault(f.name, f)
                if f.help and f.help not in self.helps.setdefault(f.name, []):
                    self.helps[f.name].append(f.help)
                self.defaults.setdefault(f.name, {})[owner] = f.default
        self.taken = set(taken)

    def __call__(self, command):
        for name in reversed(list(self.field)):
            command = self._option(name)(command)
        return command

    def _option(self, name: str):
        f = self.field[name]
        flags = [flag for flag in f.flags if flag not in self.taken]
        kwargs = {"default": None, "help": " ".join(self.helps[name]) + self._default_note(name)}
        if f.kind is bool:
            kwargs["is_flag"] = True  # --x, or the pair --x/--no-x (None: neither given)
        else:
            kwargs["type"] = {int: int, float: float, str: str, tuple: IntList(),
                              Path: click.Path(path_type=Path)}[f.kind]
        return click.option(*flags, PARAM + name, **kwargs)

    def _default_note(self, name: str) -> str:
        shown = {o: d for o, d in self.defaults[name].items() if d is not None and d is not False and d != ()}
        if not shown or any("[default" in h for h in self.helps[name]):
            return ""
        values = set(map(repr, shown.values()))
        if len(values) == 1 and len(shown) == len(self.defaults[name]):
            return f" [default: {_show(next(iter(shown.values())))}]"
        return " [default: " + ", ".join(f"{o} {_show(d)}" for o, d in shown.items()) + "]"

    def given(self, kwargs: dict, owner: str) -> dict:
        """The values given on the command line (not None) for `owner`; one line for one that is not its."""
        given = {name: kwargs[PARAM + name] for name in self.field if kwargs.get(PARAM + name) is not None}
        for name in given:
            if owner not in self.owners[name]:
                raise UserError(f"{self.flag(name)} does not apply to --method {owner} (it applies to "
                                f"{', '.join(self.owners[name])})")
        return given

    def flag(self, name: str) -> str:
        return next(flag for flag in self.field[name].flags if flag not in self.taken).split("/")[0]


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def for_owner(cls, given: dict) -> dict:
    """The part of `given` that names fields of `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in given.items() if k in names}


def path_option(*flags, **kwargs):
    return click.option(*flags, type=click.Path(path_type=Path), **kwargs)
