"""Suffix lookup: the node budget, the adaptive length and probability floor, and the datastore shipped in the bundle
(`datastore`: its file, listed under the manifest's files with its checksum; null for none)."""

from specexport.bundle.kinds import COUNT, NUMBER

SCHEMA = {"total_tokens": COUNT, "match_factor": NUMBER, "min_prob": NUMBER}


def describe(section: dict) -> list[str]:
    return [f"lookup       suffix matches in the request, {datastore_line(section)}: up to "
            f"{section['total_tokens']} tokens per step, at most {section['match_factor']:g} x the match length "
            f"from each index, continuations of estimated probability >= {section['min_prob']:g}"]


def datastore_line(section: dict) -> str:
    meta = section.get("datastore_meta") if isinstance(section.get("datastore_meta"), dict) else {}
    if not section.get("datastore"):
        return "no datastore"
    return (f"and a datastore of {meta.get('documents', '?')} outputs of {meta.get('model', '?')} "
            f"({meta.get('tokens', '?')} tokens, {section['datastore']})")


def numerics(numerics: dict) -> list[str]:
    return []
