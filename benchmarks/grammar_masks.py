#!/usr/bin/env python
"""The grammar libraries side by side on a bundle's tokenizer: llguidance (what runtime/grammar.py uses) and xgrammar,
each given the same JSON schema and walked along the same valid answer: compile time, the time to compute one token
mask (per position, median and p90), and a tree step's 16 masks (a chain of 16 rows, each after its own prefix);
then which of a list of JSON schema features each compiles (COVERAGE).

    python benchmarks/grammar_masks.py BUNDLE

xgrammar needs transformers (its tokenizer description) and torch (its bitmask): installed with the export extra.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from common import cpu_description

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "tags", "city"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "city": "Paris"}
ROWS = 16
OBJ = {"type": "object"}
COVERAGE = {  # one schema per feature a request may use (pydantic writes the first few)
    "$ref/$defs": {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                   "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}},
    "recursive $ref": {"$defs": {"N": {"type": "object", "properties": {"kids": {"type": "array",
                                                                                  "items": {"$ref": "#/$defs/N"}}}}},
                       "$ref": "#/$defs/N"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{**OBJ, "properties": {"a": {"type": "integer"}}}, {**OBJ, "required": ["a"]}]},
    "nullable type list": {"type": ["string", "null"]},
    "const and enum": {"type": "object", "properties": {"k": {"const": "v"}, "e": {"enum": [1, "two", None]}}},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "string format date-time": {"type": "string", "format": "date-time"},
    "string format email": {"type": "string", "format": "email"},
    "string format uuid": {"type": "string", "format": "uuid"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "number bounds": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "integer multipleOf": {"type": "integer", "multipleOf": 5},
    "additionalProperties schema": {**OBJ, "additionalProperties": {"type": "integer"}},
    "patternProperties": {**OBJ, "patternProperties": {"^x_": {"type": "integer"}}},
    "min/maxProperties": {**OBJ, "minProperties": 1, "maxProperties": 2},
    "if/then/else": {**OBJ, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "not": {"not": {"type": "string"}},
}


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - began)


def walk(mask, consume, rollback, reset, ids: list[int]) -> tuple[list[float], list[float]]:
    """(ms per mask along the answer, ms per 16-row chain of masks)."""
    singles = []
    for t in ids:
        singles.append(timed(mask))
        assert consume([t]), t
    chains = []
    for start in range(len(ids) - ROWS):
        reset()
        consume(ids[:start])

        def chain(start=start):
            for k in range(ROWS):
                mask()
                consume([ids[start + k]])
            rollback(ROWS)
        chains.append(timed(chain))
    return singles, chains


def report(name: str, compile_ms: float, singles: list[float], chains: list[float]) -> None:
    print(f"{name:11s} compile {compile_ms:6.2f} ms; one mask {np.median(singles):.3f} ms median, "
          f"{np.percentile(singles, 90):.3f} p90; {ROWS} rows {np.median(chains):.3f} ms median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    args = ap.parse_args()
    from specexport.bundle import load_bundle
    from specexport.runtime.tokenizer import Tokenizer

    bundle = load_bundle(args.bundle)
    tokenizer = Tokenizer.from_dir(bundle.path)
    vocab = int(bundle.manifest["model"]["vocab"])
    ids = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)  # ", " and ": ", as both are told below
    eos = sorted(tokenizer.eos_token_ids)
    print(f"CPU: {cpu_description()}; vocabulary {vocab}; the answer is {len(ids)} tokens")

    import llguidance
    import llguidance.numpy as lnp

    lt = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=layout)
    holder = []
    compile_ms = timed(lambda: holder.append(llguidance.LLMatcher(lt, grammar, log_level=0)))
    m, bits = holder[0], lnp.allocate_token_bitmask(1, vocab)
    report("llguidance", compile_ms, *walk(lambda: lnp.fill_next_token_bitmask(m, bits, 0), m.consume_tokens,
                                           m.rollback, m.reset, ids))

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    holder = []
    compile_ms = timed(lambda: holder.append(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                          separators=(", ", ": "))))
    mt, bits = xgr.GrammarMatcher(holder[0]), xgr.allocate_token_bitmask(1, vocab)
    report("xgrammar", compile_ms, *walk(lambda: mt.fill_next_token_bitmask(bits, 0),
                                         lambda ts: all(mt.accept_token(t) for t in ts), mt.rollback, mt.reset, ids))

    def llg(schema) -> bool:
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=layout)
        except (ValueError, RuntimeError):
            return False
        return not llguidance.LLMatcher(lt, g, log_level=0).is_error()

    def xg(schema) -> bool:
        try:
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            return True
        except Exception:  # noqa: BLE001 - any refusal counts as not covered
            return False

    print(f"\n{'JSON schema feature':30s} llguidance xgrammar")
    covered = [0, 0]
    for feature, schema in COVERAGE.items():
        a, b = llg(schema), xg(schema)
        covered[0], covered[1] = covered[0] + a, covered[1] + b
        print(f"{feature:30s} {'yes' if a else 'no':10s} {'yes' if b else 'no'}")
    print(f"{'compiled':30s} {covered[0]}/{len(COVERAGE):<8d} {covered[1]}/{len(COVERAGE)}")


if __name__ == "__main__":
    main()
