"""The Triton tree-acceptance kernel (exporter/tensorrt/accept.py) against the pure rules (runtime/verify.py): random
trees in batches, greedy and every exact sampling mode, with temperature, top-k and top-p (ties included), fed
the same uniforms. On CUDA when a GPU is here, in Triton's interpreter on CPU tensors otherwise."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before its import
pytest.importorskip("triton", reason="needs triton: pip install 'specexport[triton]'")

from specexport.exporter.tensorrt.accept import tree_accept, without_hidden_params  # noqa: E402
from specexport.runtime.sampling import SamplingParams, probabilities  # noqa: E402
from specexport.runtime.verify import accept_greedy, accept_tree, uniforms_shape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ["greedy", "topk", "with_replacement", "without_replacement"]


def random_step(rng, mode: str, vocab: int, ties: bool):
    """One step's tree, logits, draft distributions, parameters and uniforms, with many right guesses, some
    repeats of an earlier sibling and (sampled) some drafts the draft could not have drawn (q = 0)."""
    t = int(rng.integers(1, 12))
    sampled = mode in ("with_replacement", "without_replacement")
    chain = sampled and rng.random() < 0.3
    parents = [-1] + [i - 1 if chain else int(rng.integers(0, i)) for i in range(1, t)]
    logits = rng.normal(size=(t, vocab)) * 2
    if ties:
        logits = np.round(logits * 2) / 2  # equal logits: top-k keeps ties, top-p breaks them by lower id
    params = SamplingParams(temperature=0.0 if mode == "greedy" else float(rng.choice([0.5, 1.0, 1.5])),
                            top_k=int(rng.choice([0, 0, 5, 40])), top_p=float(rng.choice([1.0, 0.8, 0.5])))
    p = probabilities(logits.astype(np.float32), params)
    q = None
    if sampled:
        q = rng.dirichlet(np.ones(vocab) * 0.5, size=t)
        q[:, rng.choice(vocab, 4, replace=False)] = 0.0
        q /= q.sum(-1, keepdims=True)
    tokens = rng.integers(0, vocab, t)
    for i in range(1, t):
        if rng.random() < 0.5:
            tokens[i] = int(np.argmax(p[parents[i]]))
        elif rng.random() < 0.3 and (siblings := [j for j in range(1, i) if parents[j] == parents[i]]):
            tokens[i] = tokens[siblings[0]]
    u = rng.random(uniforms_shape(parents))
    if mode == "greedy":
        ref = accept_greedy(tokens.tolist(), parents, logits.astype(np.float32).argmax(-1))
        u = np.zeros((t, 1))  # what the runtime passes when greedy (verify.greedy_inputs)
    else:
        ref = accept_tree(tokens.tolist(), parents, p, q, u.astype(np.float32), mode)
    return dict(tokens=tokens, parents=parents, logits=logits, q=q, u=u, params=params,
                without=mode == "without_replacement"), (ref.path, ref.tokens[-1])


def run_batch(steps, vocab: int, block_v: int | None, before: int = 0, dtype=torch.float32):
    """The steps as one batch: shorter trees padded with rows of parent -1 (no node); `before` tokens ahead of the
    tree in each token row (a graph's input_ids whose last rows are the tree)."""
    b, t = len(steps), max(len(s["tokens"]) for s in steps)
    s_max = max(s["u"].shape[1] for s in steps)
    tokens, parents = np.full((b, before + t), 7, np.int32), np.full((b, t), -1, np.int32)
    logits, u = np.zeros((b, t, vocab), np.float32), np.zeros((b, t, s_max), np.float32)
    sampled = any(s["q"] is not None for s in steps)
    q = np.zeros((b, t if sampled else 0, vocab), np.float32)
    params = np.zeros((b, 4), np.float32)
    for i, s in enumerate(steps):
        n, slots = len(s["tokens"]), s["u"].shape[1]
        tokens[i, before:before + n], parents[i, :n], logits[i, :n] = s["tokens"], s["parents"], s["logits"]
        u[i, :n, :slots - 1] = s["u"][:, :-1]
        u[i, :n, -1] = s["u"][:, -1]  # the final draw's uniform sits in the last slot
        if s["q"] is not None:
            q[i, :n] = s["q"]
        params[i] = [s["params"].temperature, s["params"].top_k, s["params"].top_p, s["without"]]
    tensors = [torch.tensor(a, device=DEVICE) for a in (tokens, parents, logits, q, u, params)]
    tensors[2] = tensors[2].to(dtype)
    rows, length, bonus = tree_accept(*tensors, block_v=block_v)
    rows, length, bonus = rows.cpu().numpy(), length.cpu().numpy(), bonus.cpu().numpy()
    assert all((r[n:] == -1).all() for r, n in zip(rows, length))  # padded with -1 after the accepted rows
    return [(r[:n].tolist(), int(x)) for r, n, x in zip(rows, length, bonus)]


@pytest.mark.parametrize("mode", MODES)
def test_the_kernel_accepts_as_the_pure_rule(mode):
    rng = np.random.default_rng(MODES.index(mode))
    depths = set()
    for batch in range(4):
        vocab = int(rng.choice([23, 50]))
        steps, want = zip(*(random_step(rng, mode, vocab, ties=batch % 3 == 2) for _ in range(5)))
        # odd batches: the vocabulary in blocks; even ones: tokens ahead of the tree
        got = run_batch(steps, vocab, block_v=16 if batch % 2 else None, before=0 if batch % 2 else 3)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, (mode, batch, i, steps[i]["parents"], steps[i]["tokens"].tolist(), steps[i]["params"])
        depths |= {len(w[0]) for w in want}
    assert max(depths) >= 3  # paths two drafts deep were accepted, not only rejections


def test_fp16_logits_are_read_as_they_are():
    """An fp16 graph's logits: the kernel accepts as the rules do on those (rounded) logits."""
    rng = np.random.default_rng(7)
    steps, want = [], []
    for mode in ("greedy", "topk"):
        for _ in range(3):
            step, _ = random_step(rng, mode, 50, ties=False)
            step["logits"] = step["logits"].astype(np.float16).astype(np.float64)
            if mode == "greedy":
                ref = accept_greedy(step["tokens"].tolist(), step["parents"], step["logits"].argmax(-1))
            else:
                p = probabilities(step["logits"].astype(np.float32), step["params"])
                ref = accept_tree(step["tokens"].tolist(), step["parents"], p, None, step["u"].astype(np.float32),
                                  mode)
            steps.append(step)
            want.append((ref.path, ref.tokens[-1]))
    got = run_batch(steps[:3], 50, None, dtype=torch.float16) + run_batch(steps[3:], 50, None, dtype=torch.float16)
    assert got == want


def test_the_final_draw_is_the_inverse_cdf():
    """A leaf root: the bonus token is sampling.sample's draw for u across [0, 1), never a token of no mass."""
    from specexport.runtime.sampling import sample

    vocab = 40
    logits = np.full((1, vocab), -np.inf)
    logits[0, [0, 2, 3]] = np.log([0.1, 0.3, 0.6])  # token 1 and the tail have no mass
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits.astype(np.float32), params)
    for u in (0.0, 0.05, 0.15, 0.35, 0.45, 0.99, 0.9999999):
        step = dict(tokens=np.array([5]), parents=[-1], logits=logits, q=None, u=np.array([[u]]), params=params,
                    without=False)
        assert run_batch([step], vocab, block_v=16) == [([0], sample(p[0], u))], u


PTX_CHECK = """
import re
from triton.backends.compiler import GPUTarget
from specexport.exporter.tensorrt.accept import compile_ptx
name, ptx, shared = compile_ptx("fp16", GPUTarget("cuda", 90, 32), ptx_version=87)
entry = re.search(r"\\.entry " + name + r"\\((.*?)\\)", ptx, re.S).group(1)
print(len(entry.split(",")), re.search(r"\\.version (\\S+)", ptx).group(1), shared)
open("kernel.ptx", "w").write(ptx)
"""


def test_the_kernel_compiles_ahead_of_time_for_hopper_with_the_arguments_tensorrt_passes(tmp_path):
    """Triton's NVIDIA backend needs no GPU to make PTX: for sm_90, at PTX ISA 8.7 (a CUDA 12.8 driver), its entry
    takes the 6 inputs, 5 sizes and 3 outputs and nothing else; Triton's bundled ptxas assembles it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", PTX_CHECK], capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    params, version, _ = result.stdout.split()
    assert (params, version) == ("14", "8.7")
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if os.path.exists(ptxas):
        done = subprocess.run([ptxas, "-arch=sm_90a", "kernel.ptx", "-o", "kernel.cubin"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and (tmp_path / "kernel.cubin").stat().st_size > 0, done.stderr


def test_hidden_parameters_are_dropped_only_when_unread():
    ptx = ".entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n\tld.param.u64 %rd1, [k_param_0];\n}"
    assert ".param .u64 k_param_1" not in without_hidden_params(ptx, "k", 1)
    with pytest.raises(ValueError, match="reads its hidden parameter k_param_0"):
        without_hidden_params(ptx, "k", 0)
    with pytest.raises(ValueError, match="fewer than the 3 passed"):
        without_hidden_params(ptx, "k", 3)


def test_the_plugin_declares_a_profile_for_each_input_it_adds():
    """The plugin's new network inputs are the kernel's, and each has (min, opt, max) shapes in order."""
    from specexport.exporter.tensorrt import accept as trt_accept
    from specexport.exporter.tensorrt import plugin as trt_plugin

    shapes = trt_plugin.input_shapes((1, 8, 16), vocab=49152)
    assert tuple(shapes) == trt_plugin.NEW_INPUTS and set(shapes) <= set(trt_accept.INPUTS)
    for low, opt, high in shapes.values():
        assert all(a <= b <= c for a, b, c in zip(low, opt, high))
    assert shapes["sample_q"][0] == (1, 0, 49152)  # deterministic candidates feed no draft rows


def test_without_triton_the_plugin_says_what_to_install():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from specexport.exporter.tensorrt.plugin import add_tree_accept\n"
            "from specexport.errors import UserError\n"
            "try:\n    add_tree_accept(None, 'logits')\nexcept UserError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("pip install 'specexport[triton]'"), result.stderr
