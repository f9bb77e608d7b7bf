"""What `specexport info` and `build` print about a bundle: its manifest in words, and its numerics."""

from __future__ import annotations

from specexport.bundle import Bundle, methods


def describe(bundle: Bundle) -> list[str]:
    """The manifest in lines: model, method (its section's own lines), profile, precision, graphs, files, tools,
    numerics. Descriptive fields an edited manifest lacks show as "?" (the keys the runtime reads were checked at
    load)."""
    m = bundle.manifest
    model, section = m["model"], m["method"]
    lines = [f"bundle       {bundle.path}",
             f"model        {model['name']} ({_get(model, 'model_type')}, {_get(model, 'layers')} layers, hidden "
             f"{_get(model, 'hidden')}, heads {_get(model, 'heads')}/{_get(model, 'kv_heads')}, vocab {model['vocab']})",
             f"method       {section['name']}"]
    if isinstance(m.get("profile"), dict):
        p = m["profile"]
        features = (p.get("hardware") or {}).get("features") if isinstance(p.get("hardware"), dict) else None
        measured = f"measured on {' '.join(features)}" if p.get("measured") and features else \
            "measured" if p.get("measured") else "not measured"
        why = f": {p['why']}" if isinstance(p.get("why"), str) else ""
        lines.append(f"profile      {_get(p, 'name')} ({_get(p, 'description')}; {measured}; chosen by "
                     f"{_get(p, 'chosen')}{why})")
    lines += methods.get(section["name"]).describe(section)
    lines.append(f"precision    {m['precision']} ({m['flavour']} ops), context {m['max_context']}")
    for name, g in m["graphs"].items():
        ours = f"; specexport's kernels: {', '.join(g['kernels'])}" if g.get("kernels") else ""
        lines.append(f"graph        {name}: {_get(g, 'file')} ({len(_get(g, 'inputs'))} inputs, "
                     f"{len(_get(g, 'outputs'))} outputs{ours})")
        if isinstance(g.get("engine"), dict):  # a TensorRT plan (exporter/tensorrt/build.py)
            e = g["engine"]
            tokens = ", ".join(f"{p[0]}-{p[2]}" for p in e.get("profiles", []) if isinstance(p, list) and len(p) == 3)
            lines.append(f"engine       {name}: {_get(e, 'file')} (TensorRT {_get(e, 'tensorrt')}, {_get(e, 'gpu')}, "
                         f"compute capability {_get(e, 'compute_capability')}; tokens per call {tokens or '?'}"
                         f"{'; sampled steps accepted in it' if e.get('sampling_accept') == 'plugin' else ''})")
    size = sum(f["bytes"] for f in m["files"].values())
    lines.append(f"files        {len(m['files'])} ({size / 1e6:.1f} MB), checksums ok")
    tools = m.get("tools") if isinstance(m.get("tools"), dict) else {}
    lines.append("tools        " + ", ".join(f"{k} {v}" for k, v in tools.items()))
    try:
        numerics = numerics_lines(m)
    except (KeyError, TypeError, AttributeError, ValueError, StopIteration):
        numerics = ["  (not readable in this manifest)"]
    return lines + (["numerics"] + numerics if numerics else [])


def numerics_lines(manifest: dict) -> list[str]:
    """The numerics checked at export, what matters first: a quantized graph's top-1 agreement with fp32 on
    generated text, then the method's own checks, then the probes against transformers on random tokens (a
    quantized graph agrees less there: random tokens make activations no text makes)."""
    n = manifest.get("numerics") or {}
    lines = []
    if "top1_agreement_t1" in n.get("agreement", {}):
        a = n["agreement"]
        text = "prompt text    " if n.get("agreement_text") else "generated text "  # layer-wise: the prompts' tokens
        lines.append(f"  {text}      top-1 agreement with fp32: {a['top1_agreement_t1']:.1%} decoding one "
                     f"token per step, {a['top1_agreement_t8']:.1%} in steps of 8 ({a['positions']} positions, "
                     "teacher-forced)")
    lines += methods.get(manifest["method"]["name"]).numerics(n)
    cases = n.get("cases") or {}
    if cases:
        lines.append("  random-token probes against transformers:")
    for name, case in cases.items():
        lines.append(f"    {name:<18} max |logit diff| {case['max_abs_diff']:.2e}   top-1 agreement "
                     f"{case['top1_agreement']:.1%}")
    return lines


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return "?"
        d = d[k]
    return d
