"""`--method dflash`: a block draft in z-lab's layout (dflash/model.py: config.json with `dflash_config
{mask_token_id, target_layer_ids}` and `block_size`, Qwen3 keys; model.safetensors with `fc`, `hidden_norm`,
`norm`, `layers.{i}.*` of Qwen3 decoder layers, bf16, no embeddings or LM head), trained here for a tiny Qwen3 with
a reference forward written from z-lab's model.py: the context is hidden_norm(fc(cat(the target's layer outputs))),
the block [last token, mask x (B - 1)] attends to the context rows' keys and values and to itself without a mask,
and the target's LM head scores block rows 1..B-1. The bundle's graphs must equal that reference; greedy output
equals plain decoding (chains and trees), batched equals alone, sampling follows plain sampling."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import save_folder, tiny_model
from helpers import check_batched_and_sampled, greedy_sequences
from safetensors.torch import save_file

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.dflash import load_dflash
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine
from specexport.runtime.methods.dflash import best_paths

LAYERS, BLOCK, MASK = 4, 4, 258
OUTPUTS = [0, 2]  # z-lab's target_layer_ids: layer outputs
PROMPTS = ["The sea wind over blue waves.", "A ship and calm night stars.", "x", "Far away quiet water."]


class ZlabDFlash(torch.nn.Module):
    """z-lab's DFlashDraftModel forward, in plain torch: per layer, queries from the block (q_norm, RoPE at its
    positions), keys and values from cat(context, block) (k_norm, RoPE over all positions), no mask; residual
    pre-norm Qwen3 layers; the final norm; the target's LM head over block rows 1..B-1."""

    def __init__(self, config, layers=2):
        super().__init__()
        h, self.heads, self.kv, self.hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, \
            config.head_dim
        self.eps, self.theta = config.rms_norm_eps, config.rope_parameters["rope_theta"]
        g = torch.Generator().manual_seed(5)

        def lin(o, i):
            return torch.nn.Parameter(torch.randn(o, i, generator=g) / i ** 0.5)

        def norm(n):
            return torch.nn.Parameter(torch.ones(n))

        self.p = {"fc.weight": lin(h, h * len(OUTPUTS)), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
        for i in range(layers):
            a = f"layers.{i}."
            self.p.update({a + "self_attn.q_proj.weight": lin(self.heads * self.hd, h),
                           a + "self_attn.k_proj.weight": lin(self.kv * self.hd, h),
                           a + "self_attn.v_proj.weight": lin(self.kv * self.hd, h),
                           a + "self_attn.o_proj.weight": lin(h, self.heads * self.hd),
                           a + "self_attn.q_norm.weight": norm(self.hd), a + "self_attn.k_norm.weight": norm(self.hd),
                           a + "input_layernorm.weight": norm(h), a + "post_attention_layernorm.weight": norm(h),
                           a + "mlp.gate_proj.weight": lin(2 * h, h), a + "mlp.up_proj.weight": lin(2 * h, h),
                           a + "mlp.down_proj.weight": lin(h, 2 * h)})
        self.layers = layers
        self.registered = torch.nn.ParameterList(self.p.values())  # z-lab's names have dots, which modules' keys may not

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, pos):
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = pos.float()[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = self.hd // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def context(self, states):
        """ctx [S, h] from the target's hidden_states tuple (index i + 1: the output of layer i)."""
        return self.rms(torch.cat([states[i + 1][0] for i in OUTPUTS], -1) @ self.p["fc.weight"].T,
                        self.p["hidden_norm.weight"])

    def forward(self, ctx, emb, start):
        """Log-probs' logits source: the block's normed output [B, h] after context rows ctx [start, h]."""
        p, b, s = self.p, emb.shape[0], ctx.shape[0]
        pos_q, pos_k = torch.arange(start, start + b), torch.cat([torch.arange(s), torch.arange(start, start + b)])
        h = emb
        for i in range(self.layers):
            a = f"layers.{i}."
            x = self.rms(h, p[a + "input_layernorm.weight"])
            q = self.rms((x @ p[a + "self_attn.q_proj.weight"].T).view(b, self.heads, self.hd), p[a + "self_attn.q_norm.weight"])
            src = torch.cat([ctx, x])
            k = self.rms((src @ p[a + "self_attn.k_proj.weight"].T).view(-1, self.kv, self.hd), p[a + "self_attn.k_norm.weight"])
            v = (src @ p[a + "self_attn.v_proj.weight"].T).view(-1, self.kv, self.hd)
            q, k = self.rope(q.transpose(0, 1), pos_q), self.rope(k.transpose(0, 1), pos_k)
            rep = self.heads // self.kv
            k, v = k.repeat_interleave(rep, 0), v.transpose(0, 1).repeat_interleave(rep, 0)
            attn = ((q @ k.transpose(-1, -2)) / math.sqrt(self.hd)).softmax(-1) @ v
            h = h + attn.transpose(0, 1).reshape(b, -1) @ p[a + "self_attn.o_proj.weight"].T
            y = self.rms(h, p[a + "post_attention_layernorm.weight"])
            gate, up = y @ p[a + "mlp.gate_proj.weight"].T, y @ p[a + "mlp.up_proj.weight"].T
            h = h + (torch.nn.functional.silu(gate) * up) @ p[a + "mlp.down_proj.weight"].T
        return self.rms(h, p["norm.weight"])


def train(model, draft, sequences, steps=600):
    """Blocks at random anchors of the target's own continuations: block row k learns the target's token at
    anchor + k (cross-entropy, weights decaying with k), the context being the rows before the anchor."""
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    weights = torch.tensor([math.exp(-(k - 1) / 4) for k in range(1, BLOCK)])
    for step in range(steps):
        ids = sequences[step % len(sequences)]
        a = int(rng.integers(4, len(ids) - BLOCK))
        with torch.no_grad():
            states = model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
            emb = model.model.embed_tokens(torch.tensor([int(ids[a])] + [MASK] * (BLOCK - 1)))
        out = draft(draft.context(states)[:a], emb, a)
        logits = model.lm_head(out[1:])
        loss = (torch.nn.functional.cross_entropy(logits, ids[a + 1:a + BLOCK], reduction="none") * weights).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    return model, save_folder(model, tmp_path_factory.mktemp("models") / "tiny-qwen3")


def write_zlab(folder, draft: ZlabDFlash, config):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16) for k, v in draft.p.items()}, str(folder / "model.safetensors"))
    keys = {k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                                            "max_position_embeddings")}
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        **keys, "intermediate_size": 2 * config.hidden_size, "num_hidden_layers": draft.layers,
        "rope_theta": draft.theta, "attention_bias": False, "block_size": BLOCK, "num_target_layers": LAYERS,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": OUTPUTS}, "torch_dtype": "bfloat16"}, indent=2))
    for name, value in load_safetensors_float(folder).items():  # the reference from the stored bf16 weights
        draft.p[name].data = value
    return folder


def load_safetensors_float(folder):
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def prompt_ids(folder, prompt: str) -> list[int]:
    """The ids Engine.encode gives a prompt with the model's tokenizer."""
    from specexport.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    return tok.encode_chat([{"role": "user", "content": prompt}]) if tok.has_chat_template else tok.encode(prompt)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    model, folder = target
    torch.manual_seed(0)
    # the target's greedy continuations of the prompts the tests run: what a block learns
    sequences = greedy_sequences(model, [prompt_ids(folder, p) for p in PROMPTS + ["the cat"]], 40)
    draft = train(model, ZlabDFlash(model.config), sequences)
    return write_zlab(tmp_path_factory.mktemp("drafts") / "dflash", draft, model.config), draft.eval()


def build(folder, draft, out, *more):
    result = CliRunner().invoke(main, ["build", "--model", str(folder), "--method", "dflash", "--draft", str(draft),
                                       "--precision", "fp32", "--output", str(out), *more])
    assert result.exit_code == 0, result.output
    return out


def test_reads_zlabs_layout(trained):
    read = load_dflash(trained[0], LAYERS)
    c = read.config
    assert (c.block, c.mask_token, c.target_layers, c.layers, c.producer) == (BLOCK, MASK, (1, 3), 2, "z-lab")


def test_graphs_equal_the_reference(target, trained, tmp_path):
    check_graphs(target[0], build(target[1], trained[0], tmp_path / "bundle"), trained[1])


def check_graphs(model, bundle, ref, head=None, hot=None):
    """The bundle's target graph gives the reference's context rows, and its draft graph, called twice (the first
    call's context rows cached), the reference's top log-probs and tokens: over the target's LM head, or over a draft
    head `head` whose row i is target token hot[i]."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    numerics = manifest["numerics"]["dflash"]
    assert numerics["draft_topk_match"] == 1.0, numerics
    graphs = manifest["graphs"]
    session = GraphSession(bundle / graphs["target"]["file"], graphs["target"], threads=1, device="cpu")
    draft = GraphSession(bundle / graphs["draft"]["file"], graphs["draft"], threads=1, device="cpu")
    ids = np.random.default_rng(1).integers(3, 250, 14)
    n = len(ids)
    ctx = session.forward(session.new_cache(n + 4), ids[None], np.arange(n)[None], tree.causal_mask(n),
                          np.array([n - 1]), want=("dflash_context",))["dflash_context"][0]
    with torch.no_grad():
        states = model.model(input_ids=torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states
        want_ctx = ref.context(states)
    np.testing.assert_allclose(ctx, want_ctx.numpy(), atol=1e-4)
    cache, fed = draft.new_cache(n + 2 * BLOCK), 0
    for upto in (6, 11):  # two steps: the first's context rows stay cached
        m = upto - fed
        block = [int(ids[upto])] + [MASK] * (BLOCK - 1)
        mask = np.tril(np.ones((m + BLOCK, m + BLOCK), bool))
        mask[m:] = True
        got = draft.forward(cache, np.array([list(ids[fed:upto]) + block]), (fed + np.arange(m + BLOCK))[None], mask,
                            np.arange(m + 1, m + BLOCK), want=("draft_logp", "draft_tokens"),
                            inputs={"context": np.concatenate([ctx[fed:upto], np.zeros((BLOCK, ctx.shape[1]))])[None]
                                    .astype(np.float32), "context_rows": (np.arange(m + BLOCK) < m)[None]})
        cache.advance(m)
        fed = upto
        with torch.no_grad():
            out = ref(want_ctx[:upto], model.model.embed_tokens(torch.tensor(block)), upto)
            logits = model.lm_head(out[1:]) if head is None else out[1:] @ head.T
            top = torch.log_softmax(logits, -1).topk(got["draft_tokens"].shape[1], -1)
        np.testing.assert_allclose(got["draft_logp"], top.values.numpy(), atol=1e-4)
        tokens = top.indices.numpy() if hot is None else hot[top.indices.numpy()]
        assert (got["draft_tokens"] == tokens).all()


@pytest.mark.parametrize("settings", [[], ["--draft-top-k", "2", "--total-tokens", "6"]])
def test_dflash_is_lossless_batched_and_samples_as_plain(target, trained, tmp_path, lossless, settings):
    bundle = build(target[1], trained[0], tmp_path / "bundle", *settings)
    engine = Engine.load(bundle, threads=1)
    runs = lossless(engine, PROMPTS, 32)
    assert max(r.stats.tau for r in runs) > 1.3  # the trained block's drafts are accepted
    check_batched_and_sampled(engine, PROMPTS, 32, [r.tokens for r in runs], temperature=0.3)


def test_best_paths_by_hand():
    """Two positions, two candidates each: log-probs -0.1/-2 then -0.2/-0.5; three drafts take the best paths
    (a: -0.1, a.c: -0.3, a.d: -0.6), not b (-2)."""
    tokens, logps = np.array([[10, 11], [20, 21]]), np.array([[-0.1, -2.0], [-0.2, -0.5]])
    t = best_paths(5, tokens, logps, 3)
    assert (t.tokens, t.parents) == ([5, 10, 20, 21], [-1, 0, 1, 1])
    chain = best_paths(5, tokens[:, :1], logps[:, :1], 2)
    assert (chain.tokens, chain.parents) == ([5, 10, 20], [-1, 0, 1])


def test_bad_drafts_are_one_line(target, trained, tmp_path):
    config = json.loads((trained[0] / "config.json").read_text())
    for change, match in ((lambda c: c["dflash_config"].update(target_layer_ids=[0, LAYERS - 1]), "out of range"),
                          (lambda c: c["dflash_config"].update(mask_token_id=100000), "mask_token_id"),
                          (lambda c: c.pop("dflash_config"), "not a DFlash draft")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((trained[0] / "model.safetensors").read_bytes())
        edited = json.loads(json.dumps(config))
        change(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        result = CliRunner().invoke(main, ["build", "--model", str(target[1]), "--method", "dflash", "--draft",
                                           str(bad), "--output", str(tmp_path / "out")])
        assert result.exit_code == 1 and match in result.stderr.strip().splitlines()[-1], result.output
        assert not (tmp_path / "out").exists()
    from specexport.exporter.methods.dflash import DFlashPlan, Options
    from specexport.exporter.methods.plan import Target
    from specexport.runtime.methods.dflash import Settings

    with pytest.raises(UserError, match="no DFlash draft shipped for t: pass --draft PATH"):
        DFlashPlan(Options(), Settings(), Target("t", None))
    with pytest.raises(UserError, match="DFlash draft .*nowhere not found"):
        DFlashPlan(Options(draft=str(tmp_path / "nowhere")), Settings(), Target("t", None))


def test_profile_chooses_dflash_settings_that_build_reads(target, trained, tmp_path):
    from specexport.profiles import load_profile

    bundle = build(target[1], trained[0], tmp_path / "bundle")
    out = tmp_path / "measured.toml"
    result = CliRunner().invoke(main, ["profile", str(bundle), "--output", str(out), "--base", "cpu-2core",
                                       "--new-tokens", "12", "--max-tokens", "8", "--contexts", "16", "--reps", "2",
                                       "--threads", "1"])
    assert result.exit_code == 0, result.output
    chosen = load_profile(out).methods["dflash"]
    assert 1 <= chosen.depth <= BLOCK - 1 and 1 <= chosen.top_k and chosen.total_tokens <= 8
    built = CliRunner().invoke(main, ["build", "--model", str(target[1]), "--method", "dflash", "--draft",
                                      str(trained[0]), "--profile", str(out), "--output", str(tmp_path / "c"),
                                      "--no-validate"])
    assert built.exit_code == 0, built.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert (manifest["method"]["depth"], manifest["method"]["top_k"], manifest["method"]["total_tokens"]) == \
        (chosen.depth, chosen.top_k, chosen.total_tokens)


# ------------------------------------------------------------------------------------ specexport train --method dflash


def test_blocks_at_many_anchors_equal_one_block_at_a_time(trained, target):
    """What training runs (many blocks of a sequence in one call, under a block-diagonal mask) equals what the graphs
    are checked against (one block after exactly the context rows before its anchor)."""
    from specexport.exporter.dflash import DFlashModule

    model = target[0]
    module = DFlashModule(load_dflash(trained[0], LAYERS), model.model.embed_tokens.weight.detach(),
                          model.lm_head.weight.detach())
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(2, 12, model.config.hidden_size, generator=g)
    anchors = torch.tensor([[3, 9, 5], [1, 11, 7]])
    ids = torch.randint(3, 250, (2, 3, BLOCK), generator=g)
    with torch.no_grad():
        many = torch.log_softmax(module.blocks(ctx, ids, anchors)[:, :, 1:] @ module.lm_head.T, -1)
        for n in range(2):
            for a in range(3):
                one = module.block(ctx[n], ids[n, a], int(anchors[n, a]))
                torch.testing.assert_close(many[n, a], one, atol=1e-5, rtol=1e-5)


def train_args(target, data, out, *more):
    return ["train", "--method", "dflash", "--model", str(target[1]), "--data", str(data), "--output", str(out),
            "--block", str(BLOCK), "--gamma", "3", "--samples", "32", "--new-tokens", "24", "--self-share", "1",
            "--batch", "8", "--anchors", "6", "--lr", "3e-3", "--threads", "1", *more]


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    from helpers import write_sharegpt

    return write_sharegpt(tmp_path_factory.mktemp("data") / "sharegpt.json", train=32)


def test_train_writes_zlabs_layout_that_learns_and_builds_lossless(target, sharegpt, tmp_path, lossless):
    untrained = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "d0", "--steps", "0"))
    assert untrained.exit_code == 0, untrained.output
    result = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "d", "--steps", "150",
                                                 "--context-layers", "0,2"))
    assert result.exit_code == 0, result.output
    assert "dflash draft written to" in result.output and "a chain of top-1 tokens: tau" in result.output
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]  # z-lab's meaning: layer outputs
    read = load_dflash(tmp_path / "d", LAYERS)
    assert (read.config.target_layers, read.config.layers, read.config.block) == ((1, 3), 1, BLOCK)
    before = json.loads((tmp_path / "d0" / "training.json").read_text())
    after = json.loads((tmp_path / "d" / "training.json").read_text())
    assert after["losses"][-1] < after["losses"][0] and after["accuracy"][0]["top1"] > before["accuracy"][0]["top1"]
    assert after["chain_tau"] > before["chain_tau"]
    bundle = build(target[1], tmp_path / "d", tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["numerics"]["dflash"]["draft_topk_match"] == 1.0
    lossless(Engine.load(bundle, threads=1), PROMPTS, 24)


def test_train_resumes_exactly_and_bad_settings_are_one_line(target, sharegpt, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    import specexport.train.dflash as td

    whole = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "whole", "--steps", "6",
                                                "--save-every", "3"))
    assert whole.exit_code == 0, whole.output
    calls, real = {"n": 0}, td.block_loss

    def crash_at_step_5(*args):  # Ctrl-C during the 5th step: the checkpoint of step 3 remains
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(td, "block_loss", crash_at_step_5)
    crashed = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "resumed", "--steps", "6",
                                                  "--save-every", "3"))
    assert crashed.exit_code != 0
    monkeypatch.setattr(td, "block_loss", real)
    resumed = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "resumed", "--steps", "6",
                                                  "--save-every", "3", "--resume"))
    assert resumed.exit_code == 0, resumed.output
    a, b = (json.loads((tmp_path / d / "training.json").read_text()) for d in ("whole", "resumed"))
    assert a["losses"] == b["losses"] and a["accuracy"] == b["accuracy"]
    wa, wb = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("whole", "resumed"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    for bad, match in ((["--block", "1"], "--block must be in 2..64"),
                       (["--context-layers", f"0,{LAYERS - 1}"], "--context-layers"),
                       (["--mask-token", "-1"], "--mask-token"), (["--gamma", "0"], "--gamma"),
                       (["--draft-layers", "9"], "--draft-layers")):
        result = CliRunner().invoke(main, train_args(target, sharegpt, tmp_path / "bad", *bad))
        assert result.exit_code == 1 and match in result.output.strip().splitlines()[-1], result.output
        assert "Traceback" not in result.output and not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------- speculators' layout


def write_speculators(folder, zlab, model, draft_vocab=None):
    """The z-lab draft rewritten as speculators saves a DFlash draft (models/dflash/config.py, core.py): config.json
    with `speculators_model_type: "dflash"`, the nested Qwen3 `transformer_layer_config`, `block_size`,
    `mask_token_id`, `aux_hidden_state_layer_ids` (layer INPUTS: z-lab's ids + 1), `speculators_config`; the same
    tensors plus the verifier's `embed_tokens` and `lm_head`, the head cut to the `draft_vocab` ids (sorted) with
    `d2t` (offsets) and `t2d` where given. Returns the head and the ids it keeps."""
    from safetensors.torch import load_file

    config = json.loads((zlab / "config.json").read_text())
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "vocab_size", "rope_theta", "max_position_embeddings")}
    tensors = dict(load_file(str(zlab / "model.safetensors")))
    head = model.lm_head.weight.detach()
    tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().to(torch.bfloat16)
    hot = None
    if draft_vocab is not None:
        hot = np.asarray(draft_vocab, np.int64)
        head = head[torch.from_numpy(hot)]
        tensors["d2t"] = torch.from_numpy(hot - np.arange(len(hot)))
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[torch.from_numpy(hot)] = True
        tensors["t2d"] = t2d
    tensors["lm_head.weight"] = head.to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "speculators_version": "0.3.0",
        "transformer_layer_config": {"model_type": "qwen3", **layer, "num_hidden_layers": config["num_hidden_layers"]},
        "draft_vocab_size": len(head), "block_size": BLOCK, "mask_token_id": MASK,
        "aux_hidden_state_layer_ids": [i + 1 for i in OUTPUTS], "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}],
                               "verifier": {"name_or_path": "tiny-qwen3", "architectures": ["Qwen3ForCausalLM"]}}},
        indent=2))
    return head.to(torch.bfloat16).float(), hot


def test_speculators_layout_runs_as_zlabs(target, trained, tmp_path, lossless):
    model, folder = target
    write_speculators(tmp_path / "spec", trained[0], model)
    read = load_dflash(tmp_path / "spec", LAYERS)
    assert (read.config.producer, read.config.target_layers, read.config.draft_vocab) == ("speculators", (1, 3),
                                                                                          model.config.vocab_size)
    ours, theirs = build(folder, trained[0], tmp_path / "a"), build(folder, tmp_path / "spec", tmp_path / "b")
    section = json.loads((theirs / "manifest.json").read_text())["method"]
    assert (section["producer"], section["speculative_tokens"], section["verifier"]) == ("speculators", BLOCK - 1,
                                                                                         "tiny-qwen3")
    a, b = (lossless(Engine.load(x, threads=1), PROMPTS, 24) for x in (ours, theirs))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.stats.accept_lengths for r in a] == [r.stats.accept_lengths for r in b]


def test_speculators_draft_vocabulary_scores_its_own_head(target, trained, tmp_path, lossless):
    """A head cut to the ids of the target's continuations and a few others (d2t / t2d): the draft graph scores the
    block over those ids only and maps them to the target's, as vLLM's qwen3_dflash does; output stays lossless,
    batched equal to alone, sampling as plain sampling."""
    model, folder = target
    sequences = greedy_sequences(model, [prompt_ids(folder, p) for p in PROMPTS + ["the cat"]], 24)
    hot = np.unique(np.concatenate([s.numpy() for s in sequences] + [np.random.default_rng(2).integers(3, 250, 10)]))
    assert 10 < len(hot) < model.config.vocab_size // 2
    head, hot = write_speculators(tmp_path / "spec", trained[0], model, draft_vocab=hot)
    bundle = build(folder, tmp_path / "spec", tmp_path / "bundle")
    check_graphs(model, bundle, trained[1], head, hot)
    engine = Engine.load(bundle, threads=1)
    runs = lossless(engine, PROMPTS, 24)
    check_batched_and_sampled(engine, PROMPTS, 24, [r.tokens for r in runs], temperature=0.3)


def test_speculators_drafts_we_cannot_run_are_one_line(target, trained, tmp_path):
    model, folder = target
    write_speculators(tmp_path / "spec", trained[0], model)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    for change, match in ((lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
                          (lambda c: c["transformer_layer_config"].update(
                              layer_types=["sliding_attention", "full_attention"], sliding_window=8), "sliding-window"),
                          (lambda c: c.update(aux_hidden_state_layer_ids=[1, LAYERS]), "out of range")):
        edited = json.loads(json.dumps(config))
        change(edited)
        (tmp_path / "spec" / "config.json").write_text(json.dumps(edited))
        result = CliRunner().invoke(main, ["build", "--model", str(folder), "--method", "dflash", "--draft",
                                           str(tmp_path / "spec"), "--output", str(tmp_path / "out")])
        assert result.exit_code == 1 and match in result.stderr.strip().splitlines()[-1], result.output
        assert not (tmp_path / "out").exists()
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["build", "--model", str(folder), "--method", "eagle3", "--draft",
                                       str(tmp_path / "spec"), "--output", str(tmp_path / "out")])
    assert result.exit_code == 1 and "--method dflash" in result.stderr.strip().splitlines()[-1], result.output
