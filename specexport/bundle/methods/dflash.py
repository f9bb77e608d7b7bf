"""DFlash: the block draft's graph and the tree cut from its per-position candidates."""

from specexport.bundle.kinds import COUNT, TEXT

SCHEMA = {"depth": COUNT, "top_k": COUNT, "total_tokens": COUNT, "graph_top_k": COUNT, "block_size": COUNT,
          "mask_token": COUNT, "graphs.draft.file": TEXT}


def describe(section: dict) -> list[str]:
    return [f"draft        DFlash from {section.get('draft', '?')} ({section.get('producer', '?')} layout): blocks of "
            f"{section['block_size']}, context from the inputs of layers {section.get('target_layers')}",
            f"tree         depth {section['depth']}, top-k {section['top_k']}, {section['total_tokens']} tokens per "
            f"step (up to {section['graph_top_k']} candidates per position in the graph)"]


def numerics(numerics: dict) -> list[str]:
    d = numerics.get("dflash")
    if d is None:
        return []
    return [f"  dflash context       max |diff| {d['context_max_abs_diff']:.2e}; draft graph max |diff| "
            f"{d['draft_max_abs_diff']:.2e}, top-k tokens {d['draft_topk_match']:.0%} equal"]
