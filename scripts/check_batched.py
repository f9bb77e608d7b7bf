#!/usr/bin/env python
"""Does batching change a request's tokens? Each prompt generated alone (`Engine.generate`, what `specexport run`
does), then all of them submitted at once to one batched engine (runtime/scheduler.py, `--max-batch` running
together, the rest queued and joining as others leave), and each request's tokens compared with its run alone.

The batched engine's prefix cache (runtime/prefix.py) copies the prompts' kept beginnings (the template's system
prompt: on the device with `--device cuda`), and the count of prompt tokens it copied is printed.

Greedy requests with EOS suppressed (every request runs its whole --new-tokens); with `--seeded K` the first K
prompts are also sampled (temperature 0.8, top-p 0.95, seed = the prompt's index) alone and again inside the batch of
greedy ones: a seeded request must give the same tokens whatever it is batched with. Prints, per prompts file, how
many requests match and, for those that differ, the index of their first differing token; exits 1 when any differs.
With `--device cuda` (or `cpu-iobinding`: the same code on the CPU) the batched engine runs on ONNX Runtime's device
path, its KV pool on the device, and each request is compared with its run alone on the host.

    python scripts/check_batched.py BUNDLE [--prompts bench/sharegpt40.jsonl ...] [--new-tokens 128]
        [--max-batch 8] [--seeded 4] [--threads N] [--device cpu|cuda|cpu-iobinding]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_batch import prompt_texts  # noqa: E402 - this folder's script

from specexport.runtime.backends import DEVICES  # noqa: E402
from specexport.runtime.generate import Engine  # noqa: E402
from specexport.runtime.sampling import SamplingParams  # noqa: E402
from specexport.runtime.scheduler import Scheduler  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompts", type=Path, action="append", default=None,
                    help="JSON lines with a 'prompt' each (repeatable; default bench/sharegpt40 and humaneval40)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--seeded", type=int, default=0, help="also sample the first K prompts with a seed")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--device", choices=[d for d in DEVICES if d != "auto"], default="cpu",
                    help="the batched engine's device (the runs alone: the host's)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    files = args.prompts or [root / "bench" / "sharegpt40.jsonl", root / "bench" / "humaneval40.jsonl"]
    texts = {path: prompt_texts(path) for path in files}  # every file checked before the engines load
    engine = Engine.load(args.bundle, threads=args.threads, device="cpu")
    batching = engine if args.device == "cpu" else Engine.load(args.bundle, threads=args.threads, device=args.device)
    print(f"{args.bundle.name}: {engine.describe()}, {engine.bundle.precision}; {args.new_tokens} new tokens, "
          f"max_batch {args.max_batch} on {args.device}, greedy with EOS suppressed"
          + (f", {args.seeded} seeded" if args.seeded else ""))
    failed = False
    for path in files:
        prompts = texts[path]
        jobs = [(p, None) for p in prompts]
        jobs += [(p, SamplingParams(temperature=0.8, top_p=0.95, seed=k)) for k, p in enumerate(prompts[:args.seeded])]
        alone = [engine.generate(p, max_new_tokens=args.new_tokens, sampling=s, stop_ids=()).tokens for p, s in jobs]
        scheduler = Scheduler(batching, max_batch=args.max_batch)
        store = batching.prefixes
        queries, hits = store.queries, store.hits
        try:
            requests = [scheduler.submit(p, max_new_tokens=args.new_tokens, sampling=s, stop_ids=()) for p, s in jobs]
            batched = [r.result(timeout=3600).tokens for r in requests]
        finally:
            scheduler.close()
        for kind, rows in (("greedy", range(len(prompts))), ("seeded", range(len(prompts), len(jobs)))):
            if not rows:
                continue
            firsts = [first_difference(alone[k], batched[k]) for k in rows]
            same = sum(f is None for f in firsts)
            failed |= same < len(rows)
            differing = {k: f for k, f in zip(rows, firsts) if f is not None}
            print(f"  {path.name} {kind}: batched == alone on {same}/{len(rows)}"
                  + (f"; first differing token by request: {differing}" if differing else "")
                  + (f" ({scheduler.steps} batched calls, {scheduler.rows / max(scheduler.steps, 1):.1f} rows per call; "
                     f"{store.hits - hits} of {store.queries - queries} prompt tokens copied from kept beginnings)"
                     if kind == "greedy" else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
