"""Helpers the tests share by import (conftest holds the fixtures): a tiny ShareGPT-format file, the kept prompt
beginnings' check on a method's engine (runtime/prefix.py)."""

import json
import random

from specexport.train.data import HELDOUT

WORDS = "the a sea ship wind sails over blue waves and calm night stars shine on quiet water far away".split()
TRAIN_CONVERSATIONS = 12


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_sharegpt(path, train=TRAIN_CONVERSATIONS, heldout=HELDOUT, truncate=True):
    """A ShareGPT-format JSON list: `train` conversations, then the `heldout` ones, then (if `truncate`) a
    conversation cut off mid-string, as in the real file."""
    rng = random.Random(0)
    items = [{"id": f"c{i}", "conversations": [{"from": "human", "value": sentence(rng, 5)},
                                               {"from": "gpt", "value": sentence(rng, 12)}]}
             for i in range(train + heldout)]  # fmt: skip
    text = json.dumps(items, indent=1)
    if truncate:
        text = text[:-2] + ',\n{"id": "cut", "conversations": [{"from": "human", "value": "The sea'
    path.write_text(text)
    return path


def check_prefix_copied(engine, new_tokens: int = 12) -> None:
    """Prompts that begin alike, on `engine` told to cut them where their common beginning ends (runtime/prefix.py:
    the tiny tokenizer's template ends no message with a special token): with the beginning's rows kept by the first
    prompt and copied into the others (what the proposer read from its calls too), every prompt emits the tokens it
    emits with the beginning computed each time (in the same chunks), batch 1 and batched, in fewer target calls (a
    proposer that reads the calls' outputs is given the kept ones: else none is saved)."""
    from specexport.runtime.prefix import PrefixStore
    from specexport.runtime.scheduler import Scheduler

    prompts = [f"the sea and the ship sail over blue waves {tail}" for tail in ("far away", "at night", "calm")]
    ids = [engine.encode(p) for p in prompts]
    start = next(i for i, t in enumerate(zip(*ids)) if len(set(t)) > 1)
    cut = ids[0][start - 1:start]  # the beginning's last token stands for a message's end, first found at its end
    assert all(PrefixStore(cut, min_part=start).split(i) == [start] for i in ids)
    saved = engine.prefixes
    try:
        cold, calls = [], engine.target.calls
        for prompt in prompts:
            engine.prefixes = PrefixStore(cut, min_part=start)  # nothing kept: computed
            cold.append(engine.generate(prompt, max_new_tokens=new_tokens, stop_ids=(), budget=False))
        cold_calls, calls = engine.target.calls - calls, engine.target.calls
        engine.prefixes = PrefixStore(cut, min_part=start)
        warm = [engine.generate(p, max_new_tokens=new_tokens, stop_ids=(), budget=False) for p in prompts]
        assert engine.target.calls - calls < cold_calls
        # the same tokens, and the same steps: the proposer drafted from what it read, as with the beginning computed
        assert [(g.tokens, g.stats.accept_lengths) for g in warm] == [(g.tokens, g.stats.accept_lengths) for g in cold]
        cold = [g.tokens for g in cold]
        scheduler = Scheduler(engine, max_batch=3, background=False)
        hits = engine.prefixes.hits
        requests = [scheduler.submit(p, max_new_tokens=new_tokens, stop_ids=()) for p in prompts]
        scheduler.run_until_idle()
        assert [r.result(timeout=0).tokens for r in requests] == cold
        # each prompt's beginning copied into its slot; where the proposer reads other outputs batched (Medusa's
        # heads), the first batched prompt computes it again, and keeps them
        assert engine.prefixes.hits - hits >= 2 * start
    finally:
        engine.prefixes = saved


TRAIN = dict(samples=48, new_tokens=32, prompt_tokens=64, batch=8, lr=3e-3, threads=1, feature_batch=16, ttt_steps=3,
             self_share=1.0)  # the tiny random model: its own continuations are what is learnable


def train_tiny_eagle(folder, output, data, method="eagle3", resume=False, **settings):
    """An EAGLE draft (`method` eagle3 or eagle) for a tiny model at `folder`, with TRAIN's settings and these."""
    import specexport.train as trainers

    trainer = trainers.get(method)
    config = trainer.Config(data=data, **{**TRAIN, **settings})
    return trainer.train(str(folder), output, config, resume=resume, quiet=True)


def greedy_sequences(model, prompts, new_tokens: int) -> list:
    """Each prompt (a list of ids) followed by the model's `new_tokens` greedy tokens, as 1-D tensors: what a draft
    trained in a test learns, so that its drafts are accepted."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            for _ in range(new_tokens):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
            out.append(ids[0])
    return out


def check_batched_and_sampled(engine, prompts, new_tokens: int, want: list[list[int]], temperature: float) -> None:
    """Batched equals alone (3 slots, prefill chunks of 5: `want` holds each prompt's tokens alone), and sampled
    output follows plain sampling (a chi-square test over 1200 draws each, the speculative path exercised)."""
    import chisquare

    from specexport.runtime.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=3, prefill_chunk=5, budget=False, background=False)
    requests = [scheduler.submit(p, max_new_tokens=new_tokens, stop_ids=()) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in requests] == want
    spec, lengths = chisquare.sampled_counts(engine, "the cat", False, 1200, 0, temperature=temperature)
    plain, _ = chisquare.sampled_counts(engine, "the cat", True, 1200, 100_000, temperature=temperature)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50 and dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)
