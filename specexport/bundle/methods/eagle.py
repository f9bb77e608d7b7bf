"""EAGLE-1/2 and EAGLE-3: the draft decoder's graph and the tree it grows (dynamic, or a static rank tree)."""

from specexport.bundle.kinds import COUNT, TEXT

SCHEMA = {"depth": COUNT, "top_k": COUNT, "total_tokens": COUNT, "graph_top_k": COUNT, "version": COUNT,
          "graphs.draft.file": TEXT}


def describe(section: dict) -> list[str]:
    version = "EAGLE-3" if section["version"] == 3 else "EAGLE-1/2"
    aux = f", features from the inputs of layers {section['aux_layers']}" if section.get("aux_layers") else ""
    producer = f" ({section['producer']} layout)" if section.get("producer") else ""
    return [f"draft        {version} from {section.get('draft', '?')}{producer}: draft vocabulary "
            f"{section.get('draft_vocab', '?')}{aux}",
            f"tree         {section.get('tree', 'dynamic')}: depth {section['depth']}, top-k {section['top_k']}, "
            f"{section['total_tokens']} tokens per step (up to {section['graph_top_k']} candidates per node in the "
            "graph)"]


def numerics(numerics: dict) -> list[str]:
    e = numerics.get("eagle")
    if e is None:
        return []
    return [f"  eagle features       max |diff| {e['feature_max_abs_diff']:.2e}; draft graph max |diff| "
            f"{e['draft_max_abs_diff']:.2e}, top-k tokens {e['draft_topk_match']:.0%} equal"]
