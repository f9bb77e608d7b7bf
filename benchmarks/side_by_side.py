#!/usr/bin/env python
"""Bundles side by side, interleaved prompt by prompt (alternating the order), each with its own method: greedy,
128 new tokens, tokens/s and tau (what a profile's [speed] table records), and what a step costs: ms per decoding step
(prefill left out) and of that, ms in the draft graphs (the drafting cost); and on how many prompts each bundle's
greedy tokens equal the first bundle's (a plain bundle first: speculation must not change them). The drafting
governor decides each step's tree unless `--whole`. Figures from one run, so that the load of the
machine falls on every bundle alike.

    python benchmarks/side_by_side.py PROMPTS.jsonl COUNT BUNDLE [BUNDLE ...] [--whole] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specexport.runtime.bench import encode_prompts, read_prompts
from specexport.runtime.generate import Engine

from common import drafting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts")
    ap.add_argument("count", type=int, help="prompts taken, evenly spaced over the file")
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--whole", action="store_true",
                    help="verify every tree whole (the drafting governor off): the method's own tau and cost")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = read_prompts(args.prompts)
    prompts = prompts[::max(1, len(prompts) // args.count)][:args.count]
    engines = {b: Engine.load(b) for b in args.bundles}
    ids = encode_prompts(engines[args.bundles[0]], prompts)
    for engine in engines.values():
        engine.generate(ids[0], max_new_tokens=8)  # warm-up
    totals = {b: [0, 0.0, [], 0, 0.0, 0.0] for b in args.bundles}
    outputs = {b: [] for b in args.bundles}
    for k, prompt_ids in enumerate(ids):
        for b in args.bundles if k % 2 == 0 else args.bundles[::-1]:
            engine = engines[b]
            draft_s = drafting(engine)
            r = engine.generate(prompt_ids, max_new_tokens=args.max_new_tokens, budget=not args.whole)
            outputs[b].append(r.tokens)
            totals[b][3] += r.stats.steps
            totals[b][4] += r.stats.seconds - r.stats.ttft_s
            totals[b][5] += drafting(engine) - draft_s
            totals[b][0] += r.stats.new_tokens
            totals[b][1] += r.stats.seconds
            totals[b][2] += r.stats.accept_lengths
    out = {}
    for b, (tokens, seconds, lengths, steps, decode_s, draft_s) in totals.items():
        out[b] = {"method": engines[b].bundle.method, "precision": engines[b].bundle.manifest["precision"],
                  "tokens_per_s": round(tokens / seconds, 2), "tau": round(float(np.mean(lengths)), 3),
                  "step_ms": round(1e3 * decode_s / max(steps, 1), 2),
                  "draft_ms_per_step": round(1e3 * draft_s / max(steps, 1), 2),
                  "same_as_first": sum(x == y for x, y in zip(outputs[b], outputs[args.bundles[0]]))}
        print(f"{b:40s} {out[b]['method']:>7} {out[b]['precision']:>5} {tokens / seconds:7.1f} tokens/s  "
              f"tau {out[b]['tau']:.3f}  {out[b]['step_ms']:6.2f} ms/step  "
              f"of which drafting {out[b]['draft_ms_per_step']:6.2f}  same tokens as the first: "
              f"{out[b]['same_as_first']}/{len(ids)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
