"""Medusa: every head layout loads (and nothing else does), trees as data, the fused step against the reference,
and the loop end to end on a tiny model: lossless greedy, exact sampling, one-line errors from the CLI."""

import json
import pickle

import chisquare
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import TINY, TOKENIZER_VOCAB, method_export, tiny_model
from helpers import check_prefix_copied
from safetensors.numpy import save_file

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter import validate
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.exporter.medusa import MedusaHeads, load_heads, save_heads
from specexport.exporter.medusa_graph import HeadsAtAcceptedRow, build_heads_graph
from specexport.exporter.save import Checkpoint, decoder_builder, save_graph, write_graph
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine
from specexport.runtime.rank_tree import PRESETS, expected_accept_length, from_accuracy, make, parse
from specexport.runtime.sampling import SamplingParams

H, V = TINY["hidden_size"], TOKENIZER_VOCAB
RANKS = [[0.5, 0.2, 0.1], [0.3, 0.1], [0.2]]


def random_heads(count=3, layers=1, own=False, scale=0.3, seed=0):
    rng = np.random.default_rng(seed)
    blocks = [[(rng.normal(0, scale / H**0.5, (H, H)).astype(np.float32), rng.normal(0, 0.1, H).astype(np.float32))
               for _ in range(layers)] for _ in range(count)]
    lm = [rng.normal(0, 1, (V, H)).astype(np.float32) for _ in range(count)] if own else None
    return MedusaHeads(blocks, lm)


def write_heads(folder, heads, ranks=RANKS):
    folder.mkdir(parents=True, exist_ok=True)
    save_heads(heads, folder, {"vocab_size": V, "accuracy": [{"ranks": r} for r in ranks]})
    return folder


# ------------------------------------------------------------------------------------------------ formats


def outputs(heads, hidden, lm_head):
    return heads.numpy_forward(hidden, lm_head)


@pytest.mark.parametrize("own", [False, True])
def test_every_published_layout_round_trips(tmp_path, own):
    heads = random_heads(own=own)
    state = {k: torch.from_numpy(v.copy()) for k, v in heads.state_dict().items()}
    hidden, base = np.random.default_rng(1).normal(size=(5, H)).astype(np.float32), np.eye(V, H, dtype=np.float32)
    want = outputs(heads, hidden, base)

    (tmp_path / "v01").mkdir()  # Medusa v0.1: medusa_lm_head.pt, a config.json that miscounts the heads
    torch.save(state, tmp_path / "v01" / "medusa_lm_head.pt")
    (tmp_path / "v01" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (tmp_path / "m2").mkdir()  # Medusa-2: a full model's safetensors with medusa_head.* among the base keys
    save_file({"model.embed_tokens.weight": base, **{f"medusa_head.{k}": v for k, v in heads.state_dict().items()}},
              str(tmp_path / "m2" / "model.safetensors"))
    tgi = {}  # TGI: medusa_heads.{i}.medusa_layers.{j}.linear.*, medusa_heads.{i}.lm_head.weight
    for i, blocks in enumerate(heads.blocks):
        for j, (w, b) in enumerate(blocks):
            tgi[f"medusa_heads.{i}.medusa_layers.{j}.linear.weight"] = w
            tgi[f"medusa_heads.{i}.medusa_layers.{j}.linear.bias"] = b
        if own:
            tgi[f"medusa_heads.{i}.lm_head.weight"] = heads.lm_heads[i]
    save_file(tgi, str(tmp_path / "tgi.safetensors"))
    subset = MedusaHeads(heads.blocks, heads.lm_heads, {}, np.arange(0, V, 3))  # ours may carry a vocab subset
    ours = write_heads(tmp_path / "ours", subset)

    for where, expected in ((tmp_path / "v01", want), (tmp_path / "m2", want), (tmp_path / "tgi.safetensors", want),
                            (ours, outputs(subset, hidden, base))):
        loaded = load_heads(where)
        assert (loaded.count, loaded.layers, loaded.style) == (3, 1, "own" if own else "shared"), where
        np.testing.assert_array_equal(outputs(loaded, hidden, base), expected)
    assert load_heads(ours).meta["accuracy"][0]["ranks"] == RANKS[0]
    np.testing.assert_array_equal(load_heads(ours).vocab_subset, subset.vocab_subset)
    with pytest.raises(UserError, match="vocab_subset must be sorted"):
        MedusaHeads(heads.blocks, None, {}, np.array([5, 3])).check(H, V, "x")


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("this would have run",))

    path = tmp_path / "medusa_lm_head.pt"
    path.write_bytes(pickle.dumps({"0.0.linear.weight": Boom()}))
    with pytest.raises(UserError, match="refusing to load"):
        load_heads(path)


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.pop("1.0.linear.bias"), "lacks its bias"),
    (lambda s: s.update({"1.0.linear.weight": np.zeros((H, H + 1), np.float32)}), "square"),
    (lambda s: [s.__setitem__(k.replace("2.", "3.", 1), s.pop(k)) for k in list(s) if k.startswith("2.")], "not 0..2"),
    (lambda s: s.clear() or s.update({"unrelated": np.zeros(3, np.float32)}), "no Medusa head tensors"),
])  # fmt: skip
def test_malformed_heads(tmp_path, mutate, match):
    state = random_heads().state_dict()
    mutate(state)
    save_file(state, str(tmp_path / "h.safetensors"))
    with pytest.raises(UserError, match=match):
        load_heads(tmp_path / "h.safetensors")


def test_heads_for_another_model_are_refused(tmp_path):
    with pytest.raises(UserError, match="hidden size 64 do not fit a target of hidden size 32"):
        random_heads().check(32, V, "x")
    with pytest.raises(UserError, match="259-token vocabulary"):
        random_heads(own=True).check(H, 300, "x")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_heads(tmp_path / "bad.safetensors")


# -------------------------------------------------------------------------------------------------- trees


def test_a_hand_drawn_tree():
    t = make([[1, 0], [0], [0, 1], [1], [0, 0]])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))  # by depth, then path
    assert t.parents == [-1, 0, 0, 1, 1, 2]
    assert (t.size, t.depth, t.top_k) == (6, 2, 2)
    candidates = np.array([[10, 11], [20, 21]])
    assert t.medusa_tokens(5, candidates) == [5, 10, 11, 20, 21, 20]  # depth-2 nodes use head 1 whatever the parent


@pytest.mark.parametrize("choices, match", [
    ([], "at least one path"),
    ([[0], [0, 0, 0]], "has no parent"),
    ([[0], [0]], "appears twice"),
    ([[0], [-1]], ">= 0"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "only 3 heads"),
    ([[10]], "rank 10"),
    ([["a"]], "non-empty list of ranks"),
])  # fmt: skip
def test_bad_trees(choices, match):
    with pytest.raises(UserError, match=match):
        make(choices, depth_limit=3, rank_limit=10)


def test_tree_from_accuracies_is_hand_checked():
    t = from_accuracy(RANKS, 4)
    # values: (0) .5, (1) .2, (0,0) .15, (2) .1, (0,1) .05, (1,0) .06, (0,0,0) .03
    assert t.paths == ((0,), (1,), (2,), (0, 0))
    assert expected_accept_length(t, RANKS) == pytest.approx(1 + 0.5 + 0.2 + 0.1 + 0.15)
    assert from_accuracy(RANKS, 6).paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))


def test_presets_and_files(tmp_path):
    for name, choices in PRESETS.items():
        assert make(choices, rank_limit=10).size == len(choices) + 1, name
    assert make(PRESETS["mc_sim_7b_63"]).size == 64
    (tmp_path / "t.json").write_text(json.dumps({"medusa_choices": [[0], [0, 0]]}))
    assert parse(str(tmp_path / "t.json"), 3, 10, None).paths == ((0,), (0, 0))
    assert parse("auto:2", 3, 10, RANKS).paths == ((0,), (1,))
    with pytest.raises(UserError, match="needs per-rank accuracies"):
        parse("auto:5", 3, 10, None)
    with pytest.raises(UserError, match="unknown tree"):
        parse("bushy", 3, 10, None)


# ---------------------------------------------------------------------------------------- graph and loop


def fused_sessions(model, heads, folder):
    """(the target graph with the heads fused at the accepted row, the heads' graph alone), built into `folder`."""
    import onnxruntime as ort

    options = GraphOptions(fused_accept=True)
    info = write_graph(model, "target", options, 128, folder, True, (HeadsAtAcceptedRow(heads, 10),))
    builder = decoder_builder(Checkpoint.of_model(model), options, 128)
    alone = save_graph(build_heads_graph(builder, heads, 10), "medusa_heads", options, builder.d, folder)
    return (GraphSession(folder / info["file"], info, threads=1),
            ort.InferenceSession(str(folder / alone["file"]), providers=["CPUExecutionProvider"]))


@pytest.mark.parametrize("own, subset", [(False, False), (True, False), (False, True), (True, True)])
def test_fused_step_equals_the_pytorch_reference(tmp_path, own, subset):

    model = tiny_model("llama")
    heads = random_heads(own=own, scale=1.0)
    if subset:  # the heads propose from 100 of the 259 tokens
        heads.vocab_subset = np.sort(np.random.default_rng(3).choice(V, 100, replace=False))
    session, heads_session = fused_sessions(model, heads, tmp_path)
    accepted = []
    for seed in range(6):
        run = validate.medusa_step(model, session, heads_session, heads, seed)
        assert run["path_match"] and run["bonus_match"], run
        assert run["fused_top10_match"] == 1.0 and run["heads_graph_top10_match"] == 1.0, run
        accepted.append(run["accepted"])
    assert max(accepted) >= 2  # the check reaches deep paths, not just the root


TRAIN = dict(heads=3, samples=60, new_tokens=32, prompt_tokens=64, batch=512, lr=1e-2, threads=1, feature_batch=16)


def train_heads(folder, output, data, resume=False, **settings):
    """Heads for the tiny model at `folder`, with TRAIN's settings and these (quiet)."""
    from specexport.train import medusa

    config = medusa.Config(data=data, **{**TRAIN, **settings})
    return medusa.train(str(folder), output, config, resume=resume, quiet=True)


@pytest.fixture(scope="module")
def trained(tiny_folder, sharegpt, tmp_path_factory):
    """Heads trained on the tiny model's own greedy continuations (seconds): (training.json, folder)."""
    out = tmp_path_factory.mktemp("trained") / "heads"
    return train_heads(tiny_folder, out, sharegpt, steps=150), out


@pytest.fixture(scope="module")
def medusa_engine(tiny_folder, trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    options = ExportOptions(graph=GraphOptions(), max_context=128, optimize=True,
                            **method_export("medusa", heads=str(trained[1]), tree="auto:6"))
    manifest = export_bundle(str(tiny_folder), root / "bundle", options, quiet=True)
    assert manifest["numerics"]["medusa"]["path_match"] and manifest["numerics"]["medusa"]["bonus_match"]
    return Engine.load(root / "bundle", threads=1)


def test_training_learns_and_writes_loadable_heads(trained):
    summary, folder = trained
    losses = summary["losses"]
    assert len(losses) == summary["steps"] == 150
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10]), losses[::15]
    # self-distilled: the cached rows are the target's own (up to near-ties of the fp16-cached hidden states)
    assert summary["base_lm_head_top1_on_heldout"] >= 0.99
    head0 = summary["accuracy"][0]
    assert head0["top1"] > 0.1 and head0["top5"] >= head0["top1"] and len(head0["ranks"]) == 10  # chance: 1/259
    heads = load_heads(folder)
    assert (heads.count, heads.style, heads.meta["accuracy"]) == (3, "shared", summary["accuracy"])
    assert json.loads((folder / "training.json").read_text()) == summary


def test_own_lm_head_style_trains_and_loads(tiny_folder, sharegpt, tmp_path):
    summary = train_heads(tiny_folder, tmp_path / "own", sharegpt, steps=30, head_style="own")
    heads = load_heads(tmp_path / "own")
    assert heads.style == "own" and len(heads.lm_heads) == 3 and heads.lm_heads[0].shape == (V, H)
    assert summary["losses"][-1] < summary["losses"][0]


def test_training_resumes_exactly(tiny_folder, sharegpt, tmp_path):
    whole = train_heads(tiny_folder, tmp_path / "whole", sharegpt, steps=12, save_every=4)
    first = train_heads(tiny_folder, tmp_path / "part", sharegpt, steps=12, save_every=4,
                        minutes=1e-9)  # stops after its first step
    assert first["steps"] == 1
    with pytest.raises(UserError, match="lr=0.01, not 0.02"):
        train_heads(tiny_folder, tmp_path / "part", sharegpt, steps=12, save_every=4, resume=True, lr=2e-2)
    again = train_heads(tiny_folder, tmp_path / "part", sharegpt, steps=12, save_every=4, resume=True)
    assert again["steps"] == 12 and again["losses"] == whole["losses"]
    a, b = load_heads(tmp_path / "whole"), load_heads(tmp_path / "part")
    np.testing.assert_array_equal(a.blocks[2][0][0], b.blocks[2][0][0])


def test_training_bad_input(tiny_folder, sharegpt, tmp_path):
    with pytest.raises(UserError, match="--heads must be 1..16"):
        train_heads(tiny_folder, tmp_path / "x", sharegpt, heads=0)
    with pytest.raises(UserError, match="nothing to resume"):
        train_heads(tiny_folder, tmp_path / "y", sharegpt, resume=True)
    fails(["train", "--method", "medusa", "--model", tiny_folder, "--output", tmp_path / "z", "--layers", "2"],
          "--layers does not apply to --method medusa")
    fails(["train", "--method", "medusa", "--model", tiny_folder, "--output", tmp_path / "z", "--head-style", "big"],
          "--head-style must be one of shared, own, got 'big'")
    fails(["train", "--method", "draft", "--model", tiny_folder, "--output", tmp_path / "z", "--heads", "2"],
          "--heads does not apply to --method draft")


def test_greedy_medusa_is_lossless(medusa_engine, lossless):
    runs = lossless(medusa_engine, ["The sea wind over blue waves.", "A ship and calm night stars.", "x",
                                    "Far away quiet water."], 40)
    assert max(r.stats.tau for r in runs) > 1.0  # the heads' candidates were accepted somewhere
    medusa_engine.configure(tree="chain_3")
    try:
        lossless(medusa_engine, ["x"], 20)
    finally:
        medusa_engine.configure()


def test_constrained_greedy_medusa_is_lossless(medusa_engine, constrained):
    """Structured output on Medusa's scored trees: the forbidden candidates cut, each row masked on its path."""
    ended, _ = constrained(medusa_engine, ["The sea wind over blue waves.", "x", '{"a": "x", "b": true}'], 40)
    assert ended >= 3


def test_medusa_sampling_follows_plain_sampling(medusa_engine):
    spec, lengths = chisquare.sampled_counts(medusa_engine, "the cat", False, 1500, 0, temperature=0.4)
    plain, _ = chisquare.sampled_counts(medusa_engine, "the cat", True, 1500, 100_000, temperature=0.4)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50  # the speculative path was exercised, not plain sampling in disguise
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)


def test_typical_acceptance_is_opt_in_and_runs(medusa_engine):
    medusa_engine.configure(typical=True)
    try:
        steps = []
        out = medusa_engine.generate("the cat", max_new_tokens=12, sampling=SamplingParams(temperature=0.7, seed=0),
                                     stop_ids=(), on_step=steps.append)
        assert len(out.tokens) == 12 and all(s.tree.mode.value == "typical" for s in steps)
        with pytest.raises(UserError, match="--typical needs --temperature > 0"):
            medusa_engine.generate("the cat", max_new_tokens=4)
    finally:
        medusa_engine.configure()
    assert medusa_engine.generate("the cat", max_new_tokens=4).tokens  # greedy again


# -------------------------------------------------------------------------------------------------- CLI


def fails(args, match):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert match in result.stderr.strip().splitlines()[-1], result.output


@pytest.mark.parametrize("heads, tree, match", [
    ("wide", "small_7", "hidden size 96 do not fit"),
    ("pickle", "small_7", "refusing to load"),
    ("good", "empty.json", "at least one path"),
    ("good", "deep.json", "only 3 heads"),
    ("good", "[[0], [12]]", "rank 12"),
    ("good", "[[0], [0, 0]", "inline tree: not valid JSON"),
    ("good", "rank.json", "rank 10"),
    ("corrupt", "small_7", "not a readable safetensors"),
])  # fmt: skip
def test_bad_medusa_builds_fail_in_one_line(tiny_folder, tmp_path, heads, tree, match):
    good = write_heads(tmp_path / "good", random_heads())
    wide = tmp_path / "wide"
    wide.mkdir()
    save_file({"0.0.linear.weight": np.zeros((96, 96), np.float32), "0.0.linear.bias": np.zeros(96, np.float32)},
              str(wide / "medusa_lm_head.safetensors"))
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "medusa_lm_head.pt").write_bytes(pickle.dumps({"0.0.linear.weight": print}))
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "medusa_lm_head.safetensors").write_bytes(good.joinpath("medusa_lm_head.safetensors").read_bytes()[:100])
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "deep.json").write_text("[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]")
    (tmp_path / "rank.json").write_text("[[0], [10]]")
    tree_arg = str(tmp_path / tree) if tree.endswith(".json") else tree
    out = tmp_path / "bundle"
    fails(["build", "--model", tiny_folder, "--method", "medusa", "--heads", tmp_path / heads, "--tree", tree_arg,
           "--output", out, "--no-validate"], match)
    assert not out.exists() and not any(p.name.startswith(".bundle") for p in tmp_path.iterdir())


def test_medusa_cli_end_to_end(tiny_folder, tmp_path):
    heads = write_heads(tmp_path / "heads", random_heads())
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "medusa", "--heads",
                                       str(heads), "--tree", "chain_3", "--precision", "fp32", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "medusa step" in result.output
    info = CliRunner().invoke(main, ["info", str(out)])
    assert "tree 'chain_3': 4 tokens per step, depth 3" in info.output, info.output
    run = CliRunner().invoke(main, ["run", str(out), "--prompt", "hello", "--max-new-tokens", "8", "--json",
                                    "--tree", "auto:4"])
    assert run.exit_code == 0 and json.loads(run.output)["method"] == "medusa", run.output
    fails(["run", out, "--prompt", "hello", "--typical"], "--typical needs --temperature > 0")
    fails(["run", out, "--prompt", "hello", "--tree", "bushy"], "unknown tree")
    fails(["run", out, "--prompt", "hello", "--tree", "small_7"], "is 4 deep; there are only 3 heads")


def test_kept_prompt_beginning_copied_with_what_the_proposer_read(medusa_engine):
    """Medusa reads the target's outputs at the prompt's rows: a copied beginning gives it the kept ones, and every
    prompt emits what it emits with the beginning computed (tests/helpers.check_prefix_copied)."""
    check_prefix_copied(medusa_engine)


# ---------------------------------------------------------------------------------------------- vLLM's layout


def vllm_reference(tensors: dict, config: dict, hidden: np.ndarray) -> np.ndarray:
    """vLLM's Medusa forward (vllm/model_executor/models/medusa.py): per head, ResidualBlocks x + SiLU(W x (+ b)),
    its LM head (the one `lm_heads.0` for all with original_lm_head) times logit_scale, the truncated vocabulary's
    logits scattered to their token ids (token_map) over -inf."""
    t = {k.removeprefix("medusa_heads."): v.astype(np.float32) if v.dtype != np.int64 else v for k, v in tensors.items()}
    out = []
    for h in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            z = x @ t[f"blocks.{h}.layers.{j}.weight"].T + (t[f"blocks.{h}.layers.{j}.bias"]
                                                            if config.get("medusa_fc_bias") else 0)
            x = x + z / (1 + np.exp(-z))
        head = t["lm_heads.0.weight" if config.get("original_lm_head") else f"lm_heads.{h}.weight"]
        logits = (x @ head.T) * config.get("logit_scale", 1.0)
        if "token_map" in t:
            full = np.full((len(x), config["vocab_size"]), -np.inf, np.float32)
            full[:, t["token_map"]] = logits
            logits = full
        out.append(logits)
    return np.stack(out)


def write_vllm(folder, rng, *, bias=True, shared=False, truncated=None, prefix="", scale=1.0, layers=2):
    folder.mkdir(parents=True)
    rows = truncated or V
    tensors = {}
    for h in range(3):
        for j in range(layers):
            tensors[f"{prefix}blocks.{h}.layers.{j}.weight"] = rng.normal(0, 0.5 / H**0.5, (H, H)).astype(np.float32)
            if bias:
                tensors[f"{prefix}blocks.{h}.layers.{j}.bias"] = rng.normal(0, 0.1, H).astype(np.float32)
        if h == 0 or not shared:
            tensors[f"{prefix}lm_heads.{h}.weight"] = rng.normal(0, 1, (rows, H)).astype(np.float32)
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": 3, "num_hidden_layers": layers,
              "hidden_size": H, "vocab_size": V, "truncated_vocab_size": rows, "medusa_fc_bias": bias,
              "original_lm_head": shared, "logit_scale": scale}
    if truncated:
        tensors[f"{prefix}token_map"] = rng.choice(V, truncated, replace=False).astype(np.int64)  # in any order
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors, config


@pytest.mark.parametrize("bias, shared, truncated, prefix, scale", [
    (True, False, None, "", 1.0), (False, False, None, "medusa_heads.", 1.0), (True, True, None, "", 2.0),
    (False, False, 100, "", 0.5)])
def test_vllm_layout_reads_as_vllm_computes(tmp_path, bias, shared, truncated, prefix, scale):
    folder, tensors, config = write_vllm(tmp_path / "vllm", np.random.default_rng(7), bias=bias, shared=shared,
                                         truncated=truncated, prefix=prefix, scale=scale)
    heads = load_heads(folder)
    heads.check(H, V, "x")
    assert (heads.count, heads.layers, heads.style) == (3, 2, "own")
    hidden = np.random.default_rng(1).normal(size=(5, H)).astype(np.float32)
    want, got = vllm_reference(tensors, config, hidden), heads.numpy_forward(hidden, np.eye(V, H, dtype=np.float32))
    assert np.array_equal(np.isinf(want), np.isinf(got))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-4)


def test_vllm_layout_fused_step_equals_its_reference(tmp_path):

    model = tiny_model("llama")
    folder, _, _ = write_vllm(tmp_path / "vllm", np.random.default_rng(3), truncated=120, layers=1)
    heads = load_heads(folder)
    session, heads_session = fused_sessions(model, heads, tmp_path)
    for seed in range(3):
        run = validate.medusa_step(model, session, heads_session, heads, seed)
        assert run["fused_top10_match"] == 1.0 and run["heads_graph_top10_match"] == 1.0, run


def test_trained_heads_in_vllms_layout_run_as_ours(tiny_folder, trained, medusa_engine, tmp_path, lossless):
    """Our trained heads rewritten as vLLM writes heads that share the base's LM head (original_lm_head) over a
    truncated vocabulary (token_map): built with `build`, the same tokens and acceptance as our own files, batched
    equal to alone, sampling as plain sampling."""
    from specexport.runtime.scheduler import Scheduler

    ours = load_heads(trained[1])
    lm_head = tiny_model("llama").lm_head.weight.detach().numpy()
    subset = ours.vocab_subset if ours.vocab_subset is not None else np.arange(V)
    tensors = {"token_map": subset.astype(np.int64)[::-1].copy(), "lm_heads.0.weight": lm_head[subset[::-1]].copy()}
    for h, blocks in enumerate(ours.blocks):
        for j, (w, b) in enumerate(blocks):
            tensors[f"blocks.{h}.layers.{j}.weight"], tensors[f"blocks.{h}.layers.{j}.bias"] = w, b
    folder = tmp_path / "vllm"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": ours.count,
        "num_hidden_layers": ours.layers, "hidden_size": H, "vocab_size": V, "truncated_vocab_size": len(subset),
        "medusa_fc_bias": True, "original_lm_head": True}))
    out, shape = tmp_path / "bundle", tmp_path / "tree.json"
    shape.write_text(json.dumps([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]))
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "medusa", "--heads",
                                       str(folder), "--tree", str(shape), "--precision", "fp32", "--output", str(out)])
    assert result.exit_code == 0, result.output
    engine = Engine.load(out, threads=1)
    prompts = ["The sea wind over blue waves.", "A ship and calm night stars.", "x", "Far away quiet water."]
    runs = lossless(engine, prompts, 40)
    medusa_engine.configure(tree=str(shape))
    try:
        want = [medusa_engine.generate(p, max_new_tokens=40, stop_ids=(), budget=False) for p in prompts]
    finally:
        medusa_engine.configure()
    assert [r.tokens for r in runs] == [w.tokens for w in want]
    assert [r.stats.accepted for r in runs] == [w.stats.accepted for w in want]
    scheduler = Scheduler(engine, max_batch=3, prefill_chunk=5, budget=False, background=False)
    requests = [scheduler.submit(p, max_new_tokens=40, stop_ids=()) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in requests] == [w.tokens for w in want]
    spec, lengths = chisquare.sampled_counts(engine, "the cat", False, 1200, 0, temperature=0.4)
    plain, _ = chisquare.sampled_counts(engine, "the cat", True, 1200, 100_000, temperature=0.4)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50 and dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)
