"""Hybrid: EAGLE-3's draft graph and its dynamic tree, suffix lookup (and its datastore), one node budget."""

from specexport.bundle.methods import eagle, suffix

SCHEMA = {**eagle.SCHEMA, **suffix.SCHEMA}


def describe(section: dict) -> list[str]:
    return [eagle.describe(section)[0],
            f"tree         EAGLE depth {section['depth']}, top-k {section['top_k']} merged with suffix continuations "
            f"(request, {suffix.datastore_line(section)}; factor {section['match_factor']:g}, min prob "
            f"{section['min_prob']:g}): {section['total_tokens']} tokens per step"]


numerics = eagle.numerics
