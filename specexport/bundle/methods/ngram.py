"""Prompt lookup (n-gram): the lookup's settings."""

from specexport.bundle.kinds import COUNT

SCHEMA = {"max_ngram": COUNT, "min_ngram": COUNT, "max_matches": COUNT, "draft_length": COUNT}


def describe(section: dict) -> list[str]:
    return [f"lookup       n-grams {section['max_ngram']}..{section['min_ngram']}, up to {section['max_matches']} "
            f"match(es), {section['draft_length']} draft tokens per match"]


def numerics(numerics: dict) -> list[str]:
    return []
