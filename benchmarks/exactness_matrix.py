#!/usr/bin/env python
"""Is every way of running a bundle plain decoding's, token for token? For each bundle, on each prompt file: greedy
answers alone (whole trees: the drafting governor off), the same again (the prompts' beginnings kept by the prefix
cache, suffix lookup's store holding the first answers), batched at C concurrent requests through the Scheduler
(its governor on), and batched again with prompts fed in small prefill chunks; each counted against plain decoding
alone of PLAIN (method none, the same precision). Prints one line per bundle, prompt file and way, and the first
token where an answer parts.

    python benchmarks/exactness_matrix.py PLAIN BUNDLE [BUNDLE ...] --prompts A.jsonl [B.jsonl]
        [--count 40] [--max-new-tokens 128] [--concurrency 16] [--chunk 7]
"""

from __future__ import annotations

import argparse
import time

from specexport.runtime.bench import encode_prompts, read_prompts
from specexport.runtime.generate import Engine
from specexport.runtime.scheduler import Scheduler


def scheduled(engine, ids, new, c, chunk=None):
    scheduler = Scheduler(engine, max_batch=c, prefill_chunk=chunk, background=False)
    requests = [scheduler.submit(p, max_new_tokens=new, stop_ids=()) for p in ids]
    scheduler.run_until_idle()
    return [r.result(timeout=0).tokens for r in requests]


def parted(got, want) -> str:
    """Where the answers that differ first part: `prompt@token`."""
    out = []
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            out.append(f"{k}@{next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))}")
    return " ".join(out[:8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plain")
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=7)
    args = ap.parse_args()
    plain = Engine.load(args.plain)
    new = args.max_new_tokens
    for path in args.prompts:
        ids = encode_prompts(plain, read_prompts(path)[:args.count])
        want = [plain.generate(p, max_new_tokens=new, stop_ids=()).tokens for p in ids]
        for bundle in args.bundles:
            engine = Engine.load(bundle)
            label = f"{engine.bundle.method} {engine.bundle.manifest['precision']} {path.split('/')[-1]}"
            start = time.perf_counter()
            ways = {}
            for way in ("alone", "cached"):
                ways[way] = [engine.generate(p, max_new_tokens=new, stop_ids=(), budget=False).tokens for p in ids]
            ways[f"batched C={args.concurrency}"] = scheduled(engine, ids, new, args.concurrency)
            ways[f"batched, chunks of {args.chunk}"] = scheduled(engine, ids, new, args.concurrency, args.chunk)
            for way, got in ways.items():
                same = sum(g == w for g, w in zip(got, want))
                print(f"{label:40s} {way:22s} identical {same}/{len(ids)}  {parted(got, want)}", flush=True)
            print(f"{label:40s} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
