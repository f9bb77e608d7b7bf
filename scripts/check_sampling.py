"""Sampling is exact on a real bundle: speculative and plain sampling give the same distribution.

For each temperature, N generations of a few tokens are sampled with the bundle's method and N with
plain decoding (different seeds); the joint of the tokens after the first (those come from
speculative steps) is compared by a two-sample chi-square test at a 1e-4 tail.

    python scripts/check_sampling.py BUNDLE [--n 600] [--tokens 3] [--temperatures 0.7,1.0] [--outside-graph]
                                     [--batched N [--fixed]]

--outside-graph accepts with the runtime's rule on the step's logits instead of inside the graph (the same
random numbers, so the same tokens up to float32 rounding). --batched N samples the speculative side through the
batched engine (runtime/scheduler.py, N sequences per step, the batch's tree budget on, unseeded requests; with
--fixed every tree whole, so that the batched speculative acceptance runs on every step).
"""

from __future__ import annotations

import argparse

from specexport import chisquare
from specexport.runtime.generate import Engine
from specexport.runtime.scheduler import Scheduler

# text to copy, so that prompt lookup and drafts are often right and the speculative path is exercised
PROMPT = ("Repeat this sentence three times: The quick brown fox jumps over the lazy dog while the cat "
          "sleeps in the warm afternoon sun.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--outside-graph", action="store_true", help="accept with the runtime's rule, not in the graph")
    ap.add_argument("--batched", type=int, default=0, help="sample the method through the batched engine, N at once")
    ap.add_argument("--fixed", action="store_true", help="with --batched: every tree as its proposer made it (no tree "
                    "budget, which may cut the trees, or skip drafting where it does not pay)")
    args = ap.parse_args()
    if args.fixed and not args.batched:
        ap.error("--fixed applies to the batched engine: give --batched N too")
    engine = Engine.load(args.bundle, verify=False)
    scheduler = Scheduler(engine, max_batch=args.batched, budget=not args.fixed, background=False) \
        if args.batched else None
    engine.fused_accept &= not args.outside_graph
    print(f"{engine.bundle.manifest['model']['name']} {engine.bundle.precision}, method {engine.bundle.method}, "
          f"{args.n} samples each, tokens 2..{args.tokens}, accepted "
          + (f"by the batched engine ({args.batched} at once{', fixed trees' if args.fixed else ''})" if scheduler else
             f"{'outside' if not engine.fused_accept else 'in'} the graph"))
    failed = False
    for temperature in (float(t) for t in args.temperatures.split(",")):
        spec, lengths = chisquare.sampled_counts(engine, args.prompt, False, args.n, 0, args.tokens, scheduler,
                                                 temperature=temperature)
        plain, _ = chisquare.sampled_counts(engine, args.prompt, True, args.n, 10**6, args.tokens,
                                            temperature=temperature)
        tau = sum(lengths) / max(len(lengths), 1)
        stat, dof = chisquare.two_sample(spec, plain)
        limit = chisquare.threshold(dof) if dof > 0 else float("inf")
        ok = stat < limit
        failed |= not ok
        print(f"  T={temperature}: chi2 {stat:.1f} (dof {dof}, limit {limit:.1f}) {'OK' if ok else 'DIFFERENT'}, "
              f"tau {tau:.2f}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
