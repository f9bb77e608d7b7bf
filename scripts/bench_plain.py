#!/usr/bin/env python
"""Plain greedy decoding of SmolLM2-135M, side by side in one run: our bundles (fp32, int8, int4),
onnxruntime-genai (fp32, int4) and transformers `generate` (fp32).

Batch 1, the same prompt token ids for everyone, exactly N new tokens each (EOS stops no one);
tokens/s = new tokens / wall time, prefill included. The engines alternate: every engine is loaded once and
stays loaded, and each prompt (then each T of the forward timings) goes to all of them in turn, the first one rotating,
so machine noise hits them alike. Also ms per target forward of T new tokens at
256 tokens of context (the cost of verifying T draft tokens), and the quantized bundles' top-1
agreement with fp32 from their manifests. "other CPU" is the share of the machine that other
processes used while an engine was timed: above ~5% its numbers are not to be trusted.

onnxruntime-genai is not a dependency of specexport: it lives in its own venv (CACHE/genai-venv),
made on first use, and runs through that venv's python in one long-lived worker process per precision.

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
    ("ours fp32 / genai fp32", "ours fp32", "genai fp32", 1.0),
    ("ours int4 / genai int4", "ours int4", "genai int4", 0.95),
    ("ours int8 / genai int4", "ours int8", "genai int4", 0.75),
    ("ours fp32 / transformers", "ours fp32", "transformers fp32", 2.0),
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
WORKERS: list[subprocess.Popen] = []  # genai worker processes: their CPU is ours, not "other"


def _own_cpu() -> float:
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    for proc in WORKERS:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state is fields[0], utime fields[11]
            own += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own


def _cpu_snapshot() -> tuple[float, float, float]:
    """(all processes' busy CPU seconds, this process's + its workers' CPU seconds, wall clock)."""
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    return busy, _own_cpu(), time.monotonic()


def others_seconds(start: tuple) -> tuple[float, float]:
    """(CPU seconds other processes used since `start`, wall seconds since `start`)."""
    end = _cpu_snapshot()
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1])), end[2] - start[2]


def others_share(start: tuple) -> float:
    """Fraction of the machine's CPU that other processes used since `start` (0 = quiet)."""
    others, wall = others_seconds(start)
    return others / (wall * os.cpu_count())


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


# -- the engines: each loaded once; generate(ids, n) -> row, step(t) -> seconds of one forward ------
def ensure_bundle(cache: Path, precision: str, rebuild: bool) -> Path:
    path = cache / f"smollm2-135m-none-{precision}"
    if rebuild or not (path / "manifest.json").is_file():
        run([sys.executable, "-c", "from specexport.cli import main; main()", "build", "--model", "smollm2-135m",
             "--method", "none", "--precision", precision, "--output", path, "--overwrite"])
    return path


class Ours:
    def __init__(self, eng, context: list[int]):
        from specexport.runtime import tree

        self.engine, self.tree = eng, tree
        eng.generate(context[:16], max_new_tokens=8, stop_ids=())  # warm-up
        self.cache = eng.target.new_cache(CONTEXT + max(STEP_T))
        eng.prefill(self.cache, context)  # cache.length = CONTEXT; the timed forwards below never advance it
        self.rng = np.random.default_rng(0)
        self.agreement = (eng.bundle.manifest.get("numerics") or {}).get("agreement")

    def generate(self, ids: list[int], n: int) -> dict:
        g = self.engine.generate(ids, max_new_tokens=n, stop_ids=())
        return {"new_tokens": g.stats.new_tokens, "seconds": g.stats.seconds, "ttft_s": g.stats.ttft_s,
                "tokens": g.tokens}

    def step(self, t: int) -> float:  # a chain of t new tokens, logits for every row (as verifying t drafts needs)
        ids, pos = self.rng.integers(3, 49152, size=(1, t)), CONTEXT + np.arange(t)[None]
        start = time.perf_counter()
        self.engine.target.forward(self.cache, ids, pos, self.tree.causal_mask(t), np.arange(t))
        return time.perf_counter() - start


class Transformers:
    def __init__(self, model, pad: int):
        import torch

        self.torch, self.model, self.pad = torch, model, pad
        self.threads = torch.get_num_threads()
        self.generate([1, 2, 3], 4)  # warm-up

    def generate(self, ids: list[int], n: int) -> dict:
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(self.torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=self.pad)
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        return {"new_tokens": len(tokens), "seconds": seconds, "ttft_s": None, "tokens": tokens}


def save_hf_folder(model, tokenizer, folder: Path) -> None:
    """The GGUF-loaded model as a plain fp32 HF folder (its weights are already dequantized)."""
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# onnxruntime-genai in its own venv: one worker process per model, answering JSON lines on stdin/stdout
GENAI_WORKER = r"""
import json, os, sys, time
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

folder, context, capacity = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(str(folder))
generate(model, context[:16], 8)  # warm-up
try:
    call, step_error = session_call(folder, capacity), None
    call(context, 0)
except Exception as e:  # reported in the table; tokens/s are still measured
    call, step_error = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
rng = np.random.default_rng(0)
versions = {"onnxruntime_genai": getattr(og, "__version__", None), "onnxruntime": ort.__version__}
print(json.dumps({"versions": versions, "step_error": step_error}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if job["op"] == "generate":
        reply = generate(model, job["ids"], job["n"])
    else:
        ids = rng.integers(3, 49152, size=job["t"]).tolist()
        start = time.perf_counter()
        call(ids, len(context))
        reply = {"seconds": time.perf_counter() - start}
    print(json.dumps(reply), flush=True)
"""


class Genai:
    def __init__(self, python: Path, folder: Path, context: list[int], worker: Path):
        self.proc = subprocess.Popen([str(python), str(worker), str(folder), json.dumps(context),
                                      str(CONTEXT + max(STEP_T))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        WORKERS.append(self.proc)
        hello = self._read()
        self.versions, self.step_error = hello["versions"], hello["step_error"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the onnxruntime-genai worker stopped (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def _ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, ids: list[int], n: int) -> dict:
        return self._ask({"op": "generate", "ids": ids, "n": n})

    def step(self, t: int) -> float:
        return self._ask({"op": "step", "t": t})["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


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


# -- the timed runs: every prompt, then every forward, goes to all engines in turn -----------------
class Tally:
    """Rows, step times and other processes' CPU use, per engine."""

    def __init__(self, names: list[str]):
        self.rows = {n: [] for n in names}
        self.steps = {n: {t: [] for t in STEP_T} for n in names}
        self.others = {n: [0.0, 0.0] for n in names}  # other processes' CPU seconds, wall seconds

    def timed(self, name: str, call):
        start = _cpu_snapshot()
        out = call()
        others, wall = others_seconds(start)
        self.others[name][0] += others
        self.others[name][1] += wall
        return out

    def other_cpu(self, name: str) -> float:
        others, wall = self.others[name]
        return round(others / (wall * os.cpu_count()), 3) if wall else 0.0


def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def run_alternating(engines: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    names = list(engines)
    tally = Tally(names)
    for i, ids in enumerate(prompts):
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(rotated(names, i)))
        for name in rotated(names, i):
            tally.rows[name].append(tally.timed(name, lambda: engines[name].generate(ids, new_tokens)))
    stepping = [n for n in names if getattr(engines[n], "step", None) and not getattr(engines[n], "step_error", None)]
    log("forwards of T new tokens: " + ", ".join(stepping))
    for i, t in enumerate(STEP_T):  # engines in turn per T: a forward takes ~10 ms, and switching engine at every
        for name in rotated(stepping, i):  # forward would time the previous engine's thread pool spinning down
            for k in range(2 + REPEATS):
                seconds = tally.timed(name, lambda: engines[name].step(t))
                if k >= 2:  # 2 warm-ups
                    tally.steps[name][t].append(seconds)
    results = {}
    for name in names:
        engine = engines[name]
        r = results[name] = {"rows": tally.rows[name], "other_cpu": tally.other_cpu(name)}
        if name in stepping:
            r["step_ms"] = {t: round(1000 * statistics.median(v), 2) for t, v in tally.steps[name].items()}
        elif getattr(engine, "step_error", None):
            r["step_ms"] = {"error": engine.step_error}
        for attr in ("agreement", "versions", "threads"):
            if getattr(engine, attr, None):
                r[attr] = getattr(engine, attr)
    return results


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
             f"{len(os.sched_getaffinity(0))} CPU threads; engines alternate prompt by prompt, then T by T",
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
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for a quiet CPU before timing")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    hf_folder = cache / "hf-smollm2-135m"

    from specexport.exporter.sources import load_model, resolve
    from specexport.runtime.generate import Engine

    bundles = {p: ensure_bundle(cache, p, args.rebuild) for p in OURS}
    loaded = {p: Engine.load(bundles[p]) for p in OURS}
    prompts = [loaded["fp32"].encode(p) for p in PROMPTS[:args.prompts]]
    context = ([t for ids in prompts for t in ids] * CONTEXT)[:CONTEXT]
    eos = loaded["fp32"].tokenizer.eos_token_ids

    log("loading every engine")
    engines = {f"ours {p}": Ours(loaded[p], context) for p in OURS}
    model, tokenizer = load_model(resolve("smollm2-135m"))
    if not args.skip_genai and not (hf_folder / "tokenizer.json").is_file():
        save_hf_folder(model, tokenizer, hf_folder)
    if not args.skip_genai:
        python, folders = ensure_genai(cache, hf_folder)
        worker = cache / "genai_worker.py"
        worker.write_text(GENAI_WORKER)
        for p in GENAI:
            engines[f"genai {p}"] = Genai(python, folders[p], context, worker)
    engines["transformers fp32"] = Transformers(model, min(eos))

    wait_for_quiet(args.max_wait)
    try:
        results = run_alternating(engines, prompts, args.new_tokens)
    finally:
        for engine in engines.values():
            if isinstance(engine, Genai):
                engine.close()
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
