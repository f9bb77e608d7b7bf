"""The EAGLE-3 drafts users download, in each producer's layout, written here as the producer writes them:

- the EAGLE reference (SafeAILab/EAGLE eagle/model/cnets.py: `midlayer.*`, `d2t`, `t2d`, no aux ids);
- speculators (vllm-project/speculators src/speculators/models/eagle3/config.py, core.py, model_definitions.py and
  convert/eagle/eagle3_converter.py: `speculators_config`, a nested `transformer_layer_config`, `layers.{i}.*`,
  aux ids as layer inputs, `norm_before_residual`, `norm_before_fc` / `fc_norm`, `norm_output`);
- ModelOpt (NVIDIA TensorRT-Model-Optimizer modelopt/torch/export/plugins/hf_spec_export.py: `midlayer.*`, `d2t`
  without `t2d`, the base's llama3 RoPE scaling copied in, `eagle_config` flags, aux ids as layer outputs);
- SpecForge (sgl-project/SpecForge specforge/export/to_sglang.py and configs/*-eagle3*.json: `midlayer.*`,
  `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs, EAGLE 3.1's `fc_norm` and `norm_output`).

Each is built with `build` and run: greedy output equal to plain decoding, batched equal to alone, and the built
graphs equal to a reference forward written here on transformers' own decoder layers, reading the tensors by the
producer's names with the producer's meaning of every key (so a misread layer or an off-by-one aux layer fails).
The plain layouts carry a draft trained here, so that their speculation is exercised (tau, and a chi-square test of
sampled output); the variants with EAGLE 3.1's norms, Qwen3 layers, two layers and biases carry random weights."""

import json

import chisquare
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import TOKENIZER_VOCAB, save_folder, tiny_model
from helpers import train_tiny_eagle
from safetensors.torch import load_file, save_file

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.drafts import load_draft
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine

LAYERS, H, V, DRAFT_VOCAB = 8, 64, TOKENIZER_VOCAB, 128
INPUTS = (2, 4, 5)  # EAGLE-3's default aux layers, as layer inputs (2, L//2, L-3); as layer outputs: (1, 3, 4)
PROMPTS = ["The sea wind over blue waves.", "A ship and calm night stars.", "x", "Far away quiet water."]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """An eight-layer tiny Llama (so that the default aux layers differ, and inputs and outputs name different
    layers) and its folder."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    return model, save_folder(model, tmp_path_factory.mktemp("models") / "tiny-llama-8")


@pytest.fixture(scope="module")
def trained(target, sharegpt, tmp_path_factory):
    """An EAGLE-3 draft trained for the target here, in our layout (the EAGLE reference's names)."""
    out = tmp_path_factory.mktemp("trained") / "eagle3"
    train_tiny_eagle(target[1], out, sharegpt, steps=240, draft_vocab=DRAFT_VOCAB, aux_layers=INPUTS)
    return out


# ------------------------------------------------------------------------------------------ the producers' files


def llama_keys(hidden=H, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=1, **more) -> dict:
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "vocab_size": V,
            "hidden_act": "silu", "max_position_embeddings": 512, "rope_theta": 10000.0, **more}


def write(folder, tensors: dict, config: dict, dtype=torch.float16):
    """The producer's files: model.safetensors in its dtype (d2t int64, t2d bool as the producers keep them)."""
    folder.mkdir(parents=True)
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def reference_tensors(trained) -> dict:
    return load_file(str(trained / "model.safetensors"))


def as_reference(trained, folder):
    """SafeAILab's EAGLE-3 layout: its config (cnets.py's Llama keys + draft_vocab_size), no aux ids."""
    config = llama_keys(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=DRAFT_VOCAB,
                        bias=False)
    return write(folder, reference_tensors(trained), config)


def as_speculators(trained, folder):
    """speculators' convert output: `midlayer.` -> `layers.0.`, the nested layer config, ids as inputs."""
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in reference_tensors(trained).items()}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                           "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                     "verifier": {"name_or_path": "tiny-llama-8", "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": llama_keys(model_type="llama", mlp_bias=False, attention_bias=False),
              "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": False, "target_hidden_size": H,
              "eagle_aux_hidden_state_layer_ids": list(INPUTS), "norm_before_fc": False, "fc_norm": False,
              "norm_output": False, "embed_requires_grad": False, "torch_dtype": "bfloat16"}
    return write(folder, tensors, config, torch.bfloat16)


def as_modelopt(trained, folder):
    """ModelOpt's HF export: `midlayer.*`, d2t without t2d, Llama keys with the base's RoPE scaling, the nested
    eagle_config with ids as layer outputs. Our tiny target has plain RoPE, so the scaling here is the draft's own
    (the variant below checks it); this one copies the base's plain theta as ModelOpt does."""
    tensors = {k: v for k, v in reference_tensors(trained).items() if k != "t2d"}
    config = llama_keys(architectures=["LlamaForCausalLMEagle3"], model_type="llama", tie_word_embeddings=False,
                        draft_vocab_size=DRAFT_VOCAB, rope_scaling=None, attention_bias=False, mlp_bias=False,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in INPUTS],
                                      "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                                      "use_last_layernorm": True, "use_mtp_layernorm": False})
    return write(folder, tensors, config, torch.bfloat16)


def as_specforge(trained, folder):
    """SpecForge's export: identity names, t2d and d2t, ids as layer outputs in eagle_config (gpt-oss style)."""
    config = llama_keys(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=DRAFT_VOCAB,
                        torch_dtype="float16",
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in INPUTS]})
    return write(folder, reference_tensors(trained), config)


LAYOUTS = {"eagle-reference": as_reference, "speculators": as_speculators, "modelopt": as_modelopt,
           "specforge": as_specforge}


def random_layer(rng, prefix, width, *, qk_norm=False, bias=False, attn_norm=None):
    """One decoder layer's tensors in Hugging Face's names (`attn_norm`: the name of its input norm, if any)."""
    def normal(*shape):
        return torch.from_numpy(rng.normal(0, 1 / shape[-1] ** 0.5, shape).astype(np.float32))

    def norm(n):
        return torch.from_numpy((1 + 0.3 * rng.normal(size=n)).astype(np.float32))

    t = {prefix + "self_attn.q_proj.weight": normal(64, width), prefix + "self_attn.k_proj.weight": normal(32, width),
         prefix + "self_attn.v_proj.weight": normal(32, width), prefix + "self_attn.o_proj.weight": normal(H, 64),
         prefix + "post_attention_layernorm.weight": norm(H), prefix + "mlp.gate_proj.weight": normal(128, H),
         prefix + "mlp.up_proj.weight": normal(128, H), prefix + "mlp.down_proj.weight": normal(H, 128)}
    if attn_norm:
        t[prefix + attn_norm] = norm(H)
    if qk_norm:
        t[prefix + "self_attn.q_norm.weight"], t[prefix + "self_attn.k_norm.weight"] = norm(16), norm(16)
    if bias:
        for name, n in (("q", 64), ("k", 32), ("v", 32), ("o", H)):
            t[prefix + f"self_attn.{name}_proj.bias"] = torch.from_numpy(rng.normal(0, 0.3, n).astype(np.float32))
    return t


def random_head(rng, aux: int, first: str) -> dict:
    """fc, the first layer's two input norms, the final norm, a reduced LM head and its d2t / t2d."""
    hot = np.sort(rng.choice(V, DRAFT_VOCAB, replace=False))
    t2d = np.zeros(V, bool)
    t2d[hot] = True
    return {"fc.weight": torch.from_numpy(rng.normal(0, 1 / (aux * H) ** 0.5, (H, aux * H)).astype(np.float32)),
            first + "input_layernorm.weight": torch.from_numpy((1 + 0.3 * rng.normal(size=H)).astype(np.float32)),
            first + "hidden_norm.weight": torch.from_numpy((1 + 0.3 * rng.normal(size=H)).astype(np.float32)),
            "norm.weight": torch.from_numpy((1 + 0.3 * rng.normal(size=H)).astype(np.float32)),
            "lm_head.weight": torch.from_numpy(rng.normal(0, 1 / H ** 0.5, (DRAFT_VOCAB, H)).astype(np.float32)),
            "d2t": torch.from_numpy(hot - np.arange(DRAFT_VOCAB)), "t2d": torch.from_numpy(t2d)}


def speculators_qwen3_two_layers(folder, rng, norm_before_fc=False):
    """speculators with a Qwen3 layer config (q/k norms), two layers, EAGLE 3.1's norms (one per feature, or
    `norm_before_fc`'s one over the concatenation), `norm_before_residual` and `norm_output`."""
    t = random_head(rng, 3, "layers.0.")
    t.update(random_layer(rng, "layers.0.", 2 * H, qk_norm=True))
    t.update(random_layer(rng, "layers.1.", H, qk_norm=True, attn_norm="input_layernorm.weight"))
    if norm_before_fc:
        t["input_norm.weight"] = torch.from_numpy((1 + 0.3 * rng.normal(size=3 * H)).astype(np.float32))
    else:
        t.update({f"fc_norm.{k}.weight": torch.from_numpy((1 + 0.3 * rng.normal(size=H)).astype(np.float32))
                  for k in range(3)})
    layer = {"model_type": "qwen3", "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "vocab_size": V,
             "max_position_embeddings": 512}  # the class's defaults left out, as to_diff_dict writes it
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy",
                                                                                  "speculative_tokens": 5}],
                                     "default_proposal_method": "greedy", "verifier": {"name_or_path": "tiny"}},
              "transformer_layer_config": layer, "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": True,
              "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": [0, 2, 3], "norm_before_fc": norm_before_fc,
              "fc_norm": not norm_before_fc, "norm_output": True}
    return write(folder, t, config, torch.bfloat16)


def modelopt_llama3_biases(folder, rng):
    """ModelOpt with the base's llama3 RoPE scaling copied in, attention biases, and the final norm off."""
    t = random_head(rng, 3, "midlayer.")
    del t["t2d"], t["norm.weight"]
    t.update(random_layer(rng, "midlayer.", 2 * H, bias=True))
    config = llama_keys(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=DRAFT_VOCAB,
                        rope_scaling=LLAMA3, attention_bias=True, rope_theta=5e5,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True,
                                      "use_input_layernorm_in_first_layer": True, "use_last_layernorm": False,
                                      "use_mtp_layernorm": False})
    return write(folder, t, config, torch.bfloat16)


def specforge_eagle31(folder, rng):
    """SpecForge's EAGLE 3.1 (configs/qwen3-30B-A3B-eagle3.1.json's keys): fc_norm, norm_output, ids as outputs."""
    t = random_head(rng, 3, "midlayer.")
    t.update(random_layer(rng, "midlayer.", 2 * H))
    t.update({f"fc_norm.{k}.weight": torch.from_numpy((1 + 0.3 * rng.normal(size=H)).astype(np.float32))
              for k in range(3)})
    config = llama_keys(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=DRAFT_VOCAB,
                        fc_norm=True, norm_output=True, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 2]})
    return write(folder, t, config)


VARIANTS = {"speculators-qwen3-2layers-fc_norm": speculators_qwen3_two_layers,
            "speculators-norm_before_fc": lambda f, rng: speculators_qwen3_two_layers(f, rng, norm_before_fc=True),
            "modelopt-llama3-biases": modelopt_llama3_biases, "specforge-eagle3.1": specforge_eagle31}


# ------------------------------------------------------------------------------------------ the reference forward


class Reference:
    """EAGLE-3's forward as the producers' code runs it, on transformers' decoder layers: the features are the
    target's hidden states at the producer's aux ids in the producer's meaning (inputs: hidden_states[i]; outputs:
    hidden_states[i + 1]), normed per feature or over the concatenation where the draft has the norms, then fc;
    the first layer attends over cat(input_layernorm(embedding), hidden_norm(hidden)) with the raw hidden as its
    residual (the normed one with norm_before_residual); later layers are plain decoder layers; logits are
    lm_head(norm(out)) (no norm where the producer's flag turns it off) mapped to target ids by d2t; the hidden
    passed on is the last layer's output (final-normed with speculators' norm_output)."""

    def __init__(self, folder, target_model, *, capture, first, later="layers.{i}.", later_norm="input_layernorm",
                 final_norm=True, pass_normed=False, residual_normed=False):
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        config = json.loads((folder / "config.json").read_text())
        keys = config.get("transformer_layer_config") or {k: v for k, v in config.items() if k != "eagle_config"}
        cfg = AutoConfig.for_model(keys.get("model_type", "llama"),
                                   **{k: v for k, v in keys.items() if k not in ("model_type", "architectures")})
        cfg._attn_implementation = "eager"
        self.t = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.model, self.capture, self.final_norm = target_model, capture, final_norm
        self.pass_normed, self.residual_normed = pass_normed, residual_normed
        layer_class = Qwen3DecoderLayer if cfg.model_type == "qwen3" else LlamaDecoderLayer
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.layers = []
        count = 1 + len({k.split(".")[1] for k in self.t if k.startswith("layers.") and not k.startswith("layers.0.")})
        for i in range(count):
            prefix = first if i == 0 else later.format(i=i)
            layer = layer_class(cfg, i)
            state = {k[len(prefix):]: v for k, v in self.t.items() if k.startswith(prefix)}
            if i == 0:  # the producers' first layer: q/k/v over 2h, its two input norms outside the stock layer
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(layer.self_attn, name)
                    setattr(layer.self_attn, name, torch.nn.Linear(2 * cfg.hidden_size, old.out_features,
                                                                   bias=old.bias is not None))
                self.embed_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                self.embed_norm.weight.data = state.pop("input_layernorm.weight")
                self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                self.hidden_norm.weight.data = state.pop("hidden_norm.weight")
                state["input_layernorm.weight"] = torch.ones(cfg.hidden_size)  # unused: the forward below norms
            else:
                state["input_layernorm.weight"] = state.pop(later_norm + ".weight")
            layer.load_state_dict(state, strict=True)
            self.layers.append(layer.eval())
        self.eps = cfg.rms_norm_eps

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def features(self, ids: np.ndarray) -> torch.Tensor:
        """fc(features) for each prompt token [T, h]."""
        with torch.no_grad():
            states = self.model.model(input_ids=torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states
            parts = [states[i][0].float() for i in self.capture]
            if "input_norm.weight" in self.t:
                x = self.rms(torch.cat(parts, -1), self.t["input_norm.weight"])
            else:
                if "fc_norm.0.weight" in self.t:
                    parts = [self.rms(p, self.t[f"fc_norm.{k}.weight"]) for k, p in enumerate(parts)]
                x = torch.cat(parts, -1)
            return x @ self.t["fc.weight"].T

    def forward(self, tokens: np.ndarray, hidden: torch.Tensor):
        """A causal chain of tokens [T] at positions 0..T-1 fed hiddens [T, h]: (hidden passed on [T, h], log-softmax
        over the draft vocabulary [T, Vd], target id of each draft id)."""
        t = len(tokens)
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            rope = self.rotary(hidden[None], positions)
            emb = self.model.model.embed_tokens(torch.from_numpy(tokens[None])).float()
            normed = self.hidden_norm(hidden[None])
            x = torch.cat([self.embed_norm(emb), normed], -1)
            first = self.layers[0]
            attn, _ = first.self_attn(x, position_embeddings=rope, attention_mask=mask)
            h = (normed if self.residual_normed else hidden[None]) + attn
            h = h + first.mlp(first.post_attention_layernorm(h))
            for layer in self.layers[1:]:
                h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            out = self.rms(h, self.t["norm.weight"]) if self.final_norm else h
            logits = out @ self.t["lm_head.weight"].T
            passed = out if self.pass_normed else h
        hot = np.arange(logits.shape[-1]) + self.t["d2t"].numpy()
        return passed[0], torch.log_softmax(logits[0], -1), hot


def reference_for(layout: str, folder, model) -> Reference:
    """Each producer's meaning of its files, as its code reads them (module docstring)."""
    outputs = [i + 1 for i in json.loads((folder / "config.json").read_text()).get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids", [])]
    config = json.loads((folder / "config.json").read_text())
    if layout.startswith("eagle-reference"):
        return Reference(folder, model, capture=[2, LAYERS // 2, LAYERS - 3], first="midlayer.")
    if layout.startswith("speculators"):
        return Reference(folder, model, capture=config["eagle_aux_hidden_state_layer_ids"], first="layers.0.",
                         pass_normed=config["norm_output"], residual_normed=config["norm_before_residual"])
    if layout.startswith("modelopt"):
        return Reference(folder, model, capture=outputs, first="midlayer.",
                         final_norm=config["eagle_config"]["use_last_layernorm"])
    return Reference(folder, model, capture=outputs, first="midlayer.", final_norm=config.get("norm_output", True))


# ------------------------------------------------------------------------------------------ build and compare


def build(target_folder, draft, out, *more):
    result = CliRunner().invoke(main, ["build", "--model", str(target_folder), "--method", "eagle3", "--draft",
                                       str(draft), "--precision", "fp32", "--output", str(out), "--depth", "3",
                                       "--draft-top-k", "3", "--total-tokens", "8", *more])
    assert result.exit_code == 0, result.output
    return out


def graphs_against_reference(bundle, reference: Reference, seed: int = 0):
    """The bundle's target graph's eagle_features and its draft graph (a chain after a prompt, then one node fed
    the passed-on hidden) against the reference: max differences of features, hiddens and top-k log-probs, and
    whether the top-k tokens match."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    graphs = manifest["graphs"]
    target = GraphSession(bundle / graphs["target"]["file"], graphs["target"], threads=1, device="cpu")
    draft = GraphSession(bundle / graphs["draft"]["file"], graphs["draft"], threads=1, device="cpu")
    ids = np.random.default_rng(seed).integers(3, V, 12)
    n = len(ids)
    feats = target.forward(target.new_cache(n + 4), ids[None], np.arange(n)[None], tree.causal_mask(n),
                           np.array([n - 1]), want=("eagle_features",))["eagle_features"][0]
    want_feats = reference.features(ids)
    # the draft: pairs (feature t, token t + 1), then one more node fed the last pair's passed-on hidden; the
    # graph reads the target graph's features, the reference its own
    tokens, hidden = ids[1:], want_feats[:-1]
    cache = draft.new_cache(n + 8)
    got = draft.forward(cache, tokens[None], np.arange(n - 1)[None], tree.causal_mask(n - 1), np.arange(n - 1),
                        want=("hidden_out", "draft_logp", "draft_tokens"), inputs={"hidden": feats[None, :-1]})
    cache.advance(n - 1)
    passed, logp, hot = reference.forward(tokens, hidden)
    extra = np.array([7])
    got2 = draft.forward(cache, extra[None], np.array([[n - 1]]), tree.causal_mask(1), np.array([0]),
                         want=("hidden_out", "draft_logp", "draft_tokens"), inputs={"hidden": got["hidden_out"][:, -1:]})
    passed2, logp2, _ = reference.forward(np.concatenate([tokens, extra]), torch.cat([hidden, passed[-1:]]))
    k = got["draft_tokens"].shape[1]
    top, top2 = logp.topk(k, -1), logp2[-1:].topk(k, -1)
    return {"features": float(np.abs(feats - want_feats.numpy()).max()),
            "hidden": max(float(np.abs(got["hidden_out"][0] - passed.numpy()).max()),
                          float(np.abs(got2["hidden_out"][0] - passed2[-1:].numpy()).max())),
            "logp": max(float(np.abs(got["draft_logp"] - top.values.numpy()).max()),
                        float(np.abs(got2["draft_logp"] - top2.values.numpy()).max())),
            "tokens": bool((got["draft_tokens"] == hot[top.indices.numpy()]).all()
                           and (got2["draft_tokens"] == hot[top2.indices.numpy()]).all())}


def assert_equal_to_reference(report):
    assert report["features"] < 1e-4 and report["hidden"] < 1e-3 and report["logp"] < 1e-3, report
    assert report["tokens"], report


def batched_equals_alone(engine):
    from specexport.runtime.scheduler import Scheduler

    lengths = [24, 10, 30, 16]
    want = [engine.generate(p, max_new_tokens=n, stop_ids=(), budget=False).tokens for p, n in zip(PROMPTS, lengths)]
    scheduler = Scheduler(engine, max_batch=3, prefill_chunk=5, budget=False, background=False)
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(PROMPTS, lengths)]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in requests] == want


@pytest.fixture(scope="module")
def ours(target, trained, tmp_path_factory):
    """The trained draft built from our own files: what every layout of the same weights must run like."""
    bundle = build(target[1], trained, tmp_path_factory.mktemp("ours") / "bundle")
    engine = Engine.load(bundle, threads=1)
    return [engine.generate(p, max_new_tokens=30, stop_ids=(), budget=False) for p in PROMPTS]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_producers_layout_runs_as_our_own(layout, target, trained, ours, tmp_path, lossless):
    model, folder = target
    draft = LAYOUTS[layout](trained, tmp_path / layout)
    read = load_draft(draft, LAYERS)
    assert read.config.producer == layout and read.config.aux_layers == INPUTS
    bundle = build(folder, draft, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["method"]["producer"] == layout and manifest["method"]["aux_layers"] == list(INPUTS)
    if layout == "speculators":  # its speculators_config
        assert (manifest["method"]["verifier"], manifest["method"]["speculative_tokens"]) == ("tiny-llama-8", 3)
    assert_equal_to_reference(graphs_against_reference(bundle, reference_for(layout, draft, model)))
    engine = Engine.load(bundle, threads=1)
    runs = lossless(engine, PROMPTS, 30)
    # the same weights (fp16/bf16-rounded) draft as our own files do: the same tokens, nearly the same acceptance
    assert [r.tokens for r in runs] == [r.tokens for r in ours]
    assert max(r.stats.tau for r in runs) > 1.3 and abs(sum(r.stats.tau for r in runs) -
                                                       sum(r.stats.tau for r in ours)) < 0.15 * len(PROMPTS)
    batched_equals_alone(engine)
    spec, lengths = chisquare.sampled_counts(engine, "the cat", False, 1200, 0, temperature=0.5)
    plain, _ = chisquare.sampled_counts(engine, "the cat", True, 1200, 100_000, temperature=0.5)
    stat, dof = chisquare.two_sample(spec, plain)
    assert sum(lengths) - len(lengths) > 50  # the speculative path was exercised
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eagle31_qwen3_multilayer_and_scaled_variants(variant, target, tmp_path, lossless):
    model, folder = target
    draft = VARIANTS[variant](tmp_path / variant, np.random.default_rng(len(variant)))
    bundle = build(folder, draft, tmp_path / "bundle")
    assert_equal_to_reference(graphs_against_reference(bundle, reference_for(variant, draft, model)))
    engine = Engine.load(bundle, threads=1)
    lossless(engine, PROMPTS, 24)
    batched_equals_alone(engine)


@pytest.mark.parametrize("layout", ["modelopt", "specforge"])
def test_aux_ids_as_layer_outputs(layout, target, trained, tmp_path):
    """SpecForge and ModelOpt write aux ids as layer outputs: read as vLLM reads them (inputs) the features come
    from the neighbouring layers and the draft's logits change; read as the producer means them, both match."""
    model, folder = target
    draft = LAYOUTS[layout](trained, tmp_path / layout)
    bundle = build(folder, draft, tmp_path / "bundle")
    right = reference_for(layout, draft, model)
    assert_equal_to_reference(graphs_against_reference(bundle, right))
    ids = json.loads((draft / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    right.capture = ids  # vLLM's meaning: the inputs of these layers
    wrong = graphs_against_reference(bundle, right)
    assert wrong["features"] > 0.1 and wrong["logp"] > 0.05, wrong


def test_speculators_settings_reach_the_manifest(target, trained, tmp_path):
    draft = as_speculators(trained, tmp_path / "spec")
    read = load_draft(draft, LAYERS)
    assert read.meta == {"verifier": "tiny-llama-8", "speculative_tokens": 3}


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(speculators_model_type="dflash"), "a speculators 'dflash' draft"),
    (lambda c: c["transformer_layer_config"].update(model_type="gemma2"), "llama and qwen3 layers"),
    (lambda c: c["transformer_layer_config"].update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "RoPE of type 'dynamic'"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), "exclude each other"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), "out of range"),
])
def test_speculators_bad_configs_are_one_line(target, trained, tmp_path, change, match):
    draft = edit_config(as_speculators(trained, tmp_path / "spec"), change)
    with pytest.raises(UserError, match=match):
        load_draft(draft, LAYERS).check(_dims(), "d")


def _dims():
    from specexport.exporter.arch import Dims

    return Dims("llama", V, H, 128, LAYERS, 4, 2, 16, 1e-6, 512, False, "default")


def test_modelopt_refusals(target, trained, tmp_path):
    draft = as_modelopt(trained, tmp_path / "mo")
    (draft / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                            "quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UserError, match=r"quantized \(FP8\)"):
        load_draft(draft, LAYERS)
    (draft / "hf_quant_config.json").unlink()
    edit_config(draft, lambda c: c["eagle_config"].update(parallel_draft_step=3))
    with pytest.raises(UserError, match="parallel draft"):
        load_draft(draft, LAYERS)
    edit_config(draft, lambda c: c["eagle_config"].update(parallel_draft_step=1,
                                                          eagle_aux_hidden_state_layer_ids=[0, 1, LAYERS - 1]))
    with pytest.raises(UserError, match="output of the target's last layer"):
        load_draft(draft, LAYERS)
    tensors = load_file(str(draft / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(draft / "model.safetensors"))
    edit_config(draft, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 3]))
    with pytest.raises(UserError, match="without its d2t map"):
        load_draft(draft, LAYERS)


def test_our_own_mark_keeps_input_ids(trained):
    """Our files write eagle_config's ids as inputs, the key SpecForge and ModelOpt write as outputs: the
    `specexport` object marks them; drafts shipped before the mark carry the object too."""
    config = json.loads((trained / "config.json").read_text())
    assert config["specexport"]["aux_layers_are"] == "inputs"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(INPUTS)
    read = load_draft(trained, LAYERS)
    assert read.config.producer == "specexport" and read.config.aux_layers == INPUTS
    from specexport.exporter.methods.plan import ASSETS

    shipped = load_draft(ASSETS / "eagle3-smollm2-135m", 30)
    assert shipped.config.producer == "specexport" and shipped.config.aux_layers == (2, 15, 27)
