#!/usr/bin/env python
"""Suffix lookup offline: replay its drafts against the plain outputs a `specexport bench --json` run recorded, for
several settings, with and without a datastore: accept length (greedy, the runtime's rule), a speedup predicted
from a profile's latency curve, and the lookup's cost. No model runs, so a setting or a datastore is judged in
seconds.

    python benchmarks/suffix_replay.py BENCH.json benchmarks/prompts/sharegpt40.jsonl BUNDLE [--datastore FILE]
        [--profile cpu-2core]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from specexport.profiles import load_profile
from specexport.runtime import datastore as datastores
from specexport.runtime.methods import suffix
from specexport.runtime.tokenizer import Tokenizer
from specexport.tune.measure import replay

SETTINGS = [(4, 1.0, 0.1), (6, 2.0, 0.2), (8, 1.0, 0.1), (8, 2.0, 0.1), (12, 2.0, 0.1), (16, 4.0, 0.05)]


def runs(bench_json: str, prompts_file: str, bundle: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain decoding's output) per prompt."""
    tokenizer = Tokenizer.from_dir(bundle)
    prompts = {str(r.get("id")): r["prompt"] for r in map(json.loads, open(prompts_file)) if r}
    rows = json.load(open(bench_json))["prompts"]
    return [(tokenizer.encode_chat([{"role": "user", "content": prompts[r["id"]]}]), r["baseline_tokens"])
            for r in rows]


def simulate(data, store, total: int, factor: float, min_prob: float, verify_ms) -> dict:
    lookup = suffix.SuffixLookup(suffix.Settings(total_tokens=total, match_factor=factor, min_prob=min_prob), store)
    lengths, step_ms, seconds, drafted = [], [], 0.0, 0
    for prompt, output in data:
        lookup.start(len(prompt), 0)
        i = 1
        while i < len(output):
            start = time.perf_counter()
            draft = lookup.propose(prompt + output[:i])
            seconds += time.perf_counter() - start
            drafted += draft.drafts
            lengths.append(replay(draft.tokens, draft.parents, output[i:]))
            step_ms.append(verify_ms(len(draft.tokens)))
            i += lengths[-1]
    tau = float(np.mean(lengths))
    return {"tau": tau, "speedup": tau * verify_ms(1) / float(np.mean(step_ms)),
            "us_per_draft": 1e6 * seconds / max(drafted, 1), "ms_per_step": 1e3 * seconds / len(lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bench_json")
    parser.add_argument("prompts")
    parser.add_argument("bundle", help="a bundle of the model (for its tokenizer)")
    parser.add_argument("--datastore", default=None)
    parser.add_argument("--profile", default="cpu-2core", help="whose latency curve predicts the speedup")
    args = parser.parse_args()
    m = load_profile(args.profile).measurements
    if not m.tree_tokens:
        raise SystemExit(f"profile {args.profile} has no measured latency curve")
    verify_ms = lambda t: float(np.interp(t, m.tree_tokens, m.verify_ms))  # noqa: E731
    data = runs(args.bench_json, args.prompts, args.bundle)
    stores = {"no datastore": None}
    if args.datastore:
        stores[f"datastore ({args.datastore})"] = datastores.load(args.datastore)
    for (total, factor, min_prob) in SETTINGS:
        for name, store in stores.items():
            r = simulate(data, store, total, factor, min_prob, verify_ms)
            print(f"{total:3d} tokens, factor {factor:g}, min prob {min_prob:g}, {name}: tau {r['tau']:.3f}, predicted "
                  f"speedup {r['speedup']:.3f}x, lookup {r['us_per_draft']:.0f} us per drafted token "
                  f"({r['ms_per_step']:.3f} ms per step)")


if __name__ == "__main__":
    main()
