"""Mistakes a user can fix (bad input, missing files): the one exception type, and helpers that
turn a failure into its one line."""

from pathlib import Path


class UserError(Exception):
    """A problem the user can fix; the CLI prints its message on one line and exits 1."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def read_user_text(path, expected: str) -> str:
    """A file the user named, as UTF-8 text; one clear error when it is not text (`expected`: what it should hold)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text ({expected} expected)") from None
