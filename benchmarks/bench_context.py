"""Per-step time vs context length: shows that a decode step does not copy the KV cache.

For each context length the cache is prefilled once, then single-token (and optionally T-token)
steps are timed without advancing the cache. An in-place cache keeps the step time flat apart from
the attention math; for scale, the script also times one copy of the whole live cache, which is what
a graph with concat-style past/present would add to every step.

    python benchmarks/bench_context.py BUNDLE [--contexts 128,256,512,1024,2048] [--tokens 1,8]
"""

from __future__ import annotations

import argparse

import numpy as np

from specexport.runtime import tree
from specexport.runtime.generate import Engine
from specexport.tune.measure import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--contexts", default="128,256,512,1024,2048")
    ap.add_argument("--tokens", default="1,8", help="new tokens per step (T)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    steps = [int(t) for t in args.tokens.split(",")]

    engine = Engine.load(args.bundle, verify=False)
    target = engine.target
    rng = np.random.default_rng(0)
    vocab = engine.bundle.manifest["model"]["vocab"]
    cache = target.new_cache(max(contexts) + max(steps))
    header = "context  " + "  ".join(f"T={t:<2} ms/step" for t in steps) + "   copy of live cache ms"
    print(f"{engine.bundle.manifest['model']['name']} {engine.bundle.precision}")
    print(header)
    for ctx in contexts:
        cache.rewind(0)
        ids = rng.integers(3, vocab, size=ctx).tolist()
        for i in range(0, ctx, 512):
            engine.forward_chain(cache, ids[i:i + 512])
        row = []
        for t in steps:
            x = rng.integers(3, vocab, size=(1, t))
            pos = ctx + np.arange(t)[None]
            row.append(median_ms(lambda: target.forward(cache, x, pos, tree.causal_mask(t), np.array([t - 1])), args.repeats))
        live = [buf[:, :, :ctx] for buf in cache.buffers]
        copy_ms = median_ms(lambda: [np.array(b) for b in live], args.repeats)
        print(f"{ctx:>7}  " + "  ".join(f"{ms:>13.2f}" for ms in row) + f"   {copy_ms:>22.2f}")


if __name__ == "__main__":
    main()
