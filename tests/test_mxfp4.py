"""GPT-OSS checkpoints in MXFP4, the layout OpenAI publishes them in: the experts' `gate_up_proj` and `down_proj` stored
as `*_blocks` (uint8, two fp4 e2m1 codes a byte) and `*_scales` (uint8, one e8m0 power of two per block of 32) with
`quant_method: mxfp4` in config.json. A tiny random GPT-OSS is quantized here (numpy) and written in that layout;
transformers dequantizes it at load (no triton on a CPU) to exactly the values the quantizer implies, and `specexport
build` reads the folder and runs it greedy, token for token as transformers does.

The layout, as transformers' integrations/mxfp4.py reads it: a [experts, in, out] weight is stored transposed, its
input dimension cut in blocks of 32 -> blocks [experts, out, in / 32, 16], scales [experts, out, in / 32]; in a byte
the low nibble is the even element, the high nibble the odd one; a code's bit 3 is the sign and bits 0-2 index the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; a block's value is code value * 2 ** (scale - 127)."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import save_folder, tiny_model
from safetensors.numpy import load_file, save_file
from test_families import FAMILIES

from specexport.cli import main
from specexport.runtime.generate import Engine

BLOCK = 32  # values a scale covers
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
SCALE_BIAS = 127  # e8m0: the byte is the exponent plus 127
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # the fused expert tensors MXFP4 replaces; their biases stay
# OpenAI's published quantization_config (gpt-oss-20b and -120b): only the experts are in MXFP4
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
NEW_TOKENS = 12
PROMPTS = ["the sea and the ship sail over blue waves far away", "def f(n):\n    return n * 2\n\nprint(f(3))",
           "a b a b a b a b a b a b a b"]  # byte-level, each longer than the 8-position windows


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of a [experts, in, out] weight: round to nearest on the e2m1 grid, each block of 32 inputs
    scaled by the smallest power of two that brings its largest magnitude within 6 (so nothing clips).

    blocks: uint8 [experts, out, in / 32, 16], element 2k in the low nibble and 2k + 1 in the high one;
    scales: uint8 [experts, out, in / 32], the exponent + 127."""
    experts, inputs, outputs = weight.shape
    assert inputs % BLOCK == 0, f"{inputs} inputs are not whole blocks of {BLOCK}"
    w = weight.astype(np.float32).transpose(0, 2, 1).reshape(experts, outputs, inputs // BLOCK, BLOCK)
    amax = np.abs(w).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.ceil(np.log2(amax / 6)), 0).astype(np.int32)
    exponent = np.clip(exponent, -SCALE_BIAS, SCALE_BIAS)
    scaled = np.ldexp(w, -exponent[..., None])
    codes = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(axis=-1).astype(np.uint8)  # magnitude, 0..7
    codes |= np.where((scaled < 0) & (codes > 0), 8, 0).astype(np.uint8)  # the sign bit (no -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The fp32 [experts, in, out] weight that MXFP4 (blocks, scales) hold: quantize_mxfp4's inverse."""
    experts, outputs, groups, half = blocks.shape
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(experts, outputs, groups, 2 * half)
    values = np.ldexp(E2M1[codes], scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return values.reshape(experts, outputs, groups * 2 * half).transpose(0, 2, 1).astype(np.float32)


def write_mxfp4_folder(model, folder):
    """Save `model` (a GPT-OSS) and the byte-level tokenizer as a Hugging Face folder in the published MXFP4 layout:
    every layer's `mlp.experts.{gate_up_proj,down_proj}` replaced by `{name}_blocks` and `{name}_scales`, every other
    tensor as save_pretrained writes it, and config.json with the mxfp4 quantization_config."""
    folder = save_folder(model, folder)
    weights_file = folder / "model.safetensors"
    assert weights_file.is_file() and not list(folder.glob("*.index.json")), "expected one unsharded file"
    tensors = load_file(weights_file)
    for name in [n for n in tensors if n.rpartition(".")[2] in EXPERT_WEIGHTS]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(tensors.pop(name))
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_hf(folder):
    """The folder as specexport loads it: transformers, fp32, offline."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval()


@pytest.fixture(scope="module")
def original():
    model_type, overrides = FAMILIES["gpt_oss"]
    return tiny_model(model_type, **overrides)


@pytest.fixture(scope="module")
def mxfp4_folder(original, tmp_path_factory):
    return write_mxfp4_folder(original, tmp_path_factory.mktemp("mxfp4") / "tiny-gpt-oss-mxfp4")


def test_the_layout_byte_by_byte():
    """One block by hand: low nibble first, the sign in bit 3, the scale 127 + exponent."""
    column = np.zeros(BLOCK, dtype=np.float32)
    column[:5] = np.array([0.5, 6, -1, 3, -0.5]) / 8  # a block whose largest magnitude is 6 * 2 ** -3
    blocks, scales = quantize_mxfp4(column.reshape(1, BLOCK, 1))
    assert blocks.shape == (1, 1, 1, 16) and scales.shape == (1, 1, 1)
    assert scales[0, 0, 0] == SCALE_BIAS - 3
    assert blocks[0, 0, 0, :3].tolist() == [0x71, 0x5A, 0x09] and not blocks[0, 0, 0, 3:].any()
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales).reshape(-1), column)


def test_the_quantizer_is_a_rounding(original):
    """Every expert weight lands on its MXFP4 grid, at most half the widest gap (4 to 6: two scale units) away, and
    the grid's values are a fixed point."""
    for name, value in original.state_dict().items():
        if name.rpartition(".")[2] not in EXPERT_WEIGHTS:
            continue
        w = value.numpy()
        blocks, scales = quantize_mxfp4(w)
        experts, inputs, outputs = w.shape
        assert blocks.shape == (experts, outputs, inputs // BLOCK, BLOCK // 2) and scales.shape == blocks.shape[:-1]
        back = dequantize_mxfp4(blocks, scales)
        step = np.ldexp(1.0, scales.astype(np.int32) - SCALE_BIAS).transpose(0, 2, 1).repeat(BLOCK, axis=1)
        assert (np.abs(back - w) <= step * (1 + 1e-6)).all(), name
        assert 0 < np.abs(back - w).mean() < 0.2 * np.abs(w).mean(), name  # lossy, but not by much
        # quantizing the grid's values gives them back (a block rounded down to 3 * 2 ** e may take the scale below)
        np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(back)), back)


def test_transformers_dequantizes_the_folder_exactly(original, mxfp4_folder):
    """transformers loads the MXFP4 folder (dequantizing: no triton here) to exactly quantize_mxfp4's values, and
    every other tensor to the original's."""
    stored = load_file(mxfp4_folder / "model.safetensors")
    layers = original.config.num_hidden_layers
    assert not [n for n in stored if n.rpartition(".")[2] in EXPERT_WEIGHTS]
    assert sum(n.endswith(("_blocks", "_scales")) for n in stored) == 4 * layers
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (8, 2 * 160, 96 // BLOCK, 16)
    assert stored["model.layers.0.mlp.experts.down_proj_scales"].shape == (8, 96, 160 // BLOCK)
    loaded = load_hf(mxfp4_folder).state_dict()
    assert set(loaded) == set(original.state_dict())
    for name, value in original.state_dict().items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == value.shape, name
        if name.rpartition(".")[2] in EXPERT_WEIGHTS:
            want = dequantize_mxfp4(stored[f"{name}_blocks"], stored[f"{name}_scales"])
            assert torch.equal(got, torch.from_numpy(want)), name
            assert not torch.equal(got, value), name  # quantized: not the original weights
        else:
            assert torch.equal(got, value), name


def test_specexport_builds_and_runs_an_mxfp4_folder(mxfp4_folder, tmp_path):
    """`specexport build` reads the MXFP4 folder (fp32, validated against transformers), and the bundle's greedy
    tokens are transformers' own `generate` on the same folder."""
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", "--model", str(mxfp4_folder), "--precision", "fp32", "--output",
                                       str(out), "--max-context", "128"])
    assert result.exit_code == 0, result.output
    assert "validating against transformers" in result.output  # the build's own check of the graph
    engine = Engine.load(out, threads=1)
    reference = load_hf(mxfp4_folder)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=False)
        assert len(ids) > 8, prompt
        got = engine.generate(ids, max_new_tokens=NEW_TOKENS, stop_ids=()).tokens
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert got == want, prompt
