#!/usr/bin/env python
"""Prompts' beginnings kept (runtime/prefix.py) against computed for every prompt, side by side: three engines on one
bundle, each behind its own scheduler, the same closed loop of C clients on each (benchmarks/bench_batch.py's: each
client sends its next request when its last one finishes), in turn, R rounds per C (each loop after one short
untimed request on its engine, its store emptied first):

- `kept`: prompts cut where a message ends, each chunk kept by the first prompt that computes it and copied into
  later prompts that begin with the same chunks;
- `computed`: cut the same way, every chunk computed for every prompt (so the same tokens at every precision);
- `unsplit`: no cuts: every prompt prefilled whole (the first token alone where the bundle asks; int8's per-call
  activation scale makes its tokens differ from the others').

Each request is one prompt of the file as the chat's only message (after `--system`, where given); with `--turns K`
each client holds a conversation instead: its requests are the turns of one chat (the earlier questions and the
replies generated to them, then the next prompt), a new chat every K requests.

Printed per configuration and C: tokens/s (median over rounds), time to first token p50/p99 (pooled over rounds),
prompt calls per request (target calls outside the decoding steps), and kept over each other configuration in
tokens/s and TTFT p50, round by round (the median and the range).

    python benchmarks/bench_prefix.py BUNDLE [--prompts benchmarks/prompts/sharegpt40.jsonl] [--concurrency 1,16]
        [--requests 2] [--rounds 3] [--new-tokens 128] [--system TEXT] [--turns K] [--plain] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np

from specexport.runtime.generate import Engine
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.scheduler import Scheduler

from common import SHAREGPT40, closed_loop, pct, prompt_texts

CONFIGS = ("kept", "computed", "unsplit")


class Computed(PrefixStore):
    """A store that keeps nothing: every prompt computed, in the same chunks."""

    def keep(self, cache, chunks: list[list[int]], outputs: dict) -> None:
        pass


class Chats:
    """Each client's requests as chat prompts (token ids): the prompt after the system message, or with `turns` the
    client's conversation so far (its earlier questions and the replies its requests gave) and then the prompt, a
    new conversation every `turns` requests. A client is its thread (closed_loop's)."""

    def __init__(self, tokenizer, system: str | None, turns: int):
        self.tokenizer, self.turns = tokenizer, turns
        self.opening = [{"role": "system", "content": system}] if system else []
        self.chats: dict[int, tuple[list[dict], object]] = {}  # thread -> its conversation, its last request

    def ids(self, prompt: str) -> list[int]:
        me = threading.get_ident()
        chat, last = self.chats.get(me, ([], None))
        if last is not None:
            chat.append({"role": "assistant", "content": last.result().text})
        if len(chat) >= 2 * self.turns:
            chat = []
        chat.append({"role": "user", "content": prompt})
        self.chats[me] = (chat, None)
        return self.tokenizer.encode_chat(self.opening + chat)

    def sent(self, request) -> None:
        me = threading.get_ident()
        self.chats[me] = (self.chats[me][0], request)

    def reset(self) -> None:
        self.chats.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompts", type=Path, default=SHAREGPT40)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--system", default=None, help="a system prompt before every chat (default: the template's)")
    ap.add_argument("--turns", type=int, default=1, help="requests per conversation (each client holds one)")
    ap.add_argument("--plain", action="store_true", help="plain decoding on a speculative bundle")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.turns < 1:
        sys.exit("--rounds, --requests and --turns must be >= 1")
    prompts = prompt_texts(args.prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {name: Engine.load(args.bundle, threads=args.threads) for name in CONFIGS}
    marks = engines["kept"].prefixes.marks
    engines["computed"].prefixes = Computed(*marks)
    engines["unsplit"].prefixes = PrefixStore()
    if not marks[0]:
        sys.exit(f"{args.bundle.name}: its chat template ends no message with a special token (nothing to cut at)")
    chats = Chats(engines["kept"].tokenizer, args.system, args.turns)

    def submit(scheduler, prompt):
        request = scheduler.submit(chats.ids(prompt), max_new_tokens=args.new_tokens, stop_ids=())
        chats.sent(request)
        return request

    schedulers = {name: Scheduler(e, max_batch=max(levels), plain=args.plain) for name, e in engines.items()}
    rows = {}
    for c in levels:
        for r in range(args.rounds):
            for name in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
                engine, scheduler = engines[name], schedulers[name]
                engine.prefixes = type(engine.prefixes)(*engine.prefixes.marks)  # nothing kept from the last loop
                scheduler.submit(prompts[0], max_new_tokens=8, stop_ids=()).result(timeout=600)
                calls, steps = engine.target.calls, scheduler.steps
                chats.reset()
                row = closed_loop(lambda p, s=scheduler: submit(s, p), prompts, c, args.requests)
                row["prompt_calls"] = (engine.target.calls - calls - (scheduler.steps - steps)) / row["requests"]
                rows.setdefault((name, c), []).append(row)
                print(f"  C={c:<3} round {r} {name:<9} {row['tokens_per_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    for scheduler in schedulers.values():
        scheduler.close()
    decode = engines["kept"].tokenizer.decode
    print(f"{args.bundle.name}: prompts cut after {decode(marks[0], skip_special_tokens=False)!r}; closed loop, "
          f"{args.requests} requests per client ({args.turns} a conversation), "
          + (f"system prompt {args.system!r}, " if args.system else "")
          + f"{args.new_tokens} new tokens each, greedy, {args.threads} threads, {args.rounds} round(s)")
    print(f"{'config':10} {'C':>3} {'tokens/s':>9} {'TTFT p50':>9} {'p99':>7} {'prompt calls':>13}")
    for c in levels:
        for name in CONFIGS:
            runs = rows[(name, c)]
            ttft = [t for run in runs for t in run["ttft"]]
            print(f"{name:10} {c:>3} {np.median([run['tokens_per_s'] for run in runs]):9.1f} "
                  f"{1e3 * pct(ttft, 50):9.0f} {1e3 * pct(ttft, 99):7.0f} "
                  f"{np.mean([run['prompt_calls'] for run in runs]):13.2f}")
    for other in CONFIGS[1:]:
        for what, key in (("tokens/s", lambda run: run["tokens_per_s"]),
                          ("TTFT p50", lambda run: pct(run["ttft"], 50))):
            ratios = {c: [key(a) / key(b) for a, b in zip(rows[("kept", c)], rows[(other, c)])] for c in levels}
            print(f"kept / {other}, {what}, per C: " + ", ".join(
                f"C={c} {np.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" for c, v in ratios.items()))


if __name__ == "__main__":
    main()
