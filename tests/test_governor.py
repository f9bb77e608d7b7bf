"""The drafting governor (runtime/governor.py) on a generation alone: it stops drafting where drafts are never
accepted, cuts trees where rows are dear, keeps a seeded request's trees whole, and never changes greedy tokens.
Its latency is set by hand (the machine's speed decides nothing here)."""

import pytest
from conftest import method_export

from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.runtime.budget import BatchLatency
from specexport.runtime.governor import PROBE_STEPS, Governor
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.tree import DraftTree

PROMPT = "the cat sat on the mat, the cat sat on the"
NEW = 60


@pytest.fixture(scope="module")
def engine(tiny_folder, tmp_path_factory):
    from specexport.runtime.generate import Engine

    out = tmp_path_factory.mktemp("governor") / "ngram"
    options = ExportOptions(graph=GraphOptions(fused_accept=True), max_context=256, validate=False,
                            **method_export("ngram", draft_length=4))
    export_bundle(str(tiny_folder), out, options, quiet=True)
    return Engine.load(out, threads=1)


def governed(engine, latency: BatchLatency) -> Governor:
    """The engine's governor with this latency table, which learns nothing from the calls (their time is this
    machine's)."""
    engine.configure()
    governor = engine.governor()
    governor.latency = latency
    governor.latency.observe = lambda *_, **__: None
    return governor


class Wrong:
    """A proposer that drafts a chain of tokens the target never emits there (plain decoding's next tokens, each
    shifted by one), and counts its proposals."""

    def __init__(self, proposer, plain: list[int], start: int):
        self.inner, self.plain, self.offset, self.proposals = proposer, plain, start, 0
        self.max_drafts = 3

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, history):
        self.proposals += 1
        done = len(history) - self.offset
        wrong = [(t + 1) % 259 for t in self.plain[done:done + 3]]
        return DraftTree([history[-1]] + wrong, list(range(-1, len(wrong))))


def test_drafts_never_accepted_stop_the_proposals(engine, monkeypatch):
    """Every draft rejected: once the rates have learnt it (and what the last proposing steps chose has followed),
    no proposer runs but one step in PROBE_STEPS, every other step verifies its root alone, and the tokens are plain
    decoding's."""
    plain = engine.generate(PROMPT, max_new_tokens=200, stop_ids=(), plain=True).tokens
    governed(engine, BatchLatency([1], [1, 4], [[0.001, 0.002]]))  # a CPU-like table: 4 rows cost 2x one
    start, made = len(engine.encode(PROMPT)), []

    def wrong(sampler, plain_decoding=False):
        made.append(Wrong(engine.method.proposer(engine, engine.settings, sampler), plain, start))
        return made[-1]

    monkeypatch.setattr(engine, "proposer", wrong)
    steps, proposals = [], []
    result = engine.generate(PROMPT, max_new_tokens=200, stop_ids=(), on_step=lambda s: steps.append(s) or
                             proposals.append(made[0].proposals))
    assert result.tokens == plain
    later = len(steps) - 100  # the last steps
    assert later >= 90 and sum(len(s.tree) > 1 for s in steps[100:]) <= later // PROBE_STEPS + 1
    assert proposals[-1] - proposals[99] <= later // PROBE_STEPS + 1


def test_dear_rows_cut_the_trees_and_keep_the_tokens(engine):
    """Rows 100x dearer than one: every tree is cut to its root but a probe's (its best draft: one row more); with
    rows free, whole trees stay; greedy tokens are plain decoding's either way."""
    plain = engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=(), plain=True).tokens
    for table, dear in (([[0.001, 0.1]], True), ([[0.001, 0.001]], False)):
        governed(engine, BatchLatency([1], [1, 4], table))
        steps = []
        assert engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=(), on_step=steps.append).tokens == plain
        widths = [len(s.tree) for s in steps[5:]]
        if dear:
            assert max(widths) <= 2 and sum(w > 1 for w in widths) <= len(widths) // PROBE_STEPS + 1
        else:
            assert max(widths) == 5


def test_a_seeded_request_keeps_its_trees_whole(engine):
    """A request sampled with a seed verifies every tree as its proposer made it, so its tokens are the same on every
    run whatever the governor's tables say: the same as with no governor at all."""
    params = SamplingParams(temperature=0.05, seed=7)  # near greedy: the n-grams match
    whole = engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=(), sampling=params, budget=False)
    governed(engine, BatchLatency([1], [1, 4], [[0.001, 0.1]]))  # rows dear: an unseeded tree would be cut
    steps = []
    again = engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=(), sampling=params, on_step=steps.append)
    assert again.tokens == whole.tokens and max(len(s.tree) for s in steps) > 1
