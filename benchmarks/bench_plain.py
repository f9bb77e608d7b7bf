#!/usr/bin/env python
"""Plain greedy decoding of SmolLM2-135M: our bundles (fp32, int8, int4) against onnxruntime-genai (fp32, int4) and
transformers `generate` (fp32), each engine in a process of its own.

A round runs every engine once, one after the other, the order rotating from round to round. Each run is a fresh
process with the same threads and nothing else loaded: it loads its engine, warms it up, generates exactly N new
tokens for every prompt (EOS stops no one; the same prompt token ids for everyone), then times forwards of T new
tokens at 256 tokens of context on its own graph (ours: the bundle's target graph through our backend; genai: a raw
ONNX Runtime session on genai's graph, its cache bound in place, after its generator is freed). Per engine, the
median over rounds and the spread (min-max) of: tokens/s (new tokens / wall time, prefill included), decode ms per
token (after the first), TTFT, and the step times; a tokens/s that disagrees with the engine's own step time shows
as decode ms per token well above its T=1 step. "other CPU" is the share of the machine that other processes used
while the engine ran: above ~5% its numbers are not to be trusted.

onnxruntime-genai is not a dependency of specexport: it lives in its own venv (CACHE/genai-venv), made on first use,
with its model folders built by its own builder from the same dequantized SmolLM2 weights.

    python benchmarks/bench_plain.py [--cache bench-cache] [--rounds 3] [--new-tokens 128] [--prompts 6]
                                  [--engines ours-fp32,genai-fp32,...] [--rebuild] [--max-wait 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import save_hf_folder

PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
    "What are three good tips for learning a new language as an adult?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "List the planets of the solar system in order, with one fact about each.",
]
ENGINES = ["ours-fp32", "ours-int8", "ours-int4", "genai-fp32", "genai-int4", "transformers-fp32"]
STEP_T = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 256  # tokens of context for the step times
REPEATS = 15  # timed forwards per T (median), after 3 warm-ups
GENAI_PACKAGES = ["onnxruntime-genai", "torch==2.13.0", "transformers", "onnx", "onnx-ir", "onnxscript", "numpy"]
# (label, numerator, denominator, target): tokens/s ratios the project aims for, all "at least"
TARGETS = [
    ("ours fp32 / genai fp32", "ours-fp32", "genai-fp32", 1.0),
    ("ours int4 / genai int4", "ours-int4", "genai-int4", 1.0),
    ("ours int8 / genai int4", "ours-int8", "genai-int4", 0.75),
    ("ours fp32 / transformers", "ours-fp32", "transformers-fp32", 2.0),
]
STEP_TARGETS = [("ours-fp32", "genai-fp32"), ("ours-int4", "genai-int4")]  # our T=1 step at most genai's


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(cmd: list, log_file: Path | None = None, **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd) + (f"  (output: {log_file})" if log_file else ""))
    with open(log_file, "w") if log_file else contextlib.nullcontext(sys.stderr) as out:  # stdout: the table
        done = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT if log_file else None, **kw)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {cmd[0]} ... {'see ' + str(log_file) if log_file else ''}")


# -- a shared machine: other processes' CPU use while an engine runs -------------------------------
def _busy_seconds() -> float:
    """CPU seconds every process has used since boot (all cores, idle and iowait excluded)."""
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:9]]
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait: float, threshold: float = 0.05) -> None:
    deadline = time.monotonic() + max_wait
    while True:
        busy, wall = _busy_seconds(), time.monotonic()
        time.sleep(2)
        share = (_busy_seconds() - busy) / ((time.monotonic() - wall) * os.cpu_count())
        if share < threshold or time.monotonic() > deadline:
            if share >= threshold:
                log(f"other processes still use {share:.0%} of the CPU; timing anyway")
            return
        log(f"waiting for a quiet machine (other processes use {share:.0%} of the CPU)")
        time.sleep(8)


# -- the engines' worker processes: one run each, one JSON line out ------------------------------------
def work_ours(bundle: Path, prompts: list[list[int]], n: int, context: list[int]) -> dict:
    import numpy as np

    from specexport.runtime import tree
    from specexport.runtime.generate import Engine

    eng = Engine.load(bundle)
    eng.generate(context[:16], max_new_tokens=8, stop_ids=())  # warm-up
    rows = []
    for ids in prompts:
        g = eng.generate(ids, max_new_tokens=n, stop_ids=())
        rows.append({"new_tokens": g.stats.new_tokens, "seconds": g.stats.seconds, "ttft_s": g.stats.ttft_s,
                     "tokens": g.tokens})
    cache = eng.target.new_cache(CONTEXT + max(STEP_T))
    eng.prefill(cache, context)  # cache.length = CONTEXT; the timed forwards below never advance it
    rng = np.random.default_rng(0)

    def step(t: int) -> float:  # a chain of t new tokens, logits for every row (as verifying t drafts needs)
        ids, pos = rng.integers(3, 49152, size=(1, t)), CONTEXT + np.arange(t)[None]
        start = time.perf_counter()
        eng.target.forward(cache, ids, pos, tree.causal_mask(t), np.arange(t))
        return time.perf_counter() - start

    agreement = (eng.bundle.manifest.get("numerics") or {}).get("agreement")
    return {"rows": rows, "step_ms": step_times(step), "agreement": agreement}


def work_transformers(prompts: list[list[int]], n: int) -> dict:
    import torch

    from specexport.exporter.sources import load_model, resolve

    model, tokenizer = load_model(resolve("smollm2-135m"))
    pad = tokenizer.eos_token_id

    def generate(ids: list[int], count: int) -> dict:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False,
                                 pad_token_id=pad)
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        return {"new_tokens": len(tokens), "seconds": seconds, "ttft_s": None, "tokens": tokens}

    generate([1, 2, 3], 4)  # warm-up
    return {"rows": [generate(ids, n) for ids in prompts], "threads": torch.get_num_threads()}


def step_times(step) -> dict:
    """Median ms per forward for each T (the same code runs in genai's worker: see GENAI_WORKER)."""
    out = {}
    for t in STEP_T:
        times = [step(t) for _ in range(3 + REPEATS)][3:]
        out[t] = round(1000 * statistics.median(times), 3)
    return out


# onnxruntime-genai in its own venv: one run per process, the same protocol as work_ours
GENAI_WORKER = r"""
import gc, json, os, statistics, sys, time
from pathlib import Path
import numpy as np, onnxruntime as ort, onnxruntime_genai as og

folder, job = Path(sys.argv[1]), json.loads(sys.argv[2])
STEP_T, CONTEXT, REPEATS = job["step_t"], job["context_tokens"], job["repeats"]

def generate(model, ids, n):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    start = time.perf_counter()
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    gen.generate_next_token()
    ttft = time.perf_counter() - start
    while not gen.is_done():
        gen.generate_next_token()
    tokens = [int(t) for t in gen.get_sequence(0)[len(ids):]]
    return {"new_tokens": len(tokens), "seconds": time.perf_counter() - start, "ttft_s": ttft, "tokens": tokens}

def session_step(folder, capacity):
    # raw onnxruntime on genai's graph, each layer's KV buffer bound as both past and present (GQA shares it)
    dec = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = len(os.sched_getaffinity(0))
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    sess = ort.InferenceSession(str(folder / dec["filename"]), so, providers=["CPUExecutionProvider"])
    inputs = {i.name: i.type for i in sess.get_inputs()}
    kv_type = np.float16 if "float16" in inputs["past_key_values.0.key"] else np.float32
    mask_type = np.int32 if "int32" in inputs["attention_mask"] else np.int64
    io, keep = sess.io_binding(), []
    for layer in range(dec["num_hidden_layers"]):
        for kind in ("key", "value"):
            keep.append(ort.OrtValue.ortvalue_from_numpy(
                np.zeros((1, dec["num_key_value_heads"], capacity, dec["head_size"]), kv_type)))
            io.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", keep[-1])
            io.bind_ortvalue_output(f"present.{layer}.{kind}", keep[-1])

    def call(ids, past):  # K/V of the new tokens land at rows [past, past + len(ids))
        io.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, past + len(ids)), dtype=mask_type))
        if "position_ids" in inputs:
            io.bind_cpu_input("position_ids", (past + np.arange(len(ids), dtype=np.int64))[None])
        io.bind_output("logits", "cpu")
        sess.run_with_iobinding(io)
    return call

model = og.Model(str(folder))
context = job["context"]
generate(model, context[:16], 8)  # warm-up
rows = [generate(model, ids, job["new_tokens"]) for ids in job["prompts"]]
del model
gc.collect()
call = session_step(folder, CONTEXT + max(STEP_T))
call(context, 0)
rng = np.random.default_rng(0)

def step(t):
    ids = rng.integers(3, 49152, size=t).tolist()
    start = time.perf_counter()
    call(ids, CONTEXT)
    return time.perf_counter() - start

step_ms = {}
for t in STEP_T:
    times = [step(t) for _ in range(3 + REPEATS)][3:]
    step_ms[t] = round(1000 * statistics.median(times), 3)
versions = {"onnxruntime_genai": getattr(og, "__version__", None), "onnxruntime": ort.__version__}
print(json.dumps({"rows": rows, "step_ms": step_ms, "versions": versions}), flush=True)
"""


def worker_main(spec: str, job_file: Path) -> None:
    """`--worker`: one run of one of our engines (or transformers), the result as one JSON line on stdout."""
    job = json.loads(job_file.read_text())
    if spec == "transformers":
        result = work_transformers(job["prompts"], job["new_tokens"])
    else:
        result = work_ours(Path(spec), job["prompts"], job["new_tokens"], job["context"])
    print(json.dumps(result), flush=True)


# -- preparing the engines -------------------------------------------------------------------------
def ensure_bundle(cache: Path, precision: str, rebuild: bool) -> Path:
    path = cache / f"smollm2-135m-none-{precision}"
    if rebuild or not (path / "manifest.json").is_file():
        run([sys.executable, "-c", "from specexport.cli import main; main()", "build", "--model", "smollm2-135m",
             "--method", "none", "--precision", precision, "--output", path, "--overwrite"])
    return path


def ensure_genai(cache: Path, precisions: list[str]) -> tuple[Path, dict[str, Path]]:
    """The venv's python and genai's model folders, made on first use."""
    venv = cache / "genai-venv"
    python = venv / "bin" / "python"
    check = [python, "-c", "import onnxruntime_genai"]
    if not (python.exists() and subprocess.run(check, capture_output=True).returncode == 0):
        run([sys.executable, "-m", "venv", "--clear", venv])
        run([python, "-m", "pip", "install", "-q", *GENAI_PACKAGES], log_file=cache / "genai-venv.log")
    hf_folder = cache / "hf-smollm2-135m"
    folders = {}
    for precision in precisions:
        folders[precision] = out = cache / f"genai-{precision}"
        if not (out / "genai_config.json").is_file():
            if not (hf_folder / "tokenizer.json").is_file():
                save_hf_folder(hf_folder)
            run([python, "-m", "onnxruntime_genai.models.builder", "-i", hf_folder, "-o", out, "-p", precision,
                 "-e", "cpu", "-c", cache / "genai-build-tmp"], log_file=cache / f"genai-build-{precision}.log",
                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (cache / "genai_worker.py").write_text(GENAI_WORKER)
    return python, folders


def command(engine: str, cache: Path, job_file: Path, genai: tuple | None) -> list[str]:
    kind, precision = engine.split("-")
    if kind == "genai":
        python, folders = genai
        return [str(python), str(cache / "genai_worker.py"), str(folders[precision]), job_file.read_text()]
    spec = "transformers" if kind == "transformers" else str(cache / f"smollm2-135m-none-{precision}")
    return [sys.executable, __file__, "--worker", spec, "--job", str(job_file)]


def run_engine(cmd: list[str]) -> dict:
    """One run in a fresh process; its result, plus the share of the CPU other processes used meanwhile."""
    busy, own, wall = _busy_seconds(), _children_seconds(), time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"an engine's run failed (exit {done.returncode}); its error is above: {' '.join(cmd[:3])} ...")
    others = max(0.0, (_busy_seconds() - busy) - (_children_seconds() - own))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["other_cpu"] = others / ((time.monotonic() - wall) * os.cpu_count())
    return result


# -- report ----------------------------------------------------------------------------------------
def run_figures(result: dict) -> dict:
    rows = result["rows"]
    seconds = sum(r["seconds"] for r in rows)
    out = {"tokens_per_s": sum(r["new_tokens"] for r in rows) / seconds}
    if all(r["ttft_s"] is not None for r in rows):
        out["decode_ms_per_token"] = 1000 * sum(r["seconds"] - r["ttft_s"] for r in rows) / sum(
            r["new_tokens"] - 1 for r in rows)
        out["ttft_ms"] = 1000 * statistics.mean(r["ttft_s"] for r in rows)
    for t, ms in (result.get("step_ms") or {}).items():
        out[f"step_ms_t{t}"] = ms
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(runs: dict[str, list[dict]], reference: list[list[int]], eos: set[int], new_tokens: int) -> tuple[list, dict]:
    figures = {e: [run_figures(r) for r in rs] for e, rs in runs.items()}
    summary = {e: {k: spread([f[k] for f in fs]) for k in fs[0]} for e, fs in figures.items()}
    rounds = len(next(iter(runs.values())))
    ends = [next((i for i, t in enumerate(ref) if t in eos), len(ref)) for ref in reference]
    lines = [f"SmolLM2-135M-Instruct, greedy, batch 1, {new_tokens} new tokens x {len(reference)} prompts, "
             f"{len(os.sched_getaffinity(0))} CPU threads; each engine in a process of its own, {rounds} alternating "
             "rounds: median (min-max)",
             f"{'engine':<19}{'tokens/s':>22}{'decode ms/token':>20}{'T=1 step ms':>20}{'TTFT ms':>9}{'other CPU':>10}"
             "   same tokens as ours fp32 (before EOS)"]

    def cell(s: dict | None, width: int, digits: int) -> str:
        if s is None:
            return f"{'-':>{width}}"
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})".rjust(width)

    for engine, s in summary.items():
        first = runs[engine][0]["rows"]
        same = sum(r["tokens"][:n] == ref[:n] for r, ref, n in zip(first, reference, ends))
        ttft = f"{s['ttft_ms']['median']:.0f}" if "ttft_ms" in s else "-"
        other = max(r["other_cpu"] for r in runs[engine])
        lines.append(f"{engine:<19}{cell(s['tokens_per_s'], 22, 1)}{cell(s.get('decode_ms_per_token'), 20, 2)}"
                     f"{cell(s.get('step_ms_t1'), 20, 2)}{ttft:>9}{other:>10.0%}   {same}/{len(reference)}")
    ratios, checks = {}, []
    for label, num, den, target in TARGETS:
        if num in summary and den in summary:
            ratios[label] = summary[num]["tokens_per_s"]["median"] / summary[den]["tokens_per_s"]["median"]
            per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(figures[num], figures[den])]
            checks.append((label + " tokens/s", ratios[label], f">= {target}", ratios[label] >= target,
                           f"rounds {min(per_round):.2f}-{max(per_round):.2f}"))
    for ours, theirs in STEP_TARGETS:
        if ours in summary and theirs in summary:
            label = f"{ours} / {theirs} T=1 step"
            ratios[label] = summary[ours]["step_ms_t1"]["median"] / summary[theirs]["step_ms_t1"]["median"]
            checks.append((label, ratios[label], "<= 1.0", ratios[label] <= 1.0, ""))
    lines += ["", f"{'ratio (of the medians)':<40}{'value':>7}   target"]
    lines += [f"{lab:<40}{v:>7.3f}   {tgt:<8}{'ok' if ok else 'MISSED':<8}{note}" for lab, v, tgt, ok, note in checks]
    lines += ["", f"ms per forward of T new tokens (logits of all T rows) at {CONTEXT} tokens of context, median over "
                  f"rounds of each run's median of {REPEATS}", f"{'T':<19}" + "".join(f"{t:>8}" for t in STEP_T)]
    for engine, s in summary.items():
        if "step_ms_t1" in s:
            lines.append(f"{engine:<19}" + "".join(f"{s[f'step_ms_t{t}']['median']:>8.2f}" for t in STEP_T))
    agreement = [(e, rs[0]["agreement"]) for e, rs in runs.items() if rs[0].get("agreement") and e != "ours-fp32"]
    if agreement:
        lines += ["", "top-1 agreement with fp32 (from the bundle manifest: teacher-forced on fp32's own continuations)"]
    for engine, a in agreement:  # top1_agreement[_t1, _t8, ...]: per step size
        scores = ", ".join(f"{v:.1%}" + (f" in steps of T={k[16:]}" if k[15:16] == "t" else "")
                           for k, v in a.items() if k.startswith("top1_agreement"))
        lines.append(f"{engine:<19}{scores} over {a.get('positions')} positions")
    return lines, {"ratios": {k: round(v, 3) for k, v in ratios.items()}, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("bench-cache"), help="bundles, genai venv and graphs")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (every engine once per round)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"a comma-separated subset of {','.join(ENGINES)}")
    ap.add_argument("--rebuild", action="store_true", help="rebuild our bundles (after the exporter changed)")
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for a quiet CPU before timing")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.job)
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        sys.exit(f"unknown engines {unknown or args.engines!r}; choose from {', '.join(ENGINES)}")
    if "ours-fp32" not in engines:
        engines.insert(0, "ours-fp32")  # the reference for "same tokens"
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)

    from specexport.runtime.tokenizer import Tokenizer

    for e in engines:
        if e.startswith("ours-"):
            ensure_bundle(cache, e.split("-")[1], args.rebuild)
    tokenizer = Tokenizer.from_dir(cache / "smollm2-135m-none-fp32")
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    context = ([t for ids in prompts for t in ids] * CONTEXT)[:CONTEXT]
    genai_precisions = [e.split("-")[1] for e in engines if e.startswith("genai-")]
    genai = ensure_genai(cache, genai_precisions) if genai_precisions else None
    job_file = cache / "bench_plain_job.json"
    job_file.write_text(json.dumps({"prompts": prompts, "new_tokens": args.new_tokens, "context": context,
                                    "step_t": list(STEP_T), "context_tokens": CONTEXT, "repeats": REPEATS}))

    wait_for_quiet(args.max_wait)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for engine in order:
            log(f"round {r + 1}/{args.rounds}: {engine}")
            runs[engine].append(run_engine(command(engine, cache, job_file, genai)))
    for rs in runs.values():  # JSON keys: T as text in the workers' replies
        for result in rs:
            result["step_ms"] = {int(t): ms for t, ms in (result.get("step_ms") or {}).items()}
    reference = [row["tokens"] for row in runs["ours-fp32"][0]["rows"]]
    lines, figures = report(runs, reference, set(tokenizer.eos_token_ids), args.new_tokens)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "prompts": PROMPTS[:args.prompts],
                                         "prompt_ids": prompts, "context_tokens": CONTEXT, "rounds": args.rounds,
                                         **figures, "runs": runs, "table": lines}, indent=1))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
