"""The kinds of value a manifest key may hold, and the check of one value against its kind."""

COUNT = "a positive integer"
TEXT, LIST = str, list


def has_type(value, kind) -> bool:
    if kind == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return isinstance(value, kind)


def type_name(kind) -> str:
    return kind if isinstance(kind, str) else f"a {kind.__name__}"
