"""`specexport datastore`: the target's own greedy outputs on ShareGPT prompts, as suffix lookup's datastore
(runtime/datastore.py), generated with the bundle's runtime (plain decoding, so the outputs are the ones this
bundle produces).

Kept apart from evaluation: prompts come only from the training part of ShareGPT (the file's last HELDOUT
conversations, where the bench prompts of scripts/make_prompts.py come from, are never read), and a conversation is
skipped when its first human turn equals or contains a benchmark prompt, or any of its turns contains the text a
benchmark prompt is built around (`--exclude` files, by default benchmarks/prompts/*.jsonl of this checkout: the
prompt itself, and what follows its first blank line, code fences removed: a rewrite prompt's passage, a HumanEval
function); texts are compared lowercased with whitespace collapsed, and only texts of 40 characters or more count as
contained.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.fsutil import check_writable, probe_writable
from specexport.runtime import datastore as datastores
from specexport.runtime.bench import read_prompts
from specexport.runtime.generate import Engine
from specexport.train.data import sharegpt_split

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "prompts"  # a checkout's benchmark prompts
MIN_CONTAINED = 40  # characters: shorter texts are compared for equality only
MAX_PROMPT_CHARS = 4000


def normal(text: str) -> str:
    return " ".join(text.replace("```python", " ").replace("```", " ").lower().split())


def bench_texts(prompts: list[str]) -> tuple[set[str], list[str]]:
    """(the prompts, normalised; the texts they are built around: each prompt and what follows its first blank
    line, those of MIN_CONTAINED characters or more)."""
    whole, cores = set(), []
    for p in prompts:
        whole.add(normal(p))
        for text in (p, p.split("\n\n", 1)[-1]):
            if len(core := normal(text)) >= MIN_CONTAINED and core not in cores:
                cores.append(core)
    return whole, cores


def excluded(conversation: dict, whole: set[str], cores: list[str]) -> bool:
    turns = [t.get("value") for t in conversation.get("conversations", []) if isinstance(t.get("value"), str)]
    first = next((t.get("value") for t in conversation.get("conversations", []) if t.get("from") in ("human", "user")),
                 None)
    if isinstance(first, str):
        f = normal(first)
        if f in whole or any(w in f for w in whole if len(w) >= MIN_CONTAINED):
            return True
    return any(core in normal(t) for t in turns for core in cores)


def first_turns(conversations: list[dict], seed: int):
    """(index, first human turn) of each conversation in a seeded order."""
    for i in np.random.default_rng(seed).permutation(len(conversations)).tolist():
        turns = conversations[i].get("conversations", [])
        text = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if isinstance(text, str) and text.strip() and len(text) <= MAX_PROMPT_CHARS:
            yield i, text


def build(bundle: Path, output: Path, samples: int, new_tokens: int, data: Path | None, exclude: list[Path] | None,
          seed: int = 0, threads: int | None = None, overwrite: bool = False, quiet: bool = False,
          minutes: float | None = None, resume: bool = False) -> dict:
    """Generate `samples` outputs (or as many as `minutes` allow) and write the datastore to `output` (whole, or
    not at all); returns its meta. `resume`: add to the datastore at `output`, from where its prompts stopped."""
    if samples < 1 or new_tokens < 1 or (minutes is not None and not minutes > 0):
        raise UserError(f"--samples and --new-tokens must be >= 1 and --minutes > 0, got {samples}, {new_tokens} and "
                        f"{minutes}")
    output = Path(output)
    if output.is_dir() or (output.exists() and not (overwrite or resume)):
        raise UserError(f"{output} " + ("is a folder" if output.is_dir() else "already exists (pass --overwrite to "
                                                                              "replace it, --resume to add to it)"))
    check_writable(output)
    if not output.parent.is_dir():
        raise UserError(f"--output {output}: its folder does not exist")
    probe_writable(output.parent, f"--output {output.name}")
    exclude = sorted(BENCH.glob("*.jsonl")) if exclude is None else exclude
    whole, cores = bench_texts([p["prompt"] for f in exclude for p in read_prompts(f)])
    engine = Engine.load(bundle, threads=threads)
    m = engine.bundle.manifest
    meta = {"model": m["model"]["name"], "vocab": m["model"]["vocab"], "precision": m["precision"],
            "tokenizer_sha256": datastores.tokenizer_identity(engine.tokenizer.backend.get_vocab(with_added_tokens=True)),
            "seed": seed, "new_tokens": new_tokens, "exclude_files": [Path(f).name for f in exclude]}
    documents, taken, skipped, seconds = [], 0, 0, 0.0
    if resume and output.exists():
        old = datastores.load(output)
        differs = [k for k in meta if old.meta.get(k) != meta[k]]
        if differs:
            raise UserError(f"--resume: {output} was made with other settings ({', '.join(differs)} differ)")
        documents, taken = old.documents(), old.meta["taken"]
        skipped, seconds = old.meta["excluded_for_bench"], old.meta["seconds"]
    conversations, _, name = sharegpt_split(data)
    tokens, start = 0, time.perf_counter()
    for index, text in itertools.islice(first_turns(conversations, seed), taken, None):
        if len(documents) >= samples or (minutes and time.perf_counter() - start > 60 * minutes):
            break
        taken += 1
        if excluded(conversations[index], whole, cores):
            skipped += 1
            continue
        try:
            ids = engine.encode(text)
        except UserError:
            continue  # longer than the context, or not text
        if len(ids) > 1024:
            continue
        documents.append(engine.generate(ids, max_new_tokens=new_tokens).tokens)
        tokens += len(documents[-1])
        if not quiet and (len(documents) % 25 == 0 or len(documents) == samples):
            rate = tokens / (time.perf_counter() - start)
            print(f"  {len(documents)}/{samples} outputs, {tokens} tokens in this run, {rate:.0f} tokens/s",
                  file=sys.stderr, flush=True)
    if not documents:
        raise UserError(f"{name}: no usable prompt found")
    meta.update(prompts=f"first human turns of {name} (its training part), in a seeded order", taken=taken,
                excluded_for_bench=skipped, seconds=round(seconds + time.perf_counter() - start, 1))
    return datastores.write(output, documents, meta)
