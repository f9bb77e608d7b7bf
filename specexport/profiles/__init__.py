"""Hardware profiles: what `build --profile` consumes. The schema and loader (schema.py, data in data/*.toml),
hardware detection (detect.py), and how a profile's choices merge into a build's settings. The tuner that measures
them, `specexport profile`, is a layer above (specexport/tune)."""

from __future__ import annotations

from specexport.errors import UserError
from specexport.options import fields
from specexport.profiles.detect import auto_profile, resolve_profile
from specexport.profiles.schema import Profile, bundled, dump, load_profile, names, parse

__all__ = ["Profile", "auto_profile", "best_method", "bundled", "dump", "load_profile", "merge", "names", "parse",
           "precision_for", "resolve_profile"]


def merge(profile: Profile, method, given: dict) -> dict:
    """A method's settings for a build: the ones given, then the profile's for the rest (runtime method `method`;
    none when the profile has no section for it)."""
    chosen = profile.methods.get(method.profile_section)
    if chosen is None:
        return dict(given)
    saved = {f.name: getattr(chosen, f.name) for f in fields(type(chosen)) if f.build}
    return {**saved, **given}


def precision_for(profile: Profile, method: str, serving: bool = False) -> str:
    """The precision a build of `method` takes on this hardware: the one of its measured [speed] entries with the
    most tokens/s (e.g. int4 for plain decoding on a CPU where its kernel streams fewer bytes, int8 for a method
    whose wide verification int8 makes cheap), else the profile's engine precision. `serving`: a build for many
    requests at once, chosen by its [serve_speed] entries where the profile measured them (a kernel whose cost grows
    with the rows, as int4's on a CPU, can be the fastest alone and the slowest batched)."""
    measured = (serving and profile.serve_speed.get(method)) or profile.speed.get(method)
    return max(measured, key=measured.get) if measured else profile.engine.precision


def best_method(profile: Profile, serving: bool = False) -> str:
    """The method whose measured speed ([speed], or [serve_speed] when `serving` and the profile has it) is highest
    on this hardware (at its best precision); one line when the profile measured none."""
    speeds = profile.serve_speed if serving and profile.serve_speed else profile.speed  # like with like
    if not speeds:
        raise UserError(f"profile {profile.name} has no measured [speed] to choose the best method from: pass "
                        "--method NAME")
    return max(speeds, key=lambda m: max(speeds[m].values()))
