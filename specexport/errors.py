"""The one exception type for mistakes a user can fix (bad input, missing files)."""


class UserError(Exception):
    """A problem the user can fix; the CLI prints its message on one line and exits 1."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
