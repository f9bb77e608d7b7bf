#!/usr/bin/env python
"""Plain greedy decoding of SmolLM2-135M, side by side in one run: our bundles (fp32, int8, int4),
onnxruntime-genai (fp32, int4) and transformers `generate` (fp32).

Batch 1, the same prompt token ids for everyone, exactly N new tokens each (EOS stops no one);
tokens/s = new tokens / wall time, prefill included. Also ms per target forward of T new tokens at
256 tokens of context (the cost of verifying T draft tokens), and the quantized bundles' top-1
agreement with fp32 from their manifests. "other CPU" is the share of the machine that other
processes used while an engine was timed: above ~5% its numbers are not to be trusted.

onnxruntime-genai is not a dependency of specexport: it lives in its own venv (CACHE/genai-venv),
made on first use, and runs through that venv's python in a subprocess.

    python scripts/bench_plain.py [--cache bench-cache] [--new-tokens 128] [--prompts 6] [--skip-genai]
                                  [--rebuild] [--max-wait 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
    "What are three good tips for learning a new language as an adult?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "List the planets of the solar system in order, with one fact about each.",
]
OURS, GENAI = ("fp32", "int8", "int4"), ("fp32", "int4")
STEP_T = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 256  # tokens of context for the step-time table
REPEATS = 7  # timed forwards per T (median), after 2 warm-ups
GENAI_PACKAGES = ["onnxruntime-genai", "torch==2.13.0", "transformers", "onnx", "onnx-ir", "onnxscript", "numpy"]
# (label, numerator, denominator, target): tokens/s ratios the project aims for, all "at least"
TARGETS = [
    ("ours fp32 / genai fp32", "ours fp32", "genai fp32", 0.9),
    ("ours fp32 / transformers", "ours fp32", "transformers fp32", 2.0),
    ("ours int8 / genai int4", "ours int8", "genai int4", 0.75),
    ("ours int4 / genai int4", "ours int4", "genai int4", 0.9),
]
STEP_TARGET = ("ours int8", 8, 1.5)  # step(T=8) / step(T=1) at most this


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(cmd: list, log_file: Path | None = None, **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd) + (f"  (output: {log_file})" if log_file else ""))
    with open(log_file, "w") if log_file else contextlib.nullcontext(sys.stderr) as out:  # stdout: the table
        done = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT if log_file else None, **kw)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {cmd[0]} ... {'see ' + str(log_file) if log_file else ''}")


# -- a shared 2-core machine: measure, and wait out, other processes' CPU use ----------------------
def _cpu_snapshot() -> tuple[float, float, float]:
    """(all processes' busy CPU seconds, this process's + waited children's CPU seconds, wall clock)."""
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def others_share(start: tuple) -> float:
    """Fraction of the machine's CPU that other processes used since `start` (0 = quiet)."""
    end = _cpu_snapshot()
    others = (end[0] - start[0]) - (end[1] - start[1])
    return max(0.0, others / ((end[2] - start[2]) * os.cpu_count()))


def wait_for_quiet(max_wait: float, threshold: float = 0.05) -> None:
    deadline = time.monotonic() + max_wait
    while True:
        start = _cpu_snapshot()
        time.sleep(2)
        share = others_share(start)
        if share < threshold or time.monotonic() > deadline:
            if share >= threshold:
                log(f"other processes still use {share:.0%} of the CPU; timing anyway")
            return
        log(f"waiting for a quiet machine (other processes use {share:.0%} of the CPU)")
        time.sleep(8)


def step_ms(forward) -> dict[int, float]:
    """Median ms of `forward(t)` for each T (2 warm-ups, REPEATS timed calls)."""
    table = {}
    for t in STEP_T:
        times = []
        for k in range(2 + REPEATS):
            start = time.perf_counter()
            forward(t)
            times.append(time.perf_counter() - start)
        table[t] = round(1000 * statistics.median(times[2:]), 2)
    return table


# -- ours ------------------------------------------------------------------------------------------
def ensure_bundle(cache: Path, precision: str, rebuild: bool) -> Path:
    path = cache / f"smollm2-135m-none-{precision}"
    if rebuild or not (path / "manifest.json").is_file():
        run([sys.executable, "-c", "from specexport.cli import main; main()", "build", "--model", "smollm2-135m",
             "--method", "none", "--precision", precision, "--output", path, "--overwrite"])
    return path


def bench_ours(bundle: Path, prompts: list[list[int]], new_tokens: int, context: list[int]) -> dict:
    from specexport.runtime import tree
    from specexport.runtime.generate import Engine

    eng = Engine.load(bundle)
    eng.generate(prompts[0], max_new_tokens=8, stop_ids=())  # warm-up
    rows = []
    for ids in prompts:
        g = eng.generate(ids, max_new_tokens=new_tokens, stop_ids=())
        rows.append({"new_tokens": g.stats.new_tokens, "seconds": g.stats.seconds, "ttft_s": g.stats.ttft_s,
                     "tokens": g.tokens})
    target = eng.target
    cache = target.new_cache(CONTEXT + max(STEP_T))
    eng.prefill(cache, context)  # cache.length = CONTEXT; the timed forwards below never advance it
    rng = np.random.default_rng(0)

    def forward(t):  # a chain of t new tokens, logits for every row (as verifying t draft tokens needs)
        target.forward(cache, rng.integers(3, 49152, size=(1, t)), CONTEXT + np.arange(t)[None], tree.causal_mask(t),
                       np.arange(t))

    return {"rows": rows, "step_ms": step_ms(forward),
            "agreement": (eng.bundle.manifest.get("numerics") or {}).get("agreement")}


# -- transformers ----------------------------------------------------------------------------------
def bench_transformers(model, prompts: list[list[int]], new_tokens: int, pad: int) -> dict:
    import torch

    rows = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
        for ids in prompts:
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=pad)
            tokens = out[0, len(ids):].tolist()
            rows.append({"new_tokens": len(tokens), "seconds": time.perf_counter() - start, "ttft_s": None,
                         "tokens": tokens})
    return {"rows": rows, "torch_threads": torch.get_num_threads()}


def save_hf_folder(model, tokenizer, folder: Path) -> None:
    """The GGUF-loaded model as a plain fp32 HF folder (its weights are already dequantized)."""
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# -- onnxruntime-genai (its own venv, one subprocess per model) ------------------------------------
GENAI_WORKER = r'''
import json, os, statistics, sys, time
from pathlib import Path
import numpy as np, onnxruntime as ort, onnxruntime_genai as og

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

def session_call(folder, capacity):
    """Raw onnxruntime on genai's graph, each layer's KV buffer bound as both past and present (GQA shares it)."""
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

def step_ms(folder, context, t_values, repeats):
    call, rng, table = session_call(folder, len(context) + max(t_values)), np.random.default_rng(0), {}
    call(context, 0)
    for t in t_values:
        times = []
        for k in range(2 + repeats):
            ids = rng.integers(3, 49152, size=t).tolist()
            start = time.perf_counter()
            call(ids, len(context))
            times.append(time.perf_counter() - start)
        table[t] = round(1000 * statistics.median(times[2:]), 2)
    return table

job = json.loads(Path(sys.argv[1]).read_text())
model = og.Model(job["folder"])
generate(model, job["prompts"][0], 8)  # warm-up
rows = [generate(model, ids, job["new_tokens"]) for ids in job["prompts"]]
del model
try:
    table = step_ms(Path(job["folder"]), job["context"], job["step_t"], job["repeats"])
except Exception as e:  # report it in the table, keep the tokens/s
    table = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
versions = {"onnxruntime_genai": getattr(og, "__version__", None), "onnxruntime": ort.__version__}
Path(sys.argv[2]).write_text(json.dumps({"rows": rows, "step_ms": table, "versions": versions}))
'''


def ensure_genai(cache: Path, hf_folder: Path) -> tuple[Path, dict[str, Path]]:
    """The venv's python and genai's model folders, made on first use from the saved HF folder."""
    venv = cache / "genai-venv"
    python = venv / "bin" / "python"
    check = [python, "-c", "import onnxruntime_genai"]
    if not (python.exists() and subprocess.run(check, capture_output=True).returncode == 0):
        run([sys.executable, "-m", "venv", "--clear", venv])
        run([python, "-m", "pip", "install", "-q", *GENAI_PACKAGES], log_file=cache / "genai-venv.log")
    folders = {}
    for precision in GENAI:
        folders[precision] = out = cache / f"genai-{precision}"
        if not (out / "genai_config.json").is_file():
            run([python, "-m", "onnxruntime_genai.models.builder", "-i", hf_folder, "-o", out, "-p", precision,
                 "-e", "cpu", "-c", cache / "genai-build-tmp"], log_file=cache / f"genai-build-{precision}.log",
                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return python, folders


def bench_genai(python: Path, folder: Path, prompts, new_tokens: int, context: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        worker, job, result = Path(tmp, "worker.py"), Path(tmp, "job.json"), Path(tmp, "out.json")
        worker.write_text(GENAI_WORKER)
        job.write_text(json.dumps({"folder": str(folder), "prompts": prompts, "new_tokens": new_tokens,
                                   "context": context, "step_t": list(STEP_T), "repeats": REPEATS}))
        run([python, worker, job, result])
        r = json.loads(result.read_text())
    if "error" not in r["step_ms"]:
        r["step_ms"] = {int(t): ms for t, ms in r["step_ms"].items()}  # JSON keys are strings
    return r


# -- report ----------------------------------------------------------------------------------------
def summarize(result: dict, reference: list[list[int]], eos: set[int]) -> None:
    """Adds tokens/s, mean TTFT and how many outputs equal ours fp32's before its first EOS (genai and
    transformers are made to suppress EOS for N tokens; ours emits it and goes on)."""
    rows = result["rows"]
    result["tokens_per_s"] = round(sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows), 2)
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    result["ttft_ms"] = round(1000 * statistics.mean(ttfts), 1) if ttfts else None
    ends = [next((i for i, t in enumerate(ref) if t in eos), len(ref)) for ref in reference]
    result["same_as_ours_fp32"] = sum(r["tokens"][:n] == ref[:n] for r, ref, n in zip(rows, reference, ends))


def report(results: dict, new_tokens: int) -> tuple[list[str], dict]:
    n = len(results["ours fp32"]["rows"])
    lines = [f"SmolLM2-135M-Instruct, greedy, batch 1, {new_tokens} new tokens x {n} prompts, "
             f"{len(os.sched_getaffinity(0))} CPU threads",
             f"{'engine':<19}{'tokens/s':>9}{'TTFT ms':>9}{'other CPU':>11}   same tokens as ours fp32 (before EOS)"]
    for name, r in results.items():
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        same = f"{r['same_as_ours_fp32']}/{n}"
        lines.append(f"{name:<19}{r['tokens_per_s']:>9.1f}{ttft:>9}{r['other_cpu']:>11.0%}   {same}")
    ratios, checks = {}, []
    for label, num, den, target in TARGETS:
        if num in results and den in results:
            ratios[label] = results[num]["tokens_per_s"] / results[den]["tokens_per_s"]
            checks.append((label, ratios[label], f">= {target}", ratios[label] >= target))
    name, t, limit = STEP_TARGET
    label = f"{name} step T={t} / T=1"
    ratios[label] = results[name]["step_ms"][t] / results[name]["step_ms"][1]
    checks.append((label, ratios[label], f"<= {limit}", ratios[label] <= limit))
    lines += ["", f"{'ratio':<32}{'value':>7}   target"]
    lines += [f"{lab:<32}{v:>7.2f}   {tgt:<8}{'ok' if ok else 'MISSED'}" for lab, v, tgt, ok in checks]
    lines += ["", f"ms per forward of T new tokens (logits of all T rows) at {CONTEXT} tokens of context, "
                  f"median of {REPEATS}", f"{'T':<19}" + "".join(f"{t:>8}" for t in STEP_T)]
    for name, r in results.items():
        table = r.get("step_ms")
        if table and "error" in table:
            lines.append(f"{name:<19}  not measured: {table['error']}")
        elif table:
            lines.append(f"{name:<19}" + "".join(f"{table[t]:>8.1f}" for t in STEP_T))
    lines += ["", "top-1 agreement with fp32 (from the bundle manifest: teacher-forced on fp32's own continuations)"]
    for name, r in results.items():
        if (a := r.get("agreement")) and name != "ours fp32":  # top1_agreement[_t1, _t8, ...]: per step size
            scores = ", ".join(f"{v:.1%}" + (f" in steps of T={k[16:]}" if k[15:16] == "t" else "")
                               for k, v in a.items() if k.startswith("top1_agreement"))
            lines.append(f"{name:<19}{scores} over {a.get('positions')} positions")
    return lines, {k: round(v, 3) for k, v in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("bench-cache"), help="bundles, genai venv and graphs")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--rebuild", action="store_true", help="rebuild our bundles (after the exporter changed)")
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for a quiet CPU before each engine")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    hf_folder = cache / "hf-smollm2-135m"

    from specexport.runtime.generate import Engine

    bundles = {p: ensure_bundle(cache, p, args.rebuild) for p in OURS}
    tokenizer_engine = Engine.load(bundles["fp32"])
    prompts = [tokenizer_engine.encode(p) for p in PROMPTS[:args.prompts]]
    context = ([t for ids in prompts for t in ids] * CONTEXT)[:CONTEXT]
    eos = tokenizer_engine.tokenizer.eos_token_ids
    del tokenizer_engine

    def timed(name, bench, *a):
        wait_for_quiet(args.max_wait)
        log(f"{name}: generating and timing")
        start = _cpu_snapshot()
        results[name] = bench(*a)
        results[name]["other_cpu"] = round(others_share(start), 3)

    results = {}
    for p in OURS:
        timed(f"ours {p}", bench_ours, bundles[p], prompts, args.new_tokens, context)

    from specexport.exporter.sources import load_model, resolve

    log("transformers: loading the model")
    model, tokenizer = load_model(resolve("smollm2-135m"))
    timed("transformers fp32", bench_transformers, model, prompts, args.new_tokens, min(eos))
    if not args.skip_genai and not (hf_folder / "tokenizer.json").is_file():
        save_hf_folder(model, tokenizer, hf_folder)
    del model

    if not args.skip_genai:
        python, folders = ensure_genai(cache, hf_folder)
        for p in GENAI:
            timed(f"genai {p}", bench_genai, python, folders[p], prompts, args.new_tokens, context)

    order = ["ours fp32", "ours int8", "ours int4", "genai fp32", "genai int4", "transformers fp32"]
    results = {k: results[k] for k in order if k in results}
    reference = [row["tokens"] for row in results["ours fp32"]["rows"]]
    for r in results.values():
        summarize(r, reference, eos)
    lines, ratios = report(results, args.new_tokens)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "prompts": PROMPTS[:args.prompts],
                                         "prompt_ids": prompts, "context_tokens": CONTEXT, "ratios": ratios,
                                         "results": results, "table": lines}, indent=1))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
