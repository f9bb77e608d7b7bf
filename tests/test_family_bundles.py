"""Every family end to end from the CLI: a tiny random model saved as a Hugging Face folder, built with `specexport
build` (fp32, validated against transformers), then run: greedy output equals transformers' own `generate` on prompts
longer than the windows, and n-gram, a draft model (the target's first layer, `self:1`), an EAGLE-3 draft and Medusa
heads trained briefly on the family's own continuations give plain decoding's tokens alone and batched at 8 through
the scheduler."""

import pytest
import torch
from click.testing import CliRunner
from conftest import save_folder
from test_families import FAMILIES, model

from specexport.cli import main
from specexport.exporter import validate
from specexport.runtime.generate import Engine
from specexport.runtime.scheduler import Scheduler

NEW_TOKENS = 20
# byte-level prompts of 20-60 tokens: every one outruns the tiny models' 8-position windows
PROMPTS = ["the sea and the ship sail over blue waves far away", "a b a b a b a b a b a b a b",
           "def f(n):\n    return n * 2\n\nprint(f(3))", "quiet water under the stars, calm night",
           "one two three four five six seven eight nine ten", "zzz", "the the the the the the the the",
           "blue waves and calm night stars shine on quiet water far away from the sea"]


def build(folder, out, *args):
    result = CliRunner().invoke(main, ["build", "--model", str(folder), "--precision", "fp32", "--output", str(out),
                                       "--max-context", "128", *args])
    assert result.exit_code == 0, result.output
    return Engine.load(out, threads=1)


def train_eagle3(folder, out, data):
    """An EAGLE-3 draft trained for a few seconds on the tiny target's own continuations (the layout we publish)."""
    import specexport.train as trainers

    trainer = trainers.get("eagle3")
    config = trainer.Config(data=data, samples=24, new_tokens=24, prompt_tokens=48, batch=8, lr=3e-3, threads=1,
                            feature_batch=16, ttt_steps=2, self_share=1.0, steps=40, draft_vocab=128,
                            aux_layers=(0, 1, 1))
    trainer.train(str(folder), out, config, quiet=True)
    return out


def train_medusa(folder, out, data):
    """Medusa heads (3) trained for a few seconds on the data's own text (self-distillation on a tiny random Gemma's
    continuations gave the trainer no rows)."""
    from specexport.train import medusa

    config = medusa.Config(data=data, heads=3, samples=60, new_tokens=32, prompt_tokens=64, batch=512, lr=1e-2,
                           threads=1, feature_batch=16, steps=40, self_distill=False)
    medusa.train(str(folder), out, config, quiet=True)
    return out


def hf_greedy(m, ids, n):
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_family_built_and_run_from_the_cli(kind, tmp_path, lossless, sharegpt):
    m = model(kind)
    folder = save_folder(m, tmp_path / kind)
    plain = build(folder, tmp_path / "plain")
    expected = {}
    for prompt in PROMPTS:
        ids = plain.encode(prompt, chat=False)
        expected[prompt] = plain.generate(ids, max_new_tokens=NEW_TOKENS, stop_ids=()).tokens
        with validate.longrope_reference(m, 128):  # a LongRoPE bundle past the original length: the long factors
            assert expected[prompt] == hf_greedy(m, ids, NEW_TOKENS), prompt
    assert max(len(plain.encode(p, chat=False)) for p in PROMPTS) > 2 * 8
    eagle3 = train_eagle3(folder, tmp_path / "eagle3-draft", sharegpt)
    heads = train_medusa(folder, tmp_path / "medusa-heads", sharegpt)
    for args in (["--method", "ngram"], ["--method", "draft", "--draft-model", "self:1"],
                 ["--method", "eagle3", "--draft", str(eagle3)], ["--method", "medusa", "--heads", str(heads)]):
        engine = build(folder, tmp_path / args[1], *args)
        lossless(engine, PROMPTS, NEW_TOKENS)  # alone: whole trees and the governor's, equal to plain decoding
        scheduler = Scheduler(engine, max_batch=8, background=False)
        requests = [scheduler.submit(engine.encode(p, chat=False), max_new_tokens=NEW_TOKENS, stop_ids=())
                    for p in PROMPTS]
        scheduler.run_until_idle()
        got = [r.result(timeout=0).tokens for r in requests]
        assert got == [expected[p] for p in PROMPTS], args
