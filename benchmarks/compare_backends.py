#!/usr/bin/env python
"""Two devices of the runtime on the same bundles, alternating prompt by prompt: the host backend ("cpu", numpy
buffers) against ONNX Runtime's device-resident I/O binding path run on the CPU ("cpu-iobinding"). Greedy, exactly
N new tokens (EOS stops no one). Per bundle: prompts whose tokens are identical, tokens/s, and the time per target
step spent outside ONNX Runtime's calls (Python, binding, mask, reading outputs, the proposer's own Python), with
the time inside them.

    python benchmarks/compare_backends.py BUNDLE [BUNDLE ...] --prompts benchmarks/prompts/sharegpt40.jsonl
        [--new-tokens 128]
                                       [--skip N] [--limit N] [--devices cpu,cpu-iobinding] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import onnxruntime as ort

from specexport.runtime.bench import read_prompts
from specexport.runtime.generate import Engine

INSIDE = [0.0]  # seconds inside every ONNX Runtime call of this process


def timed(method):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            INSIDE[0] += time.perf_counter() - start
    return call


ort.InferenceSession.run_with_iobinding = timed(ort.InferenceSession.run_with_iobinding)
ort.InferenceSession.run = timed(ort.InferenceSession.run)


def compare(bundle: str, prompts: list[str], devices: list[str], new_tokens: int) -> dict:
    engines = {d: Engine.load(bundle, device=d) for d in devices}
    ids = [engines[devices[0]].encode(p) for p in prompts]
    totals = {d: {"tokens": 0, "steps": 0, "seconds": 0.0, "inside": 0.0} for d in devices}
    outputs = {d: [] for d in devices}
    for engine in engines.values():  # warm up: first-run allocations and thread start are not per-step costs
        engine.generate(ids[0], max_new_tokens=8, stop_ids=())
    for p in ids:
        for d, engine in engines.items():
            before = INSIDE[0]
            r = engine.generate(p, max_new_tokens=new_tokens, stop_ids=())
            t = totals[d]
            t["tokens"] += r.stats.new_tokens
            t["steps"] += r.stats.steps + 1  # the prefill's step included
            t["seconds"] += r.stats.seconds
            t["inside"] += INSIDE[0] - before
            outputs[d].append(r.tokens)
    first = devices[0]
    row = {"bundle": bundle, "method": engines[first].describe(), "prompts": len(ids),
           "identical": {d: sum(a == b for a, b in zip(outputs[first], outputs[d])) for d in devices[1:]}}
    for d, t in totals.items():
        row[d] = {"tokens_per_s": round(t["tokens"] / t["seconds"], 2), "steps": t["steps"],
                  "outside_ms_per_step": round(1000 * (t["seconds"] - t["inside"]) / t["steps"], 3),
                  "inside_ms_per_step": round(1000 * t["inside"] / t["steps"], 3)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N prompts")
    ap.add_argument("--limit", type=int, default=0, help="then the first N prompts only (0: all)")
    ap.add_argument("--devices", default="cpu,cpu-iobinding")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [p["prompt"] for p in read_prompts(args.prompts)]
    prompts = prompts[args.skip:]
    prompts = prompts[:args.limit] if args.limit else prompts
    devices = args.devices.split(",")
    rows = []
    print(f"{'bundle':<28} {'prompts':>7} {'identical':>9}  " + "  ".join(
        f"{d + ' tok/s':>20} {'outside ms/step':>15} {'inside ms/step':>14}" for d in devices))
    for bundle in args.bundles:
        row = compare(bundle, prompts, devices, args.new_tokens)
        rows.append(row)
        same = "/".join(str(v) for v in row["identical"].values())
        print(f"{row['method'][:28]:<28} {row['prompts']:>7} {same:>9}  " + "  ".join(
            f"{row[d]['tokens_per_s']:>20} {row[d]['outside_ms_per_step']:>15} {row[d]['inside_ms_per_step']:>14}"
            for d in devices), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
