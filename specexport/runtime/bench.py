"""`specexport bench`: a bundle's method vs plain decoding on the same engine, greedy, batch 1.

Speed is reported as ratios from one run on one machine; nothing here asserts a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specexport.errors import UserError, read_user_text
from specexport.runtime.generate import Engine
from specexport.runtime.methods.suffix import fresh_requests


def read_prompts(path: Path) -> list[dict]:
    """JSON lines with a 'prompt' string and an optional 'id'."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"prompts file {path} is a folder, not a JSON-lines file")
    if not path.is_file():
        raise UserError(f"prompts file {path} not found")
    prompts = []
    for n, line in enumerate(read_user_text(path, "JSON lines").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise UserError(f"{path}:{n}: each line needs a non-empty string field 'prompt'")
        prompts.append({"id": str(row.get("id", len(prompts))), "prompt": row["prompt"]})
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts")
    return prompts


def encode_prompts(engine: Engine, prompts: list[dict]) -> list[list[int]]:
    """Each prompt's ids; a prompt the bundle cannot take is one line naming its id."""
    ids = []
    for p in prompts:
        try:
            ids.append(engine.encode(p["prompt"]))
        except UserError as e:
            raise UserError(f"prompt {p['id']!r}: {e}") from None
    return ids


def run_bench(engine: Engine, prompts: list[dict], max_new_tokens: int = 128, progress=lambda text: None,
              baseline: Engine | None = None) -> dict:
    """The engine's method (with its current settings, see Engine.configure) against plain decoding on the same
    engine (or on `baseline`, another bundle of the same model: its fastest plain decoding), prompt by prompt."""
    method = engine.bundle.method
    ids = encode_prompts(engine, prompts)
    plain = baseline or engine
    if baseline is not None and encode_prompts(baseline, prompts) != ids:
        raise UserError(f"--baseline {baseline.bundle.path}: its tokenizer encodes the prompts differently from "
                        f"{engine.bundle.path}'s (another model?)")
    with fresh_requests(engine):  # (its output kept in a response store would draft the first prompt's)
        engine.generate(ids[0], max_new_tokens=8)  # warm-up: first-run allocations and prepacking
    if baseline is not None:
        baseline.generate(ids[0], max_new_tokens=8)
    comparable = comparable_outputs(engine, plain)
    rows = []
    for p, prompt_ids in zip(prompts, ids):
        steps = []
        ours = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, on_step=steps.append)
        base = plain.generate(prompt_ids, max_new_tokens=max_new_tokens, plain=True)
        rows.append({
            "id": p["id"],
            "new_tokens": ours.stats.new_tokens,
            "seconds": round(ours.stats.seconds, 4),
            "tokens": ours.tokens,
            "baseline_new_tokens": base.stats.new_tokens,
            "baseline_seconds": round(base.stats.seconds, 4),
            "baseline_tokens": base.tokens,
            "accept_lengths": ours.stats.accept_lengths,
            "drafted": ours.stats.drafted,
            "propose_s": round(sum(r.propose_s for r in steps), 6),
            "identical": ours.tokens == base.tokens,
        })
        differs = comparable and not rows[-1]["identical"]
        progress(f"  {p['id']}: {ours.stats.tokens_per_s:.1f} tokens/s ({method}), "
                 f"{base.stats.tokens_per_s:.1f} (plain){', OUTPUT DIFFERS' if differs else ''}")
    return {**_totals(engine, rows), "baseline": None if baseline is None else
            {"bundle": baseline.bundle.path.name, "precision": baseline.bundle.manifest["precision"]}}


def comparable_outputs(engine: Engine, plain: Engine) -> bool:
    """Whether the method's greedy tokens must equal plain decoding's: the same precision, computed row by row (int8
    only with per-row activation scales, `--int8-rows`: the default quantizes a call's rows with one scale), on
    graphs whose trees the runtime lays out in lanes (docs/precision.md; bundles built before it part at near-ties)."""
    manifests = [e.bundle.manifest for e in (engine, plain)]
    if manifests[0]["precision"] != manifests[1]["precision"]:
        return False
    rows = all(m.get("runtime", {}).get("int8_activations") == "row" for m in manifests)
    lanes = getattr(engine.target, "lanes", False) or engine.bundle.manifest["precision"] == "fp32"
    return lanes and (manifests[0]["precision"] != "int8" or rows)


def _totals(engine: Engine, rows: list[dict]) -> dict:
    def rate(tokens, seconds):
        return round(tokens / seconds, 2) if seconds > 0 else 0.0

    ours = rate(sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows))
    base = rate(sum(r["baseline_new_tokens"] for r in rows), sum(r["baseline_seconds"] for r in rows))
    lengths = [a for r in rows for a in r["accept_lengths"]]
    drafted, propose_s = sum(r["drafted"] for r in rows), sum(r["propose_s"] for r in rows)
    m = engine.bundle.manifest
    return {
        "profile": (m.get("profile") or {}).get("name"),
        "tree": engine.method.tree_info(engine.settings),
        "bundle": engine.bundle.path.name,
        "model": m["model"]["name"],
        "method": engine.bundle.method,
        "precision": m["precision"],
        "prompts": rows,
        "tokens_per_s": ours,
        "baseline_tokens_per_s": base,
        "speedup": round(ours / base, 3) if base else None,
        "tau": round(float(np.mean(lengths)), 3) if lengths else None,
        "drafted": drafted,
        "propose_ms_per_step": round(1000 * propose_s / len(lengths), 3) if lengths else None,
        "propose_us_per_draft": round(1e6 * propose_s / drafted, 1) if drafted else None,
        "accepted": sum(lengths) - len(lengths),
        "accept_histogram": {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))},
        "identical": sum(r["identical"] for r in rows),
        "count": len(rows),
    }


def summary_lines(result: dict) -> list[str]:
    tree = result.get("tree")
    plain = f"plain {result['baseline']['precision']}" if result.get("baseline") else "plain"
    lines = [
        f"{result['model']} {result['precision']}, method {result['method']}, {result['count']} prompts"
        + (f", tree of {tree['tokens_per_step']} tokens (depth {tree['depth']}"
           + (f", top-k {tree['top_k']}, {tree['kind']}" if "top_k" in tree else "") + ")" if tree else "")
        + f", profile {result.get('profile') or 'none'}",
        f"  {result['method']:<10} {result['tokens_per_s']:8.1f} tokens/s   tau {result['tau']}   "
        f"accepted {result['accepted']}/{result['drafted']} drafts"
        + (f"   proposing {result['propose_ms_per_step']:.3f} ms per step, {result['propose_us_per_draft']:.1f} us per "
           "drafted token" if result.get("propose_us_per_draft") else ""),
        f"  {plain:<10} {result['baseline_tokens_per_s']:8.1f} tokens/s   speedup {result['speedup']}x"
        + (f"   (plain decoding of {result['baseline']['bundle']})" if result.get("baseline") else ""),
    ]
    if result.get("hf_tokens_per_s") is not None:
        lines.append(f"  {'hf':<10} {result['hf_tokens_per_s']:8.1f} tokens/s   ours/hf {result['hf_speedup']}x")
    lines.append(f"  identical to plain decoding{' of the baseline' if result.get('baseline') else ''}: "
                 f"{result['identical']}/{result['count']}")
    baseline = (result.get("baseline") or {}).get("precision", result["precision"])
    if baseline != result["precision"] and result["identical"] < result["count"]:
        lines.append(f"  ({result['precision']} against plain {baseline}: different precisions compute different "
                     "numbers, so their outputs are not expected to match; fp32 bundles of both show the method's "
                     "output equal to plain decoding's)")
    elif result["precision"] == "int8" and result["identical"] < result["count"]:
        lines.append("  (int8 built without --int8-rows quantizes a call's rows with one scale, so a row's logits depend "
                     "on the rows beside it and outputs part at near-ties; --int8-rows bundles are token-identical)")
    return lines
