"""EAGLE: trees as pure code on hand-worked examples, the checkpoint layouts (and what must be refused), the
training-time test against real tree drafting, both graphs against PyTorch, and the loop end to end on a tiny
model: lossless greedy, exact sampling, one-line errors from the CLI."""

import json
import pickle

import chisquare
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import TINY, TOKENIZER_VOCAB, method_export
from helpers import TRAIN, check_prefix_copied, train_tiny_eagle

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.drafts import load_draft
from specexport.exporter.eagle import DraftConfig, DraftModule, EagleDraft, save_draft
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.runtime import rank_tree, tree
from specexport.runtime.generate import Engine
from specexport.runtime.methods.eagle import CandidateTree, EagleMethod, Settings

H, V = TINY["hidden_size"], TOKENIZER_VOCAB
AUX = (0, 1, 1)  # the tiny target has 2 layers


# ------------------------------------------------------------------------------------------------ trees


def test_dynamic_tree_by_hand():
    """EAGLE-2 on paper: below the root (7), children a (-0.1), b (-1.0), c (-2.0); a's children d (-0.2), e (-0.5);
    b's child f (-0.05). Cumulative: a -0.1, b -1.0, c -2.0, d -0.3, e -0.6, f -1.05."""
    t = CandidateTree(7)
    assert t.add(0, [10, 11, 12], [-0.1, -1.0, -2.0]) == [1, 2, 3]
    assert t.top([1, 2, 3], 2) == [1, 2]  # the frontier: a and b
    assert t.add(1, [13, 14], [-0.2, -0.5]) == [4, 5]
    assert t.add(2, [15], [-0.05]) == [6]
    assert np.allclose(t.scores, [0, -0.1, -1.0, -2.0, -0.3, -0.6, -1.05])
    assert t.top([4, 5, 6], 2) == [4, 5]  # f scores below d and e although its own log-prob is the best
    assert t.cut(depth=2, drafts=4) == ([7, 10, 11, 13, 14], [-1, 0, 0, 1, 1])  # a, b, d, e below the root
    tokens, parents = t.cut(depth=2, drafts=6)
    assert tokens == [7, 10, 11, 12, 13, 14, 15] and parents == [-1, 0, 0, 0, 1, 1, 2]
    assert tree.depths(parents).tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert t.cut(depth=1, drafts=6) == ([7, 10, 11, 12], [-1, 0, 0, 0])  # a shallower run scores no depth-2 node


def test_dynamic_selection_is_ancestor_closed_with_ties():
    t = CandidateTree(0)
    t.add(0, [1, 2], [-1.0, -1.0])
    t.add(1, [3], [0.0])  # a child scoring exactly its parent: the parent still comes first
    assert t.cut(2, 2) == ([0, 1, 2], [-1, 0, 0])
    rng = np.random.default_rng(0)
    for _ in range(50):  # random trees: every selection is a tree whose parents come first
        t = CandidateTree(0)
        frontier = t.add(0, range(4), -rng.exponential(size=4))
        for _ in range(3):
            made = [c for n in frontier for c in t.add(n, range(3), -rng.exponential(size=3))]
            frontier = t.top(made, 3)
        _, parents = t.cut(4, int(rng.integers(1, len(t))))
        tree.check_parents(parents)
        assert parents[0] == -1 and -1 not in parents[1:]


def test_static_tree_by_hand():
    s = rank_tree.parse("[[0], [1], [0, 0], [0, 2], [0, 0, 1]]")
    assert (s.depth, s.size, s.top_k) == (3, 6, 3)
    assert s.parents == [-1, 0, 0, 1, 1, 3]
    assert s.ranks_below(()) == [0, 1] and s.ranks_below((0,)) == [0, 2] and s.ranks_below((1,)) == []
    assert rank_tree.parse("eagle1_25").size == 26


@pytest.mark.parametrize("spec, match", [("[[1, 0]]", "has no parent"), ("[[0], [0]]", "twice"),
                                         ("[]", "at least one path"), ("[[0], [-1]]", "ranks >= 0"),
                                         ("nope", "unknown tree"), ("[[0]", "not valid JSON")])
def test_static_tree_bad_input(spec, match):
    with pytest.raises(UserError, match=match):
        rank_tree.parse(spec)


@pytest.mark.parametrize("depth, top_k, total", [(0, 4, 8), (17, 4, 8), (3, 0, 8), (3, 11, 8), (3, 4, 1),
                                                 (2, 2, 8), (5, 4, 10_000)])
def test_dynamic_settings_bad_input(depth, top_k, total):
    with pytest.raises(UserError):
        EagleMethod.static_tree(Settings(depth=depth, top_k=top_k, total_tokens=total), 10)


# ------------------------------------------------------------------------------------------------ drafts


def tiny_config(version=3, draft_vocab=V, aux=AUX):
    return DraftConfig(version=version, hidden=H, intermediate=2 * H, heads=4, kv_heads=2, head_dim=H // 4,
                       rms_eps=1e-6, rope_theta=10000.0, vocab=V, draft_vocab=draft_vocab, target_hidden=H,
                       aux_layers=aux if version == 3 else (), fc_bias=version == 1)


def random_draft(version=3, draft_vocab=V, seed=0, scale=1.0):
    from specexport.exporter.eagle import shapes

    rng = np.random.default_rng(seed)
    c = tiny_config(version, draft_vocab)
    w = {}
    for name, shape in shapes(c).items():
        if name == "d2t":
            hot = np.sort(rng.choice(V, draft_vocab, replace=False))
            w[name] = hot - np.arange(draft_vocab)
        elif len(shape) == 1:
            w[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[name] = (rng.standard_normal(shape) * scale / shape[1] ** 0.5).astype(np.float32)
    return EagleDraft(c, w)


@pytest.mark.parametrize("version, vocab", [(3, V), (3, 64), (1, V)])
def test_layouts_round_trip(tmp_path, version, vocab):
    draft = random_draft(version, vocab)
    save_draft(draft, tmp_path / "ours")
    again = load_draft(tmp_path / "ours")
    assert again.config == draft.config
    for k, v in draft.weights.items():
        np.testing.assert_array_equal(again.weights[k], v)
    # the official pytorch_model.bin layout, read with weights_only
    from safetensors.numpy import load_file

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
    tensors = {k: torch.from_numpy(v) for k, v in load_file(tmp_path / "ours" / "model.safetensors").items()}
    tensors["embed_tokens.weight"] = torch.zeros(V, H)
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    assert load_draft(tmp_path / "bin").config == draft.config
    assert (again.hot_ids.min(), again.hot_ids.max()) >= (0, 0) and again.hot_ids.max() < V


def test_published_eagle3_config_without_aux_ids_uses_the_convention(tmp_path):
    save_draft(random_draft(3), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_draft(tmp_path, target_layers=32).config.aux_layers == (2, 16, 29)


def _edit(folder, **changes):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            tensors.pop(key)
        else:
            tensors[key] = v
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("change, match", [
    ({"fc__weight": np.zeros((H, 2 * H), np.float32)}, "has shape"),
    ({"midlayer__mlp__up_proj__weight": None}, "lacks 'midlayer.mlp.up_proj.weight'"),
    ({"extra__weight": np.zeros(3, np.float32)}, "unexpected tensors"),
    ({"d2t": np.full(64, V, np.int64)}, "out of 0.."),
    ({"d2t": np.zeros(63, np.int64)}, "'d2t' has shape"),
])
def test_bad_checkpoints_are_refused(tmp_path, change, match):
    save_draft(random_draft(3, 64), tmp_path)
    _edit(tmp_path, **change)
    with pytest.raises(UserError, match=match):
        load_draft(tmp_path)


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (exec, ("open('/tmp/specexport-pwned', 'w')",))

    save_draft(random_draft(1), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": Evil()}))
    with pytest.raises(UserError, match="refusing pytorch_model.bin"):
        load_draft(tmp_path)


def test_draft_must_fit_the_target():
    from dataclasses import replace

    from specexport.exporter.arch import Dims

    dims = Dims("llama", V, H, 2 * H, 2, 4, 2, 16, 1e-6, 128, False, "default")
    random_draft(3).check(dims, "d")
    for bad, match in [(replace(dims, hidden=2 * H), "hidden size"), (replace(dims, vocab=V + 1), "vocabulary"),
                       (replace(dims, layers=1), "out of range")]:
        with pytest.raises(UserError, match=match):
            random_draft(3).check(bad, "d")


# ------------------------------------------------------------------------------------------- the module


@pytest.mark.parametrize("version", [3, 1])
def test_training_time_test_equals_drafting_a_chain(version):
    """Step i of the unrolled training at index t must give what drafting does at run time: pairs 0..t in the
    cache, then a chain of i nodes each fed its parent's output hidden, at positions t+1..t+i."""
    from specexport.train.eagle import ttt_forward

    torch.manual_seed(0)
    draft = random_draft(version)
    embed, head = torch.randn(V, H), torch.randn(V, H) / H**0.5
    m = DraftModule.from_draft(draft, embed, head)
    n, steps = 12, 4
    feats = torch.randn(1, n, draft.config.feature_size)
    ids = torch.randint(0, V, (1, n))
    with torch.no_grad():
        outs = ttt_forward(m, feats, ids, torch.arange(n)[None], steps)
        for t in (3, 7):
            first = m.start(feats[:, :t + 1])
            bias = torch.from_numpy(tree.attention_bias(tree.chain(t + 1), 0))
            hidden, logits, past = m.step(ids[:, 1:t + 2], first, torch.arange(t + 1)[None], bias)
            h = hidden[:, -1:]
            np.testing.assert_allclose(outs[0][1][0, t].numpy(), logits[0, -1].numpy(), atol=1e-4)
            for i in range(1, steps):
                if t + 1 + i >= n:
                    break
                bias = torch.from_numpy(tree.attention_bias(tree.chain(i).tolist(), t + 1))[..., -1:, :]
                h, logits, past = m.step(ids[:, t + 1 + i:t + 2 + i], h, torch.tensor([[t + i]]), bias, past)
                np.testing.assert_allclose(outs[i][1][0, t].numpy(), logits[0, -1].numpy(), atol=1e-4)


# ------------------------------------------------------------------------------------------------ training


EAGLE3 = dict(draft_vocab=128, aux_layers=AUX)


def train_eagle(folder, output, data, method="eagle3", resume=False, **settings):
    """An EAGLE draft (`method` eagle3 or eagle) for the tiny model at `folder`, with TRAIN's settings and these."""
    return train_tiny_eagle(folder, output, data, method, resume, **{**(EAGLE3 if method == "eagle3" else {}),
                                                                     **settings})


@pytest.fixture(scope="module")
def trained(tiny_folder, sharegpt, tmp_path_factory):
    """An EAGLE-3 draft trained on the tiny model's own continuations (seconds): (training.json, folder)."""
    out = tmp_path_factory.mktemp("trained") / "eagle3"
    return train_eagle(tiny_folder, out, sharegpt, steps=120), out


def test_training_learns_and_writes_the_published_layout(trained):
    summary, folder = trained
    draft = load_draft(folder)
    assert draft.config.version == 3 and draft.config.draft_vocab == 128 and draft.config.aux_layers == AUX
    assert np.mean(summary["losses"][-10:]) < 0.7 * np.mean(summary["losses"][:3])
    assert summary["accuracy"][0]["top1"] > 0.3  # the tiny model's continuations are easy to predict
    assert summary["accuracy"][0]["chain"] >= summary["accuracy"][1]["chain"]


def test_training_resumes_exactly(tiny_folder, sharegpt, tmp_path):
    args = dict(samples=16, steps=6, save_every=2)
    whole = train_eagle(tiny_folder, tmp_path / "whole", sharegpt, **args)
    first = train_eagle(tiny_folder, tmp_path / "part", sharegpt, minutes=1e-9, **args)
    assert first["steps"] == 1
    with pytest.raises(UserError, match="aux_layers=.0, 1, 1., not .1, 1, 1."):
        train_eagle(tiny_folder, tmp_path / "part", sharegpt, resume=True, **{**args, "aux_layers": (1, 1, 1)})
    again = train_eagle(tiny_folder, tmp_path / "part", sharegpt, resume=True, **args)
    assert again["steps"] == 6 and again["losses"] == whole["losses"]


def test_training_bad_input(tiny_folder, sharegpt, tmp_path):
    with pytest.raises(UserError, match="--ttt-steps"):
        train_eagle(tiny_folder, tmp_path / "x", sharegpt, ttt_steps=0)
    with pytest.raises(UserError, match="--aux-layers"):
        train_eagle(tiny_folder, tmp_path / "x", sharegpt, aux_layers=(0, 5, 1))
    with pytest.raises(UserError, match="--draft-vocab must be in 1..259, got 0"):
        train_eagle(tiny_folder, tmp_path / "x", sharegpt, draft_vocab=0)
    fails(["train", "--method", "eagle3", "--model", tiny_folder, "--output", tmp_path / "z", "--heads", "2"],
          "--heads does not apply to --method eagle3")
    fails(["train", "--method", "eagle", "--model", tiny_folder, "--output", tmp_path / "z", "--draft-vocab", "9"],
          "--draft-vocab does not apply to --method eagle")


# ------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def eagle_engine(tiny_folder, trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    options = ExportOptions(graph=GraphOptions(), max_context=128, optimize=True,
                            **method_export("eagle3", draft=str(trained[1]), depth=3, top_k=3, total_tokens=8))
    manifest = export_bundle(str(tiny_folder), root / "bundle", options, quiet=True)
    e = manifest["numerics"]["eagle"]
    assert e["feature_max_abs_diff"] < 1e-3 and e["draft_max_abs_diff"] < 1e-3 and e["draft_topk_match"] == 1.0
    return Engine.load(root / "bundle", threads=1)


@pytest.mark.parametrize("settings", [{}, {"depth": 1, "top_k": 1, "total_tokens": 2},
                                      {"depth": 4, "top_k": 4, "total_tokens": 20}, {"tree": "chain_5"},
                                      {"tree": "eagle1_25"}])
def test_greedy_eagle_is_lossless(eagle_engine, settings, lossless):
    eagle_engine.configure(**settings)
    try:
        runs = lossless(eagle_engine, ["The sea wind over blue waves.", "A ship and calm night stars.", "x",
                                       "Far away quiet water."], 40)
        assert max(r.stats.tau for r in runs) > 1.2  # drafts were accepted
    finally:
        eagle_engine.configure()


def test_constrained_greedy_eagle_is_lossless(eagle_engine, constrained):
    """Structured output on EAGLE's scored trees: the forbidden candidates cut, each row masked on its path."""
    ended, _ = constrained(eagle_engine, ["The sea wind over blue waves.", "x", '{"a": "x", "b": true}'], 40)
    assert ended >= 3


def test_eagle_1_end_to_end(tiny_folder, sharegpt, tmp_path):
    train_eagle(tiny_folder, tmp_path / "e1", sharegpt, method="eagle", steps=40)
    options = ExportOptions(graph=GraphOptions(), max_context=128,
                            **method_export("eagle", draft=str(tmp_path / "e1"), depth=3, top_k=2, total_tokens=6))
    manifest = export_bundle(str(tiny_folder), tmp_path / "bundle", options, quiet=True)
    assert manifest["numerics"]["eagle"]["draft_topk_match"] == 1.0
    engine = Engine.load(tmp_path / "bundle", threads=1)
    for prompt in ["The sea wind.", "x"]:
        assert engine.generate(prompt, max_new_tokens=30, stop_ids=()).tokens == \
            engine.generate(prompt, max_new_tokens=30, stop_ids=(), plain=True).tokens


def test_eagle_sampling_follows_plain_sampling(eagle_engine):
    spec, lengths = chisquare.sampled_counts(eagle_engine, "the cat", False, 1500, 0, temperature=0.4)
    plain, _ = chisquare.sampled_counts(eagle_engine, "the cat", True, 1500, 100_000, temperature=0.4)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50  # the speculative path was exercised
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)


# -------------------------------------------------------------------------------------------------- CLI


def fails(args, match):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert match in result.stderr.strip().splitlines()[-1], result.output


def test_cli_bad_input(tiny_folder, trained, tmp_path):
    out = tmp_path / "bundle"
    base = ["build", "--model", tiny_folder, "--output", out, "--precision", "fp32"]
    fails(base + ["--method", "eagle3", "--draft", trained[1], "--depth", "0"], "--depth must be in 1..16")
    fails(base + ["--method", "eagle3", "--draft", trained[1], "--draft-top-k", "50"], "--draft-top-k must be in 1..10")
    fails(base + ["--method", "eagle3", "--draft", trained[1], "--total-tokens", "100000"], "--total-tokens must be")
    fails(base + ["--method", "eagle", "--draft", trained[1]], "is an EAGLE-3 draft: use --method eagle3")
    fails(base + ["--method", "medusa", "--draft", trained[1]], "--draft does not apply to --method medusa")
    fails(base + ["--method", "eagle3", "--draft", tmp_path / "missing"], "not found")
    wrong = tmp_path / "wrong"
    d = random_draft(3)
    d.config.target_hidden, d.weights["fc"] = 2 * H, np.zeros((H, 6 * H), np.float32)
    save_draft(d, wrong)
    fails(base + ["--method", "eagle3", "--draft", wrong], "hidden size")
    far = tmp_path / "far"
    save_draft(random_draft(3), far)
    config = json.loads((far / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    (far / "config.json").write_text(json.dumps(config))
    fails(base + ["--method", "eagle3", "--draft", far], "out of range")
    assert not out.exists() and not list(tmp_path.glob("bundle*"))


def test_cli_run_overrides(eagle_engine, tmp_path):
    bundle = eagle_engine.bundle.path
    result = CliRunner().invoke(main, ["run", str(bundle), "--prompt", "the sea", "--max-new-tokens", "8", "--json",
                                       "--depth", "2", "--draft-top-k", "2", "--total-tokens", "5"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["tokens"]) == 8
    fails(["run", bundle, "--prompt", "x", "--total-tokens", "1"], "--total-tokens must be in 2..")
    fails(["run", bundle, "--prompt", "x", "--tree", "[[3, 1]]"], "has no parent")


def test_eagle3_with_layers0_keys_loads(tmp_path):
    """SpecForge-style EAGLE-3 exports name the layer layers.0.* (with its hidden_norm) instead of midlayer.*."""
    from safetensors.numpy import load_file, save_file

    draft = random_draft(3, 64)
    save_draft(draft, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    again = load_draft(tmp_path)
    assert again.config.version == 3 and again.config.producer == "specexport"
    np.testing.assert_array_equal(again.weights["hidden_norm"], draft.weights["hidden_norm"])


def test_half_precision_drafts_load(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = random_draft(3, 64)
    save_draft(draft, tmp_path / "fp16", half=True)
    np.testing.assert_allclose(load_draft(tmp_path / "fp16").weights["layers.0.q"], draft.weights["layers.0.q"], rtol=1e-3, atol=1e-3)
    save_draft(draft, tmp_path / "bf16")
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()},
              tmp_path / "bf16" / "model.safetensors")
    np.testing.assert_allclose(load_draft(tmp_path / "bf16").weights["layers.0.q"], draft.weights["layers.0.q"], rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------- profile


def test_accept_length_from_a_recorded_tree():
    """The tree of test_dynamic_tree_by_hand; the target emitted 10, 14, 99 after the root. The tuner replays a
    smaller setting with the proposer's own cut and the runtime's acceptance rule."""
    from specexport.tune.measure import replay

    t = CandidateTree(7)
    t.add(0, [10, 11, 12], [-0.1, -1.0, -2.0])
    t.add(1, [13, 14], [-0.2, -0.5])
    t.add(2, [15], [-0.05])

    def accept_length(t, emitted, depth, total):
        return replay(*t.cut(depth, total - 1), emitted)

    assert accept_length(t, [10, 14, 99], depth=2, total=6) == 3  # 10 and 14 accepted, then the bonus
    assert accept_length(t, [10, 14, 99], depth=1, total=6) == 2  # no depth-2 node at depth 1
    assert accept_length(t, [10, 14, 99], depth=2, total=4) == 3  # the 3 best: 10, 13, 14
    assert accept_length(t, [10, 14, 99], depth=2, total=3) == 2  # the 2 best: 10, 13
    assert accept_length(t, [11, 15], depth=2, total=7) == 3 and accept_length(t, [12], depth=2, total=7) == 2
    assert accept_length(t, [12], depth=2, total=6) == 1  # 12 (-2.0) is the worst of the six


def test_profile_command_chooses_eagle_settings(eagle_engine, tiny_folder, trained, tmp_path):
    from specexport.profiles import load_profile

    out = tmp_path / "measured.toml"
    result = CliRunner().invoke(main, ["profile", str(eagle_engine.bundle.path), "--output", str(out), "--base",
                                       "cpu-2core", "--new-tokens", "12", "--max-tokens", "16", "--contexts", "16",
                                       "--reps", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "chosen depth" in result.output and "prediction error" in result.output
    assert "build default" in result.output  # the preset it was measured against
    profile = load_profile(out)
    chosen = profile.methods["eagle"]
    assert 1 <= chosen.depth <= 7 and chosen.total_tokens <= 16
    report = (tmp_path / "measured-report" / "report.md").read_text()
    assert "EAGLE draft call" in report and "## Trees side by side" in report
    built = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "eagle3", "--draft",
                                      str(trained[1]), "--profile", str(out), "--output", str(tmp_path / "c"),
                                      "--no-validate"])
    assert built.exit_code == 0, built.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert (manifest["method"]["depth"], manifest["method"]["top_k"], manifest["method"]["total_tokens"]) == \
        (chosen.depth, chosen.top_k, chosen.total_tokens)


def test_warm_restart_carries_the_training_on(tiny_folder, sharegpt, trained, tmp_path, monkeypatch):
    """--init starts from a draft's weights and vocabulary; token-passes, time and the accuracy curve add up.

    The training loop's clock is a fake one that ticks a second per reading, so each of the 4 steps takes exactly
    1.0 s whatever the CPU's speed (on a real clock 4 tiny steps can take < 0.05 s, which rounds to nothing)."""
    import types

    import specexport.train.loop as loop

    ticks = iter(range(10**6))
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    first, folder = trained
    again = train_eagle(tiny_folder, tmp_path / "again", sharegpt, steps=4, init=folder)
    before, after = first["training"], again["training"]
    assert before["token_passes"] > 0 and len(before["curve"]) >= 1
    assert again["steps"] == 4 and again["seconds"] == 4.0  # this run's own steps and (fake) time
    assert 0 < after["token_passes"] - before["token_passes"] <= 4 * TRAIN["batch"] * (64 + 32)  # 4 steps more
    assert after["seconds"] == pytest.approx(before["seconds"] + 4.0)  # the earlier time carried on, not restarted
    assert after["curve"][:len(before["curve"])] == before["curve"] and len(after["curve"]) > len(before["curve"])
    assert after["curve"][-1]["token_passes"] == after["token_passes"]
    assert after["curve"][-1]["seconds"] == pytest.approx(before["seconds"] + 4.0)
    assert load_draft(tmp_path / "again").meta["training"] == after  # saved with the draft, for the next restart
    np.testing.assert_array_equal(load_draft(tmp_path / "again").hot_ids, load_draft(folder).hot_ids)
    with pytest.raises(UserError, match="is an EAGLE-3 draft, not EAGLE-1"):
        train_eagle(tiny_folder, tmp_path / "wrong", sharegpt, method="eagle", steps=1, init=folder)


def test_feature_mix_spreads_the_share_of_continuations():
    from specexport.train.data import feature_groups

    class Words:  # a tokenizer that is enough for first_prompts and the windows
        chat_template, eos_token = None, ""

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    conversations = [{"conversations": [{"from": "human", "value": f"prompt {i}"},
                                        {"from": "gpt", "value": f"answer {i} " * 4}]} for i in range(40)]
    settings = {"data": "self", "prompt_tokens": 16, "new_tokens": 8, "feature_batch": 2}
    kinds = [kind for kind, _ in feature_groups(Words(), conversations, 16, 0, settings, share=0.25)]
    assert kinds == ["text", "text", "text", "self"] * 2
    assert {k for k, _ in feature_groups(Words(), conversations, 6, 0, settings)} == {"self"}


def test_each_checkpoint_leaves_an_fp16_draft_to_carry_on_from(trained):
    """OUTPUT/latest: the draft at the last checkpoint in fp16, loadable and warm-restartable (a long training outlives
    a session through it)."""
    summary, folder = trained
    latest = load_draft(folder / "latest")
    assert latest.config.version == 3 and latest.meta["training"]["token_passes"] == summary["training"]["token_passes"]
    np.testing.assert_allclose(latest.weights["layers.0.q"], load_draft(folder).weights["layers.0.q"], atol=2e-3)


@pytest.mark.parametrize("settings", [{}, {"tree": "eagle1_25"}])
def test_batched_eagle_drafts_together_and_keeps_batch_one_tokens(eagle_engine, settings):
    """Six requests on three slots, EAGLE's draft calls made together (runtime/drafting.together): every request
    emits its batch-1 tokens, and the draft graph ran fewer calls than the requests' batch-1 runs did (every tree
    whole both ways: the drafting governor's choices depend on the machine's speed)."""
    from specexport.runtime.scheduler import Scheduler

    prompts = ["The sea wind over blue waves.", "A ship and calm night stars.", "x", "Far away quiet water.", "abab",
               "The sea wind. " * 7]  # the last one runs into the context limit (128)
    lengths = [30, 12, 25, 40, 7, 60]
    eagle_engine.configure(**settings)
    try:
        draft = eagle_engine.graph("draft")
        before = draft.calls
        want = [eagle_engine.generate(p, max_new_tokens=n, stop_ids=(), budget=False) for p, n in zip(prompts, lengths)]
        alone = draft.calls - before
        scheduler = Scheduler(eagle_engine, max_batch=3, prefill_chunk=4, budget=False, background=False)
        before = draft.calls
        requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(prompts, lengths)]
        scheduler.run_until_idle()
        assert [r.result().tokens for r in requests] == [w.tokens for w in want]
        assert want[-1].stop_reason == "context"
        assert scheduler.draft_pool is not None and draft.calls - before < alone
    finally:
        eagle_engine.configure()


def test_kept_prompt_beginning_copied_with_what_the_proposer_read(eagle_engine):
    """EAGLE-3 reads the target's outputs at the prompt's rows: a copied beginning gives it the kept ones, and every
    prompt emits what it emits with the beginning computed (tests/helpers.check_prefix_copied)."""
    check_prefix_copied(eagle_engine)
