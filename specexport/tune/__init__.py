"""`specexport profile BUNDLE`: measure a bundle on this hardware, choose its method's settings, and write a
measured profile (what `build --profile` reads) with a report.

1. Verification latency against tree tokens (chains of 1..max tokens, the step's real outputs) at one or more
   context lengths, and the batched engine's call by sequences (1..--max-batch) and width (1..16 or --max-tokens)
   at the first context: its tree budget reads that table from the profile.
2. Greedy calibration runs of the bundle's method as built, recorded step by step: accept lengths, the time per
   step outside the target's call.
3. The method's tuner (TUNERS; one per method family) predicts its settings from the recorded steps, runs the best
   side by side with plain decoding, and picks one (tune/medusa.py, eagle.py, chain.py, suffix.py). Plain decoding
   has nothing to choose: its speed is measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specexport.errors import UserError
from specexport.fsutil import check_writable, staged_output
from specexport.options import with_given
from specexport.profiles import dump, resolve_profile
from specexport.profiles.detect import detect
from specexport.profiles.schema import Measurements
from specexport.prompts import AGREEMENT_PROMPTS
from specexport.runtime import kernels
from specexport.runtime.budget import grid
from specexport.runtime.generate import Engine
from specexport.tune import chain, dflash, eagle, measure, medusa, suffix


class PlainTuner:
    """Plain decoding: nothing to choose; its speed is measured."""

    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return prompts

    def tune(self, engine, measured, recording, t) -> None:
        measured.calibration["plain_tokens_per_s"] = measure.plain_speed(engine, t.ids, t.new_tokens)
        t.progress(len(t.ids))


TUNERS = {"none": PlainTuner(), "ngram": chain.TUNER, "draft": chain.TUNER, "medusa": medusa.TUNER,
          "eagle": eagle.TUNER, "eagle3": eagle.TUNER, "mtp": eagle.TUNER, "dflash": dflash.TUNER, "suffix": suffix.TUNER, "hybrid": suffix.TUNER}


@dataclass
class Tuning:
    """What a tuner works with: the engine, the calibration prompts, and the measurements it may repeat."""

    engine: Engine
    measured: measure.Measured
    ids: list[list[int]]
    new_tokens: int
    max_tokens: int
    context: int  # the context the calibration steps run at: predictions use the latency curve there
    reps: int
    rounds: int
    progress: object

    def curve(self, before: list[float] | None = None) -> list[float]:
        return measure.latency_curve_at_context(self.engine, self.measured, self.context, self.reps, self.progress,
                                                before)

    def side_by_side(self, rows: list[dict]) -> float:
        return measure.side_by_side(self.engine, self.ids, self.new_tokens, rows, self.rounds, self.progress)


def profile_bundle(bundle: Path, prompts: list[str] | None, output: Path, report: Path, base: str, new_tokens: int,
                   max_tokens: int, contexts: tuple[int, ...], reps: int, rounds: int, threads: int | None,
                   quiet: bool = False, max_batch: int = 16) -> dict:
    if not 1 <= max_tokens <= 64 or new_tokens < 1 or reps < 1 or rounds < 1 or not contexts or min(contexts) < 1:
        raise UserError("--max-tokens must be 1..64; --new-tokens, --reps, --rounds and --contexts must be >= 1")
    if not 0 <= max_batch <= 256:
        raise UserError(f"--max-batch must be 0..256 (0: no batched measurement), got {max_batch}")
    from specexport.tune.report import markdown, plots  # the profile extra (matplotlib): before anything is measured

    if output.exists() or report.exists():
        raise UserError(f"{output if output.exists() else report} already exists")
    check_writable(output)
    engine = Engine.load(bundle, threads=threads)
    base_profile, chosen_by = resolve_profile(base)
    manifest = engine.bundle.manifest
    if max(contexts) + 64 >= engine.max_context:
        raise UserError(f"--contexts must stay below the bundle's context limit {engine.max_context} minus 64")
    ids = [engine.encode(p) for p in (prompts or AGREEMENT_PROMPTS)]
    tuner = TUNERS[engine.bundle.method]
    tokens = [t for t in measure.TREE_TOKENS if t <= max_tokens]
    sequences, widths = (grid(max_batch) if max_batch else []), grid(min(16, max_tokens))
    total = len(contexts) * len(tokens) + len(sequences) + len(ids) + \
        tuner.progress_steps(engine, len(ids), len(tokens), rounds)
    with tqdm(total=total, desc="profiling", unit="step", disable=quiet, file=sys.stderr, dynamic_ncols=True) as bar:
        measured = measure.Measured(list(contexts), tokens, {c: measure.verify_latency(engine, tokens, c, reps,
                                                                                       bar.update) for c in contexts})
        measure.batch_latency(engine, measured, sequences, widths, contexts[0], reps, bar.update)
        recording = measure.record_runs(engine, ids, new_tokens, bar.update)
        measured.overhead_ms = recording.overhead_ms
        measured.calibration = {"accept_lengths": recording.accept_lengths, "step_ms": recording.step_ms}
        context = int(np.mean([len(i) for i in ids]) + new_tokens / 2)  # where the calibration steps run
        tuning = Tuning(engine, measured, ids, new_tokens, max_tokens, context, reps, rounds, bar.update)
        tuner.tune(engine, measured, recording, tuning)
    if measured.candidates:
        measure.anchor(measured, measured.candidates, context)
    new = _measured_profile(base_profile, engine, measured, tokens, output.stem)
    meta = {"bundle": engine.bundle.path.name, "hardware": _hardware(), "model": manifest["model"]["name"],
            "precision": manifest["precision"], "method": engine.bundle.method, "prompts": len(ids),
            "new_tokens": new_tokens}
    with staged_output(report, kind="a profile report") as staging:  # the report appears whole with its profile
        images = plots(measured, staging)
        (staging / "report.md").write_text(markdown(measured, meta, images))
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=output.parent, prefix=f".{output.name}.", delete=False) as f:
            f.write(dump(new, header=f"{new.description}\n{new.source}\nWritten by `specexport profile`; "
                                     f"report: {report.name}"))
        os.replace(f.name, output)
    return {"profile": new, "measured": measured, "report": report / "report.md", "images": images,
            "chosen_by": chosen_by}


def _hardware() -> str:
    found = detect()
    if found.kind == "gpu":
        return f"{found.name} ({found.cores} cores, {found.memory_gb} GB)"
    return f"{found.name} ({found.cores} cores; {' '.join(found.features) or 'no vector features found'})"


def _measured_profile(base, engine: Engine, measured: measure.Measured, tokens: list[int], name: str):
    """The base profile with this bundle's engine, the chosen settings of its method and the measurements."""
    manifest, chosen = engine.bundle.manifest, measured.chosen
    section = engine.method.profile_section
    methods = dict(base.methods)
    if chosen and section:
        methods[section] = with_given(base.methods[section], chosen["settings"], "profile")
    entry = (f"{engine.bundle.method} on {datetime.date.today()} (bundle {manifest['model']['name']} "
             f"{manifest['precision']})")
    found = detect()
    hardware, speeds = base.hardware, {"speed": base.speed, "serve_speed": base.serve_speed}
    if found.kind == "cpu":  # the base's speeds were measured on this CPU's kernel features, or are another CPU's
        hardware = dataclasses.replace(base.hardware, features=found.features)
        if set(base.hardware.features) != set(found.features):
            speeds = {"speed": {}, "serve_speed": {}}
    return dataclasses.replace(
        base, name=name, path="", measured=True, methods=methods, hardware=hardware, **speeds,
        description=base.description.removesuffix(", measured"),  # `measured = true` says it (older files said both)
        engine=dataclasses.replace(base.engine, backend="onnxruntime", precision=manifest["precision"],
                                   flavour=manifest["flavour"], int4_kernel=kernels.int4_kernel(manifest)
                                   if manifest["precision"] == "int4" else base.engine.int4_kernel),
        source=_source(base, _hardware(), entry),
        limits=dataclasses.replace(base.limits, max_tree_tokens=max(base.limits.max_tree_tokens,
                                                                    chosen["tokens"] if chosen else 1)),
        measurements=Measurements(
            tree_tokens=tuple(tokens), verify_ms=tuple(measured.verify_ms[measured.context[-1]]),
            context=measured.context[-1], propose_ms=round(measured.overhead_ms + measured.heads_ms, 3),
            predicted_tokens_per_s=chosen["predicted_tokens_per_s"] if chosen else 0.0,
            measured_tokens_per_s=chosen["measured_tokens_per_s"] if chosen else 0.0,
            batch_context=measured.batch_context, batch_sequences=tuple(measured.batch_sequences),
            batch_widths=tuple(measured.batch_widths), batch_ms=tuple(tuple(row) for row in measured.batch_ms),
            batch_single_ms=tuple(tuple(row) for row in measured.batch_single_ms)))


def _source(base, hardware: str, entry: str) -> str:
    """Where a measured profile's numbers come from: this run's method, after the base's measurements of the
    other methods on the same hardware (so profiling each method in turn, each on the last one's output, keeps
    them all)."""
    prefix = f"measured by specexport profile on {hardware}: "
    method = entry.split(" ", 1)[0]
    earlier = base.source.removeprefix(prefix).split("; ") if base.measured and base.source.startswith(prefix) else []
    return prefix + "; ".join([e for e in earlier if e.split(" ", 1)[0] != method] + [entry])


def summary(result: dict) -> list[str]:
    measured = result["measured"]
    first = measured.context[0]
    lines = [f"verify ms at context {first}: " + ", ".join(f"T={t} {ms:.1f}" for t, ms in
                                                          zip(measured.tree_tokens, measured.verify_ms[first]))]
    cal = measured.calibration
    lines.append(f"calibration: tau {np.mean(cal['accept_lengths']):.2f}, {cal['step_ms']:.1f} ms per step, "
                 f"overhead {measured.overhead_ms:.2f} ms, plain decoding {cal['plain_tokens_per_s']:.1f} tokens/s")
    for r in sorted(measured.candidates, key=lambda r: -r.get("measured_tokens_per_s", 0)):
        lines.append(f"  {r['tree']:<18} {r['tokens']:>3} tokens  E[tau] {r['expected_tau']:.2f}  tau "
                     f"{r['measured_tau']:.2f}  predicted {r['predicted_tokens_per_s']:6.1f} "
                     f"({r['anchored_tokens_per_s']:6.1f} at the run's plain rate)  measured "
                     f"{r['measured_tokens_per_s']:6.1f} tokens/s")
    if measured.chosen:
        c = measured.chosen
        curve, anchored = measure.errors(c)
        lines.append(f"chosen {c['tree']} ({c['tokens']} tokens): prediction error {curve:+.1f}%, {anchored:+.1f}% at "
                     f"the run's plain rate (speedup predicted {c['predicted_speedup']:.2f}x, measured "
                     f"{c['measured_speedup']:.2f}x)")
    lines.append(f"report: {result['report']}")
    return lines
