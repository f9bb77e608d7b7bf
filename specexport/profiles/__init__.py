"""Hardware profiles: what `build --profile` consumes. The schema and loader (schema.py, data in data/*.toml),
hardware detection (detect.py), and how a profile's choices merge into a build's settings. The tuner that measures
them, `specexport profile`, is a layer above (specexport/tune)."""

from __future__ import annotations

from specexport.options import fields
from specexport.profiles.detect import auto_profile, resolve_profile
from specexport.profiles.schema import Profile, bundled, dump, load_profile, names, parse

__all__ = ["Profile", "auto_profile", "bundled", "dump", "load_profile", "merge", "names", "parse", "resolve_profile"]


def merge(profile: Profile, method, given: dict) -> dict:
    """A method's settings for a build: the ones given, then the profile's for the rest (runtime method `method`;
    none when the profile has no section for it)."""
    chosen = profile.methods.get(method.profile_section)
    if chosen is None:
        return dict(given)
    saved = {f.name: getattr(chosen, f.name) for f in fields(type(chosen)) if f.build}
    return {**saved, **given}
