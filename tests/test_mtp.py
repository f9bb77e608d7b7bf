"""`--method mtp`: the MTP layer inside a MiMo checkpoint as the draft. A tiny MiMo is written here in XiaomiMiMo's
layout (config.json `model_type: mimo`, `num_nextn_predict_layers`; `model.mtp_layers.0.{token_layernorm,
hidden_layernorm, input_proj, final_layernorm}` around a Qwen2 block, bf16), its MTP layer trained here on the tiny
target's own continuations with a reference forward written from vLLM's model_executor/models/mimo_mtp.py and
mimo.py on transformers' Qwen2 decoder layer. The bundle's graphs must equal that reference; greedy output equals
plain decoding, batched equals alone, sampling follows plain sampling."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import save_folder, tiny_model
from helpers import check_batched_and_sampled, greedy_sequences
from safetensors.torch import load_file, save_file

from specexport.cli import main
from specexport.errors import UserError
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine

PROMPTS = ["The sea wind over blue waves.", "A ship and calm night stars.", "x", "Far away quiet water."]


class MimoMtp(torch.nn.Module):
    """MiMo's MTP layer as vLLM runs it: token_layernorm(embedding, zeroed at position 0) and
    hidden_layernorm(the target's last layer output before its final norm), input_proj(cat(hidden, embedding)), a
    Qwen2 decoder layer, final_layernorm; the target's LM head scores that output, which is also the hidden the
    next MTP step reads."""

    def __init__(self, config):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

        super().__init__()
        h = config.hidden_size
        config._attn_implementation = "eager"
        self.token_layernorm, self.hidden_layernorm = Qwen2RMSNorm(h, config.rms_norm_eps), Qwen2RMSNorm(h, config.rms_norm_eps)
        self.input_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = Qwen2DecoderLayer(config, 0)
        self.final_layernorm = Qwen2RMSNorm(h, config.rms_norm_eps)
        self.rotary = Qwen2RotaryEmbedding(config)

    def forward(self, emb, hidden, positions):
        emb = emb * (positions != 0)[..., None]
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], -1))
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.final_layernorm(x)

    def checkpoint(self) -> dict:
        """MiMo's names: the block's under the layer's own prefix."""
        out = {f"model.mtp_layers.0.{k}": v.detach().clone() for k, v in self.state_dict().items()
               if not k.startswith(("block.", "rotary."))}
        out.update({f"model.mtp_layers.0.{k.removeprefix('block.')}": v.detach().clone()
                    for k, v in self.state_dict().items() if k.startswith("block.")})
        return out


def prenorm_last(model, ids):
    """(the last layer's output before the final norm [1, T, h], logits) of the target on ids [1, T]."""
    kept = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, out: kept.append(out[0] if isinstance(out, tuple)
                                                                                        else out))
    try:
        logits = model(input_ids=ids).logits
    finally:
        hook.remove()
    return kept[-1], logits


def train_mtp(model, mtp, sequences, steps=300):
    """MTP at position t reads the target's hidden at t and token t + 1 and learns the target's greedy token t + 2."""
    opt = torch.optim.Adam([p for n, p in mtp.named_parameters() if not n.startswith("rotary")], lr=3e-3)
    embed = model.model.embed_tokens
    for step in range(steps):
        ids = sequences[step % len(sequences)][None]
        with torch.no_grad():
            hidden, logits = prenorm_last(model, ids)
            labels = logits.argmax(-1)  # the target's own next tokens: what verification accepts
            emb = embed(ids[:, 1:])
        t = ids.shape[1] - 1
        out = mtp(emb, hidden[:, :t], torch.arange(t)[None])
        loss = torch.nn.functional.cross_entropy(model.lm_head(out)[0, :-1], labels[0, 1:t])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return mtp


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(model, folder, the trained MTP layer): a tiny Qwen2 saved as MiMo publishes its checkpoints."""
    torch.manual_seed(0)
    model = tiny_model("qwen2")
    folder = save_folder(model, tmp_path_factory.mktemp("models") / "tiny-mimo")
    starts = [torch.randint(3, model.config.vocab_size, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
              for seed in range(12)]
    sequences = greedy_sequences(model, starts, 36)
    mtp = train_mtp(model, MimoMtp(model.config), sequences)
    tensors = {**load_file(str(folder / "model.safetensors")), **mtp.checkpoint()}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1,
                  auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # the reference from the stored (bf16-rounded) weights, as the bundle reads them
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()
                           if not k.startswith("model.mtp_layers.")}, strict=False)
    mtp.load_state_dict({("block." + k.removeprefix("model.mtp_layers.0.")) if not any(
        n in k for n in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"))
        else k.removeprefix("model.mtp_layers.0."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()
        if k.startswith("model.mtp_layers.")}, strict=False)
    return model, folder, mtp.eval()


@pytest.fixture(scope="module")
def bundle(mimo, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp") / "bundle"
    result = CliRunner().invoke(main, ["build", "--model", str(mimo[1]), "--method", "mtp", "--precision", "fp32",
                                       "--output", str(out), "--depth", "3", "--draft-top-k", "3",
                                       "--total-tokens", "8"])
    assert result.exit_code == 0, result.output
    return out


def test_graphs_equal_the_reference(mimo, bundle):
    model, _, mtp = mimo
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["method"]["name"] == "mtp" and manifest["method"]["producer"] == "mimo-mtp"
    graphs = manifest["graphs"]
    target = GraphSession(bundle / graphs["target"]["file"], graphs["target"], threads=1, device="cpu")
    draft = GraphSession(bundle / graphs["draft"]["file"], graphs["draft"], threads=1, device="cpu")
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, 10)
    n = len(ids)
    feats = target.forward(target.new_cache(n + 4), ids[None], np.arange(n)[None], tree.causal_mask(n),
                           np.array([n - 1]), want=("eagle_features",))["eagle_features"][0]
    with torch.no_grad():
        hidden, _ = prenorm_last(model, torch.from_numpy(ids[None]))
        want = mtp(model.model.embed_tokens(torch.from_numpy(ids[None, 1:])), hidden[:, :-1], torch.arange(n - 1)[None])
        logp = torch.log_softmax(model.lm_head(want)[0], -1)
    np.testing.assert_allclose(feats, hidden[0].numpy(), atol=1e-4)
    got = draft.forward(draft.new_cache(n + 4), ids[None, 1:], np.arange(n - 1)[None], tree.causal_mask(n - 1),
                        np.arange(n - 1), want=("hidden_out", "draft_logp", "draft_tokens"),
                        inputs={"hidden": feats[None, :-1]})
    np.testing.assert_allclose(got["hidden_out"][0], want[0].numpy(), atol=1e-4)
    top = logp.topk(got["draft_tokens"].shape[1], -1)
    np.testing.assert_allclose(got["draft_logp"], top.values.numpy(), atol=1e-4)
    assert (got["draft_tokens"] == top.indices.numpy()).all()


def test_mtp_is_lossless_batched_and_samples_as_plain(bundle, lossless):
    engine = Engine.load(bundle, threads=1)
    runs = lossless(engine, PROMPTS, 32)
    assert max(r.stats.tau for r in runs) > 1.3  # the trained MTP layer's drafts are accepted
    check_batched_and_sampled(engine, PROMPTS, 32, [r.tokens for r in runs], temperature=0.5)


def test_a_model_without_mtp_layers_is_one_line(tiny_folder, mimo, tmp_path):
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "mtp", "--output",
                                       str(tmp_path / "b")])
    assert result.exit_code == 1 and "has no MTP layers" in result.stderr.strip().splitlines()[-1], result.output
    assert "Traceback" not in result.output and not (tmp_path / "b").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in mimo[1].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.mtp_layers.0.input_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    from specexport.exporter import sources
    from specexport.exporter.drafts.mtp import load_mtp

    source = sources.resolve(str(broken))
    with pytest.raises(UserError, match="lacks 'model.mtp_layers.0.input_proj.weight'"):
        load_mtp(source, sources.load_config(source))
