"""Medusa heads: the tree (rank paths), the heads, and the candidates per head in the graph."""

from specexport.bundle.kinds import COUNT, LIST, TEXT

SCHEMA = {"tree": LIST, "heads_count": COUNT, "top_k": COUNT, "graphs.medusa_heads.file": TEXT}


def describe(section: dict) -> list[str]:
    depth = max((len(r) for r in section["tree"] if isinstance(r, list)), default=0)
    return [f"heads        {section['heads_count']} ({section.get('head_style', '?')} LM head) from "
            f"{section.get('heads', '?')}; tree '{section.get('tree_spec', '?')}': {len(section['tree']) + 1} tokens "
            f"per step, depth {depth}"]


def numerics(numerics: dict) -> list[str]:
    lines = []
    for run in (numerics.get("medusa") or {}).get("runs", []):
        k = next(key for key in run if key.startswith("fused_top"))
        lines.append(f"  medusa step          accepted {run['accepted']}: path {'=' if run['path_match'] else '!='} "
                     f"reference, bonus {'=' if run['bonus_match'] else '!='}, candidates {run[k]:.0%} equal "
                     f"(worst gap {run['fused_max_gap']:.1e}; heads graph {run[k.replace('fused', 'heads_graph')]:.0%})")
    return lines
