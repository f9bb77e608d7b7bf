"""Plain decoding: no section keys beyond the name."""

SCHEMA: dict = {}


def describe(section: dict) -> list[str]:
    return []


def numerics(numerics: dict) -> list[str]:
    return []
