#!/usr/bin/env python
"""What exactness costs: bundles paired as BEFORE=AFTER (the same method and precision, built before and after a
change), side by side in one run, greedy: tokens/s at batch 1 (prompt by prompt, alternating the order) and batched
through the Scheduler at C concurrent requests (C requests submitted at once, the pair alternating round by round),
and how many answers are token-identical to plain decoding alone of the AFTER plain bundle (method none) of the same
precision. Suffix lookup's store of earlier responses is off (store_tokens 0): every prompt runs several times here,
and the store would draft the answers it saw.

    python benchmarks/exactness_cost.py PROMPTS.jsonl COUNT OLD_PLAIN=NEW_PLAIN [OLD=NEW ...]
        [--max-new-tokens 64] [--concurrency 1 4 16]
"""

from __future__ import annotations

import argparse
import time

from specexport.runtime.bench import encode_prompts, read_prompts
from specexport.runtime.generate import Engine
from specexport.runtime.scheduler import Scheduler


def batch_one(engine, ids, new):
    start = time.perf_counter()
    out = [engine.generate(p, max_new_tokens=new, stop_ids=()).tokens for p in ids]
    return out, sum(map(len, out)) / (time.perf_counter() - start)


def batched(engine, ids, new, c):
    """Rounds of C requests at once on one scheduler: (tokens, tokens/s)."""
    scheduler = Scheduler(engine, max_batch=c, background=False)
    out, start = [], time.perf_counter()
    for k in range(0, len(ids), c):
        requests = [scheduler.submit(p, max_new_tokens=new, stop_ids=()) for p in ids[k:k + c]]
        scheduler.run_until_idle()
        out += [r.result(timeout=0).tokens for r in requests]
    return out, sum(map(len, out)) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts")
    ap.add_argument("count", type=int)
    ap.add_argument("pairs", nargs="+", help="BEFORE=AFTER bundle folders")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    pairs = [tuple(p.split("=", 1)) for p in args.pairs]
    engines = {b: Engine.load(b) for pair in pairs for b in pair}
    for engine in engines.values():
        if engine.bundle.method in ("suffix", "hybrid"):
            engine.configure(store_tokens=0)
    precision = lambda b: engines[b].bundle.manifest["precision"]  # noqa: E731
    plain = {precision(a): engines[a] for _, a in pairs if engines[a].bundle.method == "none"}
    prompts = read_prompts(args.prompts)
    ids = encode_prompts(next(iter(engines.values())), prompts[::max(1, len(prompts) // args.count)][:args.count])
    wants = {p: [e.generate(x, max_new_tokens=args.max_new_tokens, stop_ids=()).tokens for x in ids]
             for p, e in plain.items()}
    for before, after in pairs:
        want = wants[precision(after)]
        for e in (engines[before], engines[after]):
            e.generate(ids[0], max_new_tokens=8)  # warm-up
        rows = {}
        for c in [None] + args.concurrency:  # None: batch 1 through Engine.generate
            speed, same = {before: 0.0, after: 0.0}, {}
            for rnd in range(2):  # each order once
                for b in ((before, after) if rnd == 0 else (after, before)):
                    tokens, rate = (batch_one(engines[b], ids, args.max_new_tokens) if c is None
                                    else batched(engines[b], ids, args.max_new_tokens, c))
                    speed[b] += rate / 2
                    same[b] = sum(t == w for t, w in zip(tokens, want))
            rows[c] = (speed, same)
        print(f"{engines[after].bundle.method} {engines[after].bundle.manifest['precision']}: {before} -> {after}")
        for c, (speed, same) in rows.items():
            label = "batch 1" if c is None else f"C = {c}"
            print(f"  {label:8s} {speed[before]:7.1f} -> {speed[after]:7.1f} tokens/s  ratio "
                  f"{speed[after] / speed[before]:.3f}   identical to plain alone: {same[before]}/{len(ids)} -> "
                  f"{same[after]}/{len(ids)}")


if __name__ == "__main__":
    main()
