"""`build --method best` on a CPU no profile was measured on: measure the candidates here, once per machine.

A profile's [speed] table holds on the CPU it was measured on (its kernel features, profiles/detect.py): on another
the balance moves (plain int4 decoded 2x faster on a VNNI EPYC than on an AVX2 one, and speculation's wider
verification calls did not speed up alike). So where the profile `auto` found was measured elsewhere, the probe
builds each candidate method in each CPU precision (int4, int8) without validation, int4 both in ONNX Runtime's
MatMulNBits and, where it compiles here, in specexport's own kernel (`--int4-rows`), runs them side by side on a
few built-in prompts (greedy, interleaved, the order alternating), and writes a profile: the base profile's
settings, this CPU's features, the [speed] it measured, and the int4 kernel in which plain decoding ran faster
(its `int4_kernel`; [speed]'s int4 figures are that kernel's). The profile is cached per machine and model (the CPU,
its cores and features, the onnxruntime version, the model's name), so the next build reads it at once.

Candidates: plain decoding always (so that `best` is plain where nothing beats it), and the speculative methods
that the base profile measured within CANDIDATE_SHARE of its fastest (the order of methods comes mostly from their
acceptance, which the CPU does not change; what the CPU changes, the cost of wider verification, is what the probe
measures). A method that cannot be built for this model (no heads or draft for it) is left out, with a line.

For `build --serving` the probe also measures [serve_speed]: each candidate with SERVE_CLIENTS requests batched at
once (the scheduler, its tree budget on), in int4 and in the int8 a serving build takes (`--int8-rows channel`:
exact under batching), so that the serving build picks from what this CPU does under load: a kernel whose cost
grows with the rows (int4's here) can be the fastest alone and the slowest batched. A probe kept without them is
measured again when a serving build asks.

Example: on a 2-core AVX-512 VNNI EPYC with the AVX2 profile cpu-2core as base, the candidates are none, suffix
and ngram, in int4 (both kernels) and int8: nine builds and nine bundles run on PROMPTS prompts, a few minutes.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import onnxruntime as ort

from specexport.errors import UserError
from specexport.exporter import arch, methods, row_invariance, sources
from specexport.exporter.drafts.mtp import mtp_layers
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import SERVING_INT8, GraphOptions
from specexport.fsutil import cache_dir
from specexport.profiles import Profile, dump, load_profile, merge
from specexport.profiles.detect import Found, detect
from specexport.prompts import AGREEMENT_PROMPTS
from specexport.runtime import kernels
from specexport.runtime.generate import Engine
from specexport.runtime.methods import PLAIN_NAME
from specexport.runtime.methods.suffix import fresh_requests
from specexport.runtime.scheduler import Scheduler

PRECISIONS = ("int4", "int8")  # what a CPU build can take: fp32 streams 4-8x the bytes and is never the fastest
CANDIDATE_SHARE = 0.9  # speculative methods within this share of the base profile's fastest are probed
PROMPTS = 4  # built-in prompts each candidate runs
NEW_TOKENS = 64
ROUNDS = 2
MAX_CONTEXT = 1024  # the probe's bundles hold the prompts and their tokens, no more
MTP = "mtp"  # the method of a checkpoint's own MTP layers: a candidate wherever the checkpoint has them
SERVE_CLIENTS = 16  # requests batched at once for [serve_speed], as the bundled profiles' were measured


def cache_path(model: str, found: Found) -> Path:
    """The probe file of `model` on this machine, e.g. probes/smollm2-135m-cpu-2core-avx512_vnni-1a2b3c4d.toml."""
    machine = f"{found.name}|{found.cores}|{' '.join(found.features)}|onnxruntime {ort.__version__}"
    digest = hashlib.sha256(machine.encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9_.-]+", "-", model.lower()).strip("-") or "model"
    top = found.features[-1] if found.features else "basic"
    return cache_dir() / "probes" / f"{slug}-cpu-{found.cores}core-{top}-{digest}.toml"


def cached(model: str, found: Found | None = None) -> Profile | None:
    """The probe kept for `model` on this machine, or None (a damaged file is ignored: the next probe replaces it)."""
    path = cache_path(model, found or detect())
    if not path.is_file():
        return None
    try:
        return load_profile(path)
    except UserError:
        return None


def candidates(base: Profile) -> list[str]:
    """Plain decoding, then the speculative methods the base profile measured within CANDIDATE_SHARE of its
    fastest (fastest first); without a [speed] table, the training-free lookups (suffix, ngram)."""
    speeds = {m: max(by.values()) for m, by in base.speed.items() if m != PLAIN_NAME}
    if not speeds:
        return [PLAIN_NAME, "suffix", "ngram"]
    best = max(speeds.values())
    return [PLAIN_NAME] + sorted((m for m, v in speeds.items() if v >= CANDIDATE_SHARE * best), key=lambda m: -speeds[m])


def probe(model_spec: str, base: Profile, say=lambda text: None, serving: bool = False) -> Profile:
    """Measure the candidates of `base` for `model_spec` here (module docstring), keep the profile in the cache and
    return it. `say(text)` is told each stage; `serving`: [serve_speed] too."""
    found = detect()
    source = sources.resolve(model_spec)
    names = candidates(base)
    if mtp_layers(sources.load_config(source)) and MTP not in names:  # the checkpoint carries its own draft
        names.append(MTP)
    say(f"probing {', '.join(names)} in {' and '.join(PRECISIONS)} on this CPU ({found.describe()}): no profile was "
        "measured on its features")
    with tempfile.TemporaryDirectory(prefix="specexport-probe-") as tmp:
        bundles = _build(model_spec, source, base, names, Path(tmp), say, serving)
        built = {m for m, _, _ in bundles}
        if PLAIN_NAME not in built or len(built) < 2:
            raise UserError("the probe could not build plain decoding and a speculative method for this model: pass "
                            "--method NAME")
        measured = _measure({(m, p, kernel): b for (m, p, kernel), b in bundles.items() if p == "int4" or not kernel},
                            say)
        int4_kernel = _int4_kernel(measured)
        speed = _folded(measured, int4_kernel)
        served = {(m, p): b for (m, p, kernel), b in bundles.items()
                  if (p == "int4" and kernel == int4_kernel) or (p == "int8" and kernel)}
        serve_speed = _serve(served, say) if serving else {}
    profile = _profile(base, found, source.name, speed, serve_speed, int4_kernel)
    path = cache_path(source.name, found)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(dump(profile, header=f"{profile.description}\n{profile.source}\nWritten by the probe of "
                                     "`specexport build --method best`"))
    os.replace(f.name, path)
    return load_profile(path)


def _build(model_spec: str, source, base: Profile, names: list[str], folder: Path, say, serving: bool) -> dict:
    """Each candidate in each precision, int4 also in our kernel where it compiles (and with `serving` in the serving
    build's int8), built into `folder` without validation, the model loaded once: {(method, precision, kernel or
    ""): bundle folder}."""
    say(f"loading {source.name}")
    loaded = sources.load_model(source)
    context = min(MAX_CONTEXT, arch.dims_from_config(sources.load_config(source)).max_positions)
    variants = [(p, "") for p in PRECISIONS] + ([("int4", kernels.ROWS4)] if _rows4_compiles(say) else []) \
        + ([("int8", SERVING_INT8)] if serving else [])
    bundles = {}
    total = len(names) * len(variants)
    for name in names:
        for precision, kernel in variants:
            say(f"building {name} {precision}{f' {kernel}' if kernel else ''} ({len(bundles) + 1}/{total})")
            settings = merge(base, methods.get(name).runtime, {})
            graph = GraphOptions(precision=precision, int8_rows=kernel if precision == "int8" else "",
                                 int4_rows=kernel == kernels.ROWS4)
            options = ExportOptions(graph=graph, max_context=context, optimize=True, validate=False, method=name,
                                    settings=settings, profile={**base.as_dict(), "chosen": "probe"})
            out = folder / f"{name}-{precision}{kernel}"
            try:
                export_bundle(model_spec, out, options, quiet=True, loaded=loaded)
            except UserError as e:
                say(f"  {name} left out: {e}")
                break
            bundles[(name, precision, kernel)] = out
    return bundles


def _rows4_compiles(say) -> bool:
    """Whether our int4 kernel compiles here (else int4 is MatMulNBits only, and the line says why)."""
    if why := kernels.unavailable():
        say(f"int4 in MatMulNBits only: {why}")
        return False
    return True


def _int4_kernel(measured: dict) -> str:
    """The int4 kernel `build` will take: kernels.ROWS4 where it was measured and either ran plain decoding faster or
    is the exact one here (MatMulNBits' int4 measured not row-invariant on this CPU), else "" (MatMulNBits)."""
    plain = measured[PLAIN_NAME]
    if _label("int4", kernels.ROWS4) not in plain:
        return ""
    faster = plain[_label("int4", kernels.ROWS4)] > plain.get("int4", 0.0)
    return kernels.ROWS4 if faster or row_invariance.rows_apart(4) else ""


def _folded(measured: dict, int4_kernel: str) -> dict:
    """[speed] from the measured table: each method's int4 figure its `int4_kernel` bundle's."""
    speed = {}
    for name, by in measured.items():
        speed[name] = {p: v for p, v in by.items() if " " not in p}
        if int4_kernel and _label("int4", int4_kernel) in by:
            speed[name]["int4"] = by[_label("int4", int4_kernel)]
    return speed


def _label(precision: str, kernel: str) -> str:
    return f"{precision} {kernel}" if kernel else precision


def _measure(bundles: dict, say) -> dict:
    """Decode tokens/s of each bundle (after the first token), side by side: every prompt runs every bundle, the
    order alternating, ROUNDS times, each run as a fresh engine's (a response store would draft a round's answers
    from the round before). `bundles` keyed (method, precision, kernel or ""): {method: {precision[ kernel]:
    tokens/s}}."""
    engines = {key: Engine.load(path) for key, path in bundles.items()}
    with ExitStack() as fresh:
        for engine in engines.values():
            fresh.enter_context(fresh_requests(engine))
        return _side_by_side(engines, say)


def _side_by_side(engines: dict, say) -> dict:
    first = next(iter(engines.values()))
    ids = [first.encode(p) for p in AGREEMENT_PROMPTS[:PROMPTS]]
    for engine in engines.values():
        engine.generate(ids[0], max_new_tokens=8)  # warm-up (and the drafting governor's latency)
    totals = {key: [0, 0.0] for key in engines}
    keys = list(engines)
    for r in range(ROUNDS):
        say(f"running {len(keys)} bundles on {len(ids)} prompts, round {r + 1}/{ROUNDS}")
        for k, prompt in enumerate(ids):
            for key in keys if (k + r) % 2 == 0 else keys[::-1]:
                result = engines[key].generate(prompt, max_new_tokens=NEW_TOKENS, stop_ids=())
                totals[key][0] += result.stats.new_tokens - 1
                totals[key][1] += result.stats.seconds - result.stats.ttft_s
    speed: dict = {}
    for (name, precision, kernel), (tokens, seconds) in totals.items():
        speed.setdefault(name, {})[_label(precision, kernel)] = round(tokens / seconds, 1) if seconds > 0 else 0.0
    plain = max(speed[PLAIN_NAME].values())
    for name, by in speed.items():
        say("  " + "  ".join(f"{name} {p} {v:.1f} tokens/s ({v / plain:.2f}x)" for p, v in by.items()))
    return speed


def _serve(bundles: dict, say) -> dict:
    """Tokens/s of each bundle with SERVE_CLIENTS requests at once (the built-in prompts in turn, NEW_TOKENS each),
    batched by one scheduler per bundle (its tree budget on), ROUNDS times, the order alternating:
    {method: {precision: tokens/s}}."""
    engines = {key: Engine.load(path) for key, path in bundles.items()}
    first = next(iter(engines.values()))
    prompts = [first.encode(p) for p in AGREEMENT_PROMPTS]
    jobs = [prompts[i % len(prompts)] for i in range(SERVE_CLIENTS)]
    schedulers = {key: Scheduler(engine, max_batch=SERVE_CLIENTS, background=False) for key, engine in engines.items()}
    totals = {key: [0, 0.0] for key in engines}
    keys = list(engines)
    try:
        with ExitStack() as fresh:
            for engine in engines.values():
                fresh.enter_context(fresh_requests(engine))
            for scheduler in schedulers.values():  # warm-up, untimed
                scheduler.submit(jobs[0], max_new_tokens=8, stop_ids=())
                scheduler.run_until_idle()
            for r in range(ROUNDS):
                say(f"serving {SERVE_CLIENTS} requests at once on {len(keys)} bundles, round {r + 1}/{ROUNDS}")
                for key in keys if r % 2 == 0 else keys[::-1]:
                    start = time.perf_counter()
                    requests = [schedulers[key].submit(p, max_new_tokens=NEW_TOKENS, stop_ids=()) for p in jobs]
                    schedulers[key].run_until_idle()
                    totals[key][1] += time.perf_counter() - start
                    totals[key][0] += sum(q.result(timeout=0).stats.new_tokens for q in requests)
    finally:
        for scheduler in schedulers.values():
            scheduler.close()
    serve: dict = {}
    for (name, precision), (tokens, seconds) in totals.items():
        serve.setdefault(name, {})[precision] = round(tokens / seconds, 1) if seconds > 0 else 0.0
    for name, by in serve.items():
        say("  " + "  ".join(f"{name} {p} {v:.1f} tokens/s at {SERVE_CLIENTS} requests" for p, v in by.items()))
    return serve


def _profile(base: Profile, found: Found, model: str, speed: dict, serve_speed: dict, int4_kernel: str) -> Profile:
    today = datetime.date.today()
    hardware = dataclasses.replace(base.hardware, match=(found.name,), min_cores=found.cores, max_cores=found.cores,
                                   features=found.features)
    best = max(speed, key=lambda m: max(speed[m].values()))
    kernel = "specexport's own kernel (--int4-rows)" if int4_kernel else "MatMulNBits"
    return dataclasses.replace(
        base, name=f"probe-{found.cores}core-{'-'.join(found.features) or 'basic'}", measured=True, path="",
        description=f"{found.describe()}: probed for {model}",
        source=f"probed by specexport build on {found.describe()} on {today}, {model}, "
               f"{PROMPTS} built-in prompts x {NEW_TOKENS} tokens x {ROUNDS} rounds, greedy; settings from "
               f"{base.name}; fastest: {best} {max(speed[best], key=speed[best].get)}; int4 in {kernel}"
               + (f"; [serve_speed]: {SERVE_CLIENTS} requests at once, int8 as --int8-rows {SERVING_INT8}"
                  if serve_speed else ""),
        hardware=hardware, speed=speed, serve_speed=serve_speed, measurements=type(base.measurements)(),
        engine=dataclasses.replace(base.engine, int4_kernel=int4_kernel))


def describe(profile: Profile, serving: bool = False) -> list[str]:
    """The probe's table ([serve_speed]'s with `serving`), fastest first, for the build's output."""
    speeds = profile.serve_speed if serving else profile.speed
    rows = sorted(((v, m, p) for m, by in speeds.items() for p, v in by.items()), reverse=True)
    plain = max(speeds[PLAIN_NAME].values())
    return [f"  {m:>7} {p}  {v:7.1f} tokens/s  {v / plain:.2f}x plain" for v, m, p in rows]

