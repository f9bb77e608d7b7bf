"""The one exception type for mistakes a user can fix (bad input, missing files)."""


class UserError(Exception):
    """A problem the user can fix; the CLI prints its message on one line and exits 1."""
