"""The kinds of value a manifest key may hold, and the check of one value against its kind."""

COUNT = "a positive integer"
NUMBER = "a number >= 0"
TEXT, LIST = str, list


def has_type(value, kind) -> bool:
    if kind == COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return isinstance(value, kind)


def type_name(kind) -> str:
    return kind if isinstance(kind, str) else f"a {kind.__name__}"
