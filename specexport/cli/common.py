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
# flags that mean one thing everywhere, never a setting's second name: `--top-k` is sampling's top-k (run, serve,
# Triton), so EAGLE's draft-tree top-k answers only to --draft-top-k; a command where the flag means nothing else
# refuses it in one line with this hint
RESERVED = {"--top-k": "--top-k is sampling's top-k (specexport run --top-k); the draft tree's top-k is --draft-top-k"}


class SettingOptions:
    """The fields of several settings dataclasses (one per method, or per trainer) as one set of click options:
    one option per field name, its help the owners' helps, its default shown per owner. Every option defaults to
    None (not given), so a value given can be told from a default, checked against the chosen owner, and merged
    over a bundle's or a profile's settings. The command gets them as keyword arguments PARAM + field name."""

    def __init__(self, classes: dict[str, type], build: bool = False, taken: tuple[str, ...] = ()):
        self.owners: dict[str, list[str]] = {}
        self.field: dict[str, Field] = {}
        self.helps: dict[str, list[str]] = {}
        self.pieces: dict[str, dict[str, list[str]]] = {}  # field -> help text -> the owners that give it
        self.defaults: dict[str, dict[str, object]] = {}
        for owner, cls in classes.items():
            for f in fields(cls):
                if not f.option or (build and not f.build):
                    continue
                self.owners.setdefault(f.name, []).append(owner)
                self.field.setdefault(f.name, f)
                self.helps.setdefault(f.name, [])
                if f.help:
                    self.pieces.setdefault(f.name, {}).setdefault(f.help, []).append(owner)
                    if f.help not in self.helps[f.name]:
                        self.helps[f.name].append(f.help)
                self.defaults.setdefault(f.name, {})[owner] = f.default
        self.taken = set(taken)

    def __call__(self, command):
        for name in reversed(list(self.field)):
            command = self._option(name)(command)
        for flag in self._refused():
            command = click.option(flag, PARAM + "refused_" + flag.lstrip("-").replace("-", "_"), default=None,
                                   hidden=True, expose_value=False, callback=_refuse(RESERVED[flag]))(command)
        return command

    def _flags(self, f: Field) -> list[str]:
        """`f`'s command-line names here: not those the command takes for itself, nor a reserved second name."""
        return [flag for k, flag in enumerate(f.flags) if flag not in self.taken and not (k and flag in RESERVED)]

    def _refused(self) -> list[str]:
        """Reserved second names these settings would have had, where the command does not take them itself."""
        return sorted({flag for f in self.field.values() for flag in f.flags[1:]
                       if flag in RESERVED and flag not in self.taken})

    def _option(self, name: str):
        f = self.field[name]
        flags = self._flags(f)
        kwargs = {"default": None, "help": self._help(name)}
        if f.kind is bool:
            kwargs["is_flag"] = True  # --x, or the pair --x/--no-x (None: neither given)
        else:
            kwargs["type"] = {int: int, float: float, str: str, tuple: IntList(),
                              Path: click.Path(path_type=Path)}[f.kind]
        return click.option(*flags, PARAM + name, **kwargs)

    def _help(self, name: str) -> str:
        """The owners' helps, each followed by its own owners' default where several owners' helps are merged or
        their defaults differ (e.g. --total-tokens: eagle 4, suffix 8, hybrid 6), else one default at the end."""
        shown = self._shown(name, self.owners[name])
        differ = len(set(map(repr, shown.values()))) > 1 or 0 < len(shown) < len(self.defaults[name])
        if differ or len(self.pieces.get(name, {})) > 1:
            return " ".join(text + ("" if "[default" in text else self._default_note(name, owners, text))
                            for text, owners in self.pieces.get(name, {}).items())
        if any("[default" in h for h in self.helps[name]):
            return " ".join(self.helps[name])
        return " ".join(self.helps[name]) + self._default_note(name, self.owners[name])

    def _shown(self, name: str, owners: list[str]) -> dict[str, object]:
        return {o: d for o in owners if (d := self.defaults[name][o]) is not None and d is not False and d != ()}

    def _default_note(self, name: str, owners: list[str], text: str = "") -> str:
        """` [default: D]`, or ` [default: owner D, ...]` where the owners differ or the help names more methods
        than give it ("suffix, hybrid: ..." given by suffix alone)."""
        shown = self._shown(name, owners)
        if not shown:
            return ""
        named = {word.strip() for word in text.split(":", 1)[0].split(",")} if ":" in text else set()
        if len(set(map(repr, shown.values()))) == 1 and len(shown) == len(owners) and named <= set(owners) | {""}:
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
        return self._flags(self.field[name])[0].split("/")[0]


def _refuse(hint: str):
    """A hidden option's callback: given at all, it is one line with `hint`."""
    def refuse(ctx, param, value):
        if value is not None:
            raise click.UsageError(hint, ctx=ctx)

    return refuse


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def for_owner(cls, given: dict) -> dict:
    """The part of `given` that names fields of `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in given.items() if k in names}


def path_option(*flags, **kwargs):
    return click.option(*flags, type=click.Path(path_type=Path), **kwargs)
