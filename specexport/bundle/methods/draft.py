"""A draft model: its graph, the draft length and the tree's branching per depth."""

from specexport.bundle.kinds import COUNT, LIST, TEXT

SCHEMA = {"draft_length": COUNT, "draft_branching": LIST, "graphs.draft.file": TEXT}


def describe(section: dict) -> list[str]:
    branching = ",".join(map(str, section["draft_branching"])) or "a chain"
    return [f"draft        {section.get('draft_model', '?')}: {section['draft_length']} tokens per step, "
            f"children per depth {branching}"]


def numerics(numerics: dict) -> list[str]:
    d = numerics.get("draft") or {}
    return [f"  draft graph          max |logit diff| {d['max_abs_diff']:.2e} vs transformers"] if "max_abs_diff" in d else []
