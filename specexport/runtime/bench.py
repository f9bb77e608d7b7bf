"""`specexport bench`: a bundle's method vs plain decoding on the same engine, greedy, batch 1.

Speed is reported as ratios from one run on one machine; nothing here asserts a time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specexport.errors import UserError, read_user_text


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


def run_bench(bundle_path: Path, prompts: list[dict], max_new_tokens: int = 128, compare_hf: bool = False,
              threads: int | None = None, progress=lambda text: None, tree: str | None = None,
              overrides: dict | None = None) -> dict:
    """`tree` and `overrides` (depth, top_k, total_tokens, draft_length): run-time overrides of the bundle's
    proposal (Engine.configure)."""
    from specexport.runtime.generate import Engine

    engine = Engine.load(bundle_path, threads=threads)
    method = engine.bundle.method
    engine.configure(tree, **(overrides or {}))
    ids = []
    for p in prompts:
        try:
            ids.append(engine.encode(p["prompt"]))
        except UserError as e:
            raise UserError(f"prompt {p['id']!r}: {e}") from None
    engine.generate(ids[0], max_new_tokens=8)  # warm-up: first-run allocations and prepacking
    rows = []
    for p, prompt_ids in zip(prompts, ids):
        ours = engine.generate(prompt_ids, max_new_tokens=max_new_tokens)
        base = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, method="none")
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
            "identical": ours.tokens == base.tokens,
        })
        progress(f"  {p['id']}: {ours.stats.tokens_per_s:.1f} tokens/s ({method}), "
                 f"{base.stats.tokens_per_s:.1f} (plain){'' if rows[-1]['identical'] else ', OUTPUT DIFFERS'}")
    hf = _hf_speed(engine, ids, max_new_tokens, progress) if compare_hf else None
    return _totals(engine, rows, hf)


def _totals(engine, rows: list[dict], hf: dict | None) -> dict:
    def rate(tokens, seconds):
        return round(tokens / seconds, 2) if seconds > 0 else 0.0

    ours = rate(sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows))
    base = rate(sum(r["baseline_new_tokens"] for r in rows), sum(r["baseline_seconds"] for r in rows))
    lengths = [a for r in rows for a in r["accept_lengths"]]
    m = engine.bundle.manifest
    medusa, eagle = engine.medusa_tree, engine.eagle
    tree = None
    if medusa is not None:
        tree = {"tokens_per_step": medusa.size, "depth": medusa.depth, "choices": medusa.as_lists()}
    elif eagle is not None:
        tree = {"tokens_per_step": eagle["total_tokens"], "depth": eagle["depth"], "top_k": eagle["top_k"],
                "kind": eagle["tree"]}
    return {
        "profile": (m.get("profile") or {}).get("name"),
        "tree": tree,
        "bundle": str(engine.bundle.path),
        "model": m["model"]["name"],
        "method": engine.bundle.method,
        "precision": m["precision"],
        "prompts": rows,
        "tokens_per_s": ours,
        "baseline_tokens_per_s": base,
        "hf_tokens_per_s": hf["tokens_per_s"] if hf else None,
        "speedup": round(ours / base, 3) if base else None,
        "hf_speedup": round(ours / hf["tokens_per_s"], 3) if hf else None,
        "tau": round(float(np.mean(lengths)), 3) if lengths else None,
        "drafted": sum(r["drafted"] for r in rows),
        "accepted": sum(lengths) - len(lengths),
        "accept_histogram": {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))},
        "identical": sum(r["identical"] for r in rows),
        "count": len(rows),
    }


def _hf_speed(engine, ids: list[list[int]], max_new_tokens: int, progress) -> dict:
    """transformers `generate` (greedy, fp32, CPU) on the same model and the same prompt ids."""
    import torch

    from specexport.exporter.sources import load_model, resolve

    progress("  loading the transformers model for --compare-hf")
    model, _ = load_model(resolve(engine.bundle.manifest["model"]["source"]))
    eos = sorted(engine.tokenizer.eos_token_ids)
    tokens = seconds = 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([ids[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for prompt_ids in ids:
            start = time.perf_counter()
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos or None)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - len(prompt_ids)
    result = {"tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0}
    progress(f"  transformers generate: {result['tokens_per_s']:.1f} tokens/s")
    return result


def summary_lines(result: dict) -> list[str]:
    tree = result.get("tree")
    lines = [
        f"{result['model']} {result['precision']}, method {result['method']}, {result['count']} prompts"
        + (f", tree of {tree['tokens_per_step']} tokens (depth {tree['depth']}"
           + (f", top-k {tree['top_k']}, {tree['kind']}" if "top_k" in tree else "") + ")" if tree else "")
        + f", profile {result.get('profile') or 'none'}",
        f"  {result['method']:<10} {result['tokens_per_s']:8.1f} tokens/s   tau {result['tau']}   "
        f"accepted {result['accepted']}/{result['drafted']} drafts",
        f"  {'plain':<10} {result['baseline_tokens_per_s']:8.1f} tokens/s   speedup {result['speedup']}x",
    ]
    if result["hf_tokens_per_s"] is not None:
        lines.append(f"  {'hf':<10} {result['hf_tokens_per_s']:8.1f} tokens/s   ours/hf {result['hf_speedup']}x")
    lines.append(f"  identical to plain decoding: {result['identical']}/{result['count']}")
    if result["precision"] in ("int8", "int4") and result["identical"] < result["count"]:
        lines.append(f"  ({result['precision']}: a row verified with others is quantized differently from the same row "
                     "decoded alone, so outputs part at near-ties; speculation is exact against its own verification "
                     "call, and fp32 bundles are token-identical)")
    return lines
