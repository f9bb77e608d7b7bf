#!/usr/bin/env python
"""Structured output on real bundles: constrained speculative decoding against constrained plain decoding (greedy,
token for token), the outputs checked against their schemas, tokens/s with and without a schema side by side, and
what the grammar's masks cost per step (one row, and 16 rows of a tree).

    python benchmarks/structured.py BUNDLE [BUNDLE ...] [--prompts benchmarks/prompts/sharegpt40.jsonl] [--count 20]
                                    [--max-new-tokens 96]

Each prompt asks for JSON; every (prompt, schema) is generated three ways on each bundle, interleaved: constrained
plain decoding, constrained speculative decoding (whole trees), and the same speculative decoding free.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import numpy as np

from specexport.runtime.generate import Engine
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams

from common import cpu_description, prompt_texts

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40}}, "required": ["name", "age", "city"],
        "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 2, "maxItems": 4}},
        "required": ["topic", "points"], "additionalProperties": False},
    "verdict": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string", "maxLength": 120}}, "required": ["answer", "confidence", "reason"],
        "additionalProperties": False},
}


def mask_cost(engine: Engine, constraint: Constraint, tokens: list[int], rows: int) -> float:
    """Median ms to mask `rows` rows, each after its own prefix of `tokens` (a chain: the deepest paths a tree of
    that many rows can have), over the positions of a real output."""
    vocab = int(engine.bundle.manifest["model"]["vocab"])
    logits = np.zeros((rows, vocab))
    times = []
    matcher = engine.grammars.matcher(constraint)
    for start in range(0, max(1, len(tokens) - rows)):
        paths = [tokens[start:start + k] for k in range(rows)]
        began = time.perf_counter()
        matcher.mask(logits, paths)
        times.append(time.perf_counter() - began)
        matcher.advance(tokens[start:start + 1])
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", default="benchmarks/prompts/sharegpt40.jsonl")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    prompts = [p[:600] + "\n\nAnswer with a JSON object." for p in prompt_texts(args.prompts)[:args.count]]
    print(f"CPU: {cpu_description()}; {len(prompts)} prompts x {len(SCHEMAS)} schemas, greedy, "
          f"{args.max_new_tokens} new tokens at most")
    for bundle in args.bundles:
        engine = Engine.load(bundle)
        engine.generate(prompts[0], max_new_tokens=8)  # warm-up
        same = valid = ended = 0
        speed = {"plain+schema": [0, 0.0], "spec+schema": [0, 0.0], "spec": [0, 0.0]}
        accept = {"spec+schema": [], "spec": []}
        sample_tokens = None
        for k, prompt in enumerate(prompts):
            for name, schema in SCHEMAS.items():
                params = SamplingParams(constraint=Constraint.json_schema(schema))
                runs = {}
                order = ["plain+schema", "spec+schema", "spec"]
                for how in order if k % 2 == 0 else order[::-1]:
                    runs[how] = engine.generate(prompt, max_new_tokens=args.max_new_tokens, budget=False,
                                                plain=how.startswith("plain"),
                                                sampling=params if how.endswith("schema") else None)
                    speed[how][0] += runs[how].stats.new_tokens
                    speed[how][1] += runs[how].stats.seconds
                    if how in accept:
                        accept[how] += runs[how].stats.accept_lengths
                same += runs["spec+schema"].tokens == runs["plain+schema"].tokens
                if runs["plain+schema"].stop_reason == "eos":
                    ended += 1
                    try:
                        jsonschema.validate(json.loads(runs["plain+schema"].text), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
                    sample_tokens = sample_tokens or (name, runs["plain+schema"].tokens)
        total = len(prompts) * len(SCHEMAS)
        print(f"\n{engine.describe()} ({engine.bundle.precision}): speculative == plain on {same}/{total}; "
              f"{ended} ended (the rest reached the token limit), {valid}/{ended} valid against their schema")
        for how, (tokens, seconds) in speed.items():
            tau = f", tau {np.mean(accept[how]):.2f}" if how in accept else ""
            print(f"  {how:13s} {tokens / seconds:7.1f} tokens/s{tau}")
        if sample_tokens is not None:
            constraint = Constraint.json_schema(SCHEMAS[sample_tokens[0]])
            print(f"  mask per step: {mask_cost(engine, constraint, sample_tokens[1], 1):.3f} ms at 1 row, "
                  f"{mask_cost(engine, constraint, sample_tokens[1], 16):.3f} ms at 16 rows")


if __name__ == "__main__":
    main()
