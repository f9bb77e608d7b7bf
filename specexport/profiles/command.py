"""`specexport profile BUNDLE`: measure, choose, and write a measured profile plus its report."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.runtime.bundle import check_writable, staged_output


def profile_bundle(bundle: Path, prompts: list[str] | None, output: Path, report: Path, base: str, new_tokens: int,
                   max_tokens: int, contexts: tuple[int, ...], reps: int, rounds: int, threads: int | None,
                   quiet: bool = False) -> dict:
    from tqdm import tqdm

    from specexport.exporter.export import AGREEMENT_PROMPTS
    from specexport.profiles import Eagle, Measurements, Medusa, Ngram, dump
    from specexport.profiles import chains as ch
    from specexport.profiles import eagle as e
    from specexport.profiles import measure as m
    from specexport.profiles.detect import detect, resolve_profile
    from specexport.profiles.report import markdown, plots
    from specexport.runtime.generate import Engine
    from specexport.runtime.sampling import Sampler, SamplingParams

    if not 1 <= max_tokens <= 64 or new_tokens < 1 or reps < 1 or rounds < 1 or not contexts or min(contexts) < 1:
        raise UserError("--max-tokens must be 1..64; --new-tokens, --reps, --rounds and --contexts must be >= 1")
    if output.exists() or report.exists():
        raise UserError(f"{output if output.exists() else report} already exists")
    check_writable(output)
    engine = Engine.load(bundle, threads=threads)
    base_profile, chosen_by = resolve_profile(base)
    manifest = engine.bundle.manifest
    if max(contexts) + 64 >= engine.max_context:
        raise UserError(f"--contexts must stay below the bundle's context limit {engine.max_context} minus 64")
    ids = [engine.encode(p) for p in (prompts or AGREEMENT_PROMPTS)]
    medusa = engine.bundle.method == "medusa"
    eagle = engine.bundle.method in ("eagle", "eagle3")
    chain = engine.bundle.method in ("draft", "ngram")
    if eagle and engine.eagle["static"] is not None:
        engine.set_eagle(tree_spec="dynamic")  # the profile chooses a dynamic tree's settings
    proposer = engine.proposer(engine.bundle.method, Sampler(SamplingParams()))
    tokens = [t for t in m.TREE_TOKENS if t <= max_tokens]
    typical = int(np.mean([len(i) for i in ids]) + new_tokens / 2)  # the context calibration steps run at
    top_ks = [k for k in e.TOP_KS if k <= manifest["method"].get("graph_top_k", 0)]
    lengths = [k for k in ch.LENGTHS if chain and _proposal_nodes(engine, k) < max(tokens)]
    if chain and not lengths:
        raise UserError(f"--max-tokens {max_tokens} leaves no room for a draft on this bundle")
    chooses = medusa or eagle or chain
    total = ((len(contexts) + 2 * chooses) * len(tokens)
             + len(ids) * (2 + (rounds if chooses else 0) + (len(top_ks) if eagle else 0) + chain))
    bar = tqdm(total=total, desc="profiling", unit="step", disable=quiet, file=sys.stderr, dynamic_ncols=True)
    with bar:
        measured = m.Measured(list(contexts), tokens, {c: m.verify_latency(engine, proposer, tokens, c, reps, bar.update)
                                                       for c in contexts})
        if medusa:  # the heads' share of a fused step, timed on their stand-alone graph
            measured.heads_ms = m.heads_latency(engine, reps)
        cal = m.calibrate(engine, ids, new_tokens, bar.update)
        measured.overhead_ms = cal["overhead_ms"]
        measured.rank_rates = cal["rank_rates"]
        measured.calibration = cal
        if not chooses:  # the others measure plain decoding side by side with their settings
            measured.calibration["plain_tokens_per_s"] = m.plain_speed(engine, ids, new_tokens)
        bar.update(len(ids))
        if medusa:  # predictions use the curve at the calibration's context, measured before and after the runs
            before = m.typical_curve(engine, proposer, measured, typical, reps, bar.update)
            ranked = m.choose_tree(measured, max_tokens, typical)
            rows = [{**ranked[0]}] + [r for r in m.preset_rows(measured, max_tokens, len(measured.rank_rates),
                                                                typical) if r["choices"] != ranked[0]["choices"]]
            measured.calibration["plain_tokens_per_s"] = m.side_by_side(engine, ids, new_tokens, rows, rounds,
                                                                        bar.update)
            m.typical_curve(engine, proposer, measured, typical, reps, bar.update, before)
            for row in rows:
                m.predict(measured, row, typical)
            measured.candidates, measured.chosen = rows, rows[0]
        if eagle:  # predictions from recorded trees, then the finalists side by side; the best measured wins
            before = m.typical_curve(engine, proposer, measured, typical, reps, bar.update)
            draft_ms = e.draft_latency(engine, typical, reps)
            deepest = max(e.DEPTHS)
            cal = {k: e.calibrate(engine, ids, new_tokens, k, deepest, min(max_tokens, k + (deepest - 1) * k * k + 1),
                                  bar.update) for k in top_ks}
            auto = e.finalists(e.predict_rows(measured, cal, draft_ms, max_tokens, typical))
            rows = auto + e.preset_rows(measured, cal, draft_ms, max_tokens, typical)
            measured.calibration["plain_tokens_per_s"] = m.side_by_side(
                engine, ids, new_tokens, rows, rounds, bar.update,
                apply=lambda r: engine.set_eagle(r["depth"], r["top_k"], r["tokens"]))
            engine.set_eagle()
            m.typical_curve(engine, proposer, measured, typical, reps, bar.update, before)
            for r in rows:  # the predictions again, with the averaged latency curve
                c = r["choices"]
                again = e.predict(measured, cal[c["top_k"]], draft_ms, c["depth"], c["top_k"], c["total_tokens"], typical)
                r.update({k: again[k] for k in ("predicted_ms", "predicted_tokens_per_s")})
            measured.draft_ms = dict(zip(e.DRAFT_TOKENS, draft_ms))
            measured.overhead_ms = round(float(np.mean([c["python_ms"] for c in cal.values()])), 3)
            measured.candidates = rows
            measured.chosen = max(auto, key=lambda r: r["measured_tokens_per_s"])  # presets are the yardstick
        if chain:  # draft lengths predicted from one recorded run at the longest, then side by side
            before = m.typical_curve(engine, proposer, measured, typical, reps, bar.update)
            cal = ch.calibrate(engine, ids, new_tokens, max(lengths), bar.update)
            rows = ch.rows(measured, cal, lengths, manifest["method"]["draft_length"], typical)
            measured.calibration["plain_tokens_per_s"] = m.side_by_side(
                engine, ids, new_tokens, rows, rounds, bar.update,
                apply=lambda r: setattr(engine, "draft_length", r["choices"]["draft_length"]))
            engine.draft_length = None
            m.typical_curve(engine, proposer, measured, typical, reps, bar.update, before)
            for r in rows:  # again with the averaged latency curve
                again = ch.predict(measured, cal, r["depth"], typical)
                r.update({k: again[k] for k in ("predicted_ms", "predicted_tokens_per_s")})
            measured.overhead_ms = cal["python_ms"]
            measured.candidates = rows
            measured.chosen = max((r for r in rows if not r.get("preset")), key=lambda r: r["measured_tokens_per_s"])
    if measured.candidates:
        m.anchor(measured, measured.candidates, typical)
    found = detect()
    hardware = f"{found.name} ({found.cores} cores{f', {found.memory_gb} GB' if found.kind == 'gpu' else ''})"
    chosen = measured.chosen
    new = dataclasses.replace(
        base_profile, name=output.stem, measured=True,
        description=base_profile.description.removesuffix(", measured") + ", measured",
        engine=dataclasses.replace(base_profile.engine, backend="onnxruntime", precision=manifest["precision"],
                                   flavour=manifest["flavour"],
                                   execution_provider=engine.target.session.get_providers()[0]),
        source=_source(base_profile, hardware, f"{engine.bundle.method} on {datetime.date.today()} (bundle "
                                              f"{manifest['model']['name']} {manifest['precision']})"),
        medusa=Medusa(tree=chosen["tree"], choices=tuple(tuple(c) for c in chosen["choices"])) if chosen and medusa
        else base_profile.medusa,
        eagle=Eagle(**chosen["choices"]) if chosen and eagle else base_profile.eagle,
        draft=_draft_settings(manifest["method"], chosen) if chosen and engine.bundle.method == "draft"
        else base_profile.draft,
        ngram=Ngram(chosen["choices"]["draft_length"], manifest["method"]["max_matches"])
        if chosen and engine.bundle.method == "ngram" else base_profile.ngram,
        limits=dataclasses.replace(base_profile.limits,
                                   max_tree_tokens=max(base_profile.limits.max_tree_tokens, chosen["tokens"] if chosen else 1)),
        measurements=Measurements(
            tree_tokens=tuple(tokens), verify_ms=tuple(measured.verify_ms[measured.context[-1]]),
            context=measured.context[-1],
            propose_ms=round(measured.overhead_ms + measured.heads_ms, 3),
            predicted_tokens_per_s=chosen["predicted_tokens_per_s"] if chosen else 0.0,
            measured_tokens_per_s=chosen["measured_tokens_per_s"] if chosen else 0.0))
    meta = {"bundle": str(bundle), "hardware": hardware, "model": manifest["model"]["name"],
            "precision": manifest["precision"], "method": engine.bundle.method, "prompts": len(ids),
            "new_tokens": new_tokens}
    with staged_output(report) as staging:  # the report appears whole with its profile, or neither does
        images = plots(measured, staging)
        (staging / "report.md").write_text(markdown(measured, meta, images))
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=output.parent, prefix=f".{output.name}.", delete=False) as f:
            f.write(dump(new, header=f"{new.description}\n{new.source}\nWritten by `specexport profile`; "
                                     f"report: {report}"))
        os.replace(f.name, output)
    return {"profile": new, "measured": measured, "report": report / "report.md", "images": images,
            "chosen_by": chosen_by}


def _source(base, hardware: str, entry: str) -> str:
    """Where a measured profile's numbers come from: this run's method, after the base's measurements of the
    other methods on the same hardware (so profiling each method in turn, each on the last one's output, keeps
    them all)."""
    prefix = f"measured by specexport profile on {hardware}: "
    method = entry.split(" ", 1)[0]
    earlier = base.source.removeprefix(prefix).split("; ") if base.measured and base.source.startswith(prefix) else []
    return prefix + "; ".join([e for e in earlier if e.split(" ", 1)[0] != method] + [entry])


def _proposal_nodes(engine, length: int) -> int:
    """The most draft nodes a step proposes at draft length `length` on this bundle."""
    from specexport.runtime.sampling import Sampler, SamplingParams

    before, engine.draft_length = engine.draft_length, length
    try:
        return engine.proposer(engine.bundle.method, Sampler(SamplingParams())).max_nodes
    finally:
        engine.draft_length = before


def _draft_settings(method: dict, chosen: dict):
    """A draft bundle's chosen length, with its tree's branching (cut to the length; trailing chain links dropped)."""
    from specexport.profiles import Draft

    length = chosen["choices"]["draft_length"]
    branching = list(method["draft_branching"][:length])
    while branching and branching[-1] == 1:
        branching.pop()
    return Draft(draft_length=length, branching=tuple(branching))


def summary(result: dict) -> list[str]:
    from specexport.profiles import measure as m

    measured = result["measured"]
    lines = []
    first = measured.context[0]
    curve = measured.verify_ms[first]
    lines.append(f"verify ms at context {first}: " + ", ".join(f"T={t} {ms:.1f}" for t, ms in zip(measured.tree_tokens, curve)))
    cal = measured.calibration
    lines.append(f"calibration: tau {np.mean(cal['accept_lengths']):.2f}, {cal['step_ms']:.1f} ms per step, "
                 f"overhead {measured.overhead_ms:.2f} ms, plain decoding {cal['plain_tokens_per_s']:.1f} tokens/s")
    for r in sorted(measured.candidates, key=lambda r: -r.get("measured_tokens_per_s", 0)):
        lines.append(f"  {r['tree']:<18} {r['tokens']:>3} tokens  E[tau] {r['expected_tau']:.2f}  tau {r['measured_tau']:.2f}  "
                     f"predicted {r['predicted_tokens_per_s']:6.1f} ({r['anchored_tokens_per_s']:6.1f} at the run's plain rate)  "
                     f"measured {r['measured_tokens_per_s']:6.1f} tokens/s")
    if measured.chosen:
        c = measured.chosen
        curve, anchored = m.errors(c)
        lines.append(f"chosen {c['tree']} ({c['tokens']} tokens): prediction error {curve:+.1f}%, {anchored:+.1f}% at the "
                     f"run's plain rate (speedup predicted {c['predicted_speedup']:.2f}x, measured "
                     f"{c['measured_speedup']:.2f}x)")
    lines.append(f"report: {result['report']}")
    return lines
