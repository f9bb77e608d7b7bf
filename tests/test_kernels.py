"""specexport's own ONNX Runtime kernel (runtime/kernels/rows4.c, `--int4-rows`): its products against numpy, its
rows independent of the call, its instruction sets bit-identical, its header fetched and checked, and a graph built
with it from the CLI."""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specexport.errors import UserError
from specexport.exporter import quant
from specexport.runtime import kernels


def matmul_rows4(library, w: np.ndarray, rank: int = 2, k_dim=None, cut: str = ""):
    """A session of one MatMulRows4 over weight w [N, K] (x of `rank` dims, its last one declared as `k_dim`; the
    weight input `cut` one element short, as a malformed bundle would have it)."""
    n, k = w.shape
    packed = {name: v.reshape(-1)[:-1] if name == cut else v for name, v in quant.rows4(w).items()}
    inits = [numpy_helper.from_array(v, name) for name, v in packed.items()]
    node = helper.make_node("MatMulRows4", ["x", "B", "scales", "zeros"], ["y"], domain=kernels.DOMAIN, K=k, N=n)
    lead = ["a", "b"][:rank - 1]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, k_dim or k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic in float64: int4 blocks of w, each row's blocks of 32 rounded to int8 at max|x|/127."""
    q, scale, zero = quant.int4_blocks(w)
    blocks = w.shape[1] // quant.INT4_BLOCK
    wq = (q.reshape(w.shape[0], blocks, 32).astype(np.float64) - zero[..., None]) * scale[..., None]
    xb = x.reshape(len(x), blocks, 32).astype(np.float64)
    top = np.abs(xb).max(axis=2, keepdims=True).astype(np.float32)
    codes = np.clip(np.rint(xb * np.where(top > 0, np.float32(127) / np.maximum(top, 1e-30), 0)), -127, 127)
    return np.einsum("rbi,nbi->rn", codes * (top / np.float32(127)), wq)


@pytest.fixture
def isa(monkeypatch):
    """Run the kernel on one instruction set: c, avx2 or the widest (rows4.c reads SPECEXPORT_ROWS_ISA per call)."""
    return lambda name: monkeypatch.setenv("SPECEXPORT_ROWS_ISA", name)


def test_the_products_are_int4_weights_times_each_rows_int8_blocks(rows4_library):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((101, 256)).astype(np.float32)  # a last tile of 5 columns (a vocabulary of any size)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    x[2] = 0.0  # a zero row stays zero (no scale of zero divided by)
    x[3, :32] = 0.0  # and a zero block
    got = matmul_rows4(rows4_library, w).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, reference(w, x), rtol=1e-4, atol=1e-3)
    assert not got[2].any()


def test_a_rows_bits_do_not_depend_on_its_call_or_the_instruction_set(rows4_library, isa):
    """One row alone, in a call of 3, of 130 (past the kernel's chunks of 64 rows), in a 3-d batch: the same bits;
    plain C, AVX2 and the widest kernel of this CPU agree to the bit."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((72, 96)).astype(np.float32)  # 4 tiles and 8 columns
    x = (rng.standard_normal((130, 96)) * rng.uniform(0.01, 100, (130, 1))).astype(np.float32)
    session = matmul_rows4(rows4_library, w)
    by_isa = {}
    for name in ("c", "avx2", "widest"):
        isa(name)
        whole = session.run(None, {"x": x})[0]
        alone = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
        threes = np.concatenate([session.run(None, {"x": x[i:i + 3]})[0] for i in range(0, 129, 3)])
        assert np.array_equal(whole, alone) and np.array_equal(whole[:129], threes), name
        by_isa[name] = whole
    assert np.array_equal(by_isa["c"], by_isa["avx2"]) and np.array_equal(by_isa["c"], by_isa["widest"])
    batched = matmul_rows4(rows4_library, w, rank=3).run(None, {"x": x[:128].reshape(4, 32, 96)})[0]
    assert np.array_equal(batched.reshape(128, 72), by_isa["c"][:128])


def test_a_wrong_input_is_an_error_not_a_crash(rows4_library):
    session = matmul_rows4(rows4_library, np.ones((16, 64), np.float32), k_dim="k")  # ONNX Runtime lets any K in
    with pytest.raises(Exception, match="not K"):
        session.run(None, {"x": np.ones((2, 32), np.float32)})
    assert session.run(None, {"x": np.ones((0, 64), np.float32)})[0].shape == (0, 16)
    with pytest.raises(UserError, match="divisible by 32"):
        quant.rows4(np.ones((20, 48), np.float32))
    for cut, what in (("B", "packed weights"), ("scales", "scales"), ("zeros", "zero points")):
        short = matmul_rows4(rows4_library, np.ones((16, 64), np.float32), cut=cut)
        with pytest.raises(Exception, match=f"the {what} do not match K and N"):
            short.run(None, {"x": np.ones((2, 64), np.float32)})


@pytest.mark.network
def test_the_header_comes_from_debian_checked(tmp_path, monkeypatch):
    """Where no header is installed, Debian's libonnxruntime-dev is fetched, its SHA-256 checked, and only its
    headers kept; a package whose digest differs is refused, nothing kept."""
    monkeypatch.setattr(kernels, "SYSTEM", ())
    monkeypatch.delenv("ONNXRUNTIME_INCLUDE_DIR", raising=False)
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path / "cache"))
    try:
        folder = kernels.include_dir()
    except UserError as e:
        if "could not be fetched" in str(e):
            pytest.skip(str(e))
        raise
    assert (folder / kernels.HEADER).is_file() and all(p.suffix == ".h" for p in folder.iterdir())
    assert "ORT_API_VERSION" in (folder / kernels.HEADER).read_text()
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(kernels, "DEB", (kernels.DEB[0], "0" * 64))
    with pytest.raises(UserError, match="pinned SHA-256"):
        kernels.include_dir()
    assert not any((tmp_path / "other").rglob("*.h"))


def test_a_named_header_folder_without_the_header_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXRUNTIME_INCLUDE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="ONNXRUNTIME_INCLUDE_DIR has no onnxruntime_c_api.h"):
        kernels.include_dir()


def test_a_compiler_that_does_not_run_is_one_line(tmp_path, monkeypatch, rows4_library):
    """$CC naming no program (or a cache folder that cannot be written) is one line, as a failed compile is."""
    monkeypatch.setenv("ONNXRUNTIME_INCLUDE_DIR", str(kernels.include_dir()))
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    why = kernels.unavailable()
    assert why.startswith("compiling specexport's kernels failed") and "no-such-cc" in why, why
    monkeypatch.setenv("CC", "cc -Wall")  # a command with its arguments, as make takes it
    assert kernels.unavailable() is None and kernels.library().is_file()


def test_projections_our_kernel_does_not_take_stay_row_invariant(tmp_path, rows4_library):
    """--int4-rows on a model whose MLP width (144) is no multiple of 32: its down projections go in 8-bit
    MatMulNBits blocks (int4 ones round a row alone otherwise on some CPUs), the rest in MatMulRows4; it builds,
    checks against transformers and runs."""
    import onnx
    from click.testing import CliRunner
    from conftest import save_folder, tiny_model

    from specexport.cli import main

    folder = save_folder(tiny_model("llama", intermediate_size=144), tmp_path / "odd")
    result = CliRunner().invoke(main, ["build", "--model", str(folder), "--method", "none", "--int4-rows", "--profile",
                                       "off", "--max-context", "128", "--precision", "int4", "--output",
                                       str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    nodes = onnx.load(str(tmp_path / "b" / manifest["graphs"]["target"]["file"]), load_external_data=False).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and all(next(a.i for a in n.attribute if a.name == "bits") == 8 for n in nbits)
    assert sum(n.op_type == "MatMulRows4" for n in nodes) == 2 * 3 + 1
    run = CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--prompt", "the cat sat", "--max-new-tokens", "8"])
    assert run.exit_code == 0, run.output


def test_int4_rows_from_the_cli(tiny_folder, tmp_path, rows4_library):
    """`build --precision int4 --int4-rows`: every projection in MatMulRows4 (the tiny model's LM head, 259 wide,
    too), the manifest names the kernels, `run` loads them; a graph naming kernels this
    specexport lacks is one line; --int4-rows at another precision is one line and writes nothing."""
    import onnx
    from click.testing import CliRunner

    from specexport.cli import main
    from specexport.runtime.generate import Engine

    head = ["build", "--model", str(tiny_folder), "--method", "ngram", "--int4-rows", "--no-validate", "--profile",
            "off", "--max-context", "128"]
    result = CliRunner().invoke(main, [*head, "--precision", "int4", "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["graphs"]["target"]["kernels"] == ["rows4"]
    nodes = onnx.load(str(tmp_path / "b" / manifest["graphs"]["target"]["file"]), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    # a layer's projections: q/k/v as one, o, gate/up as one, down; the head too (259 columns: a last tile of 3)
    assert ops.count("MatMulRows4") == 2 * 4 + 1 and ops.count("MatMulNBits") == 0
    run = CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--prompt", "the cat sat", "--max-new-tokens", "8"])
    assert run.exit_code == 0, run.output
    manifest["graphs"]["target"]["kernels"] = ["rows9"]
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="rows9"):
        Engine.load(tmp_path / "b")
    bad = CliRunner().invoke(main, [*head, "--precision", "int8", "--output", str(tmp_path / "c")])
    assert bad.exit_code != 0 and "--int4-rows is for --precision int4" in bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "c").exists()
    assert os.environ.get("SPECEXPORT_ROWS_ISA") is None


def test_build_takes_the_kernel_where_the_profile_measured_it_faster(tiny_folder, tmp_path, rows4_library, monkeypatch):
    """`[engine] int4_kernel = "rows4"` (cpu-2core-vnni, cpu-2core: measured on AVX-512 VNNI and on AVX2) makes
    --int4-rows the default of an int4 build, and says so; --no-int4-rows keeps MatMulNBits; a profile without it
    (cpu-8core, never measured) keeps MatMulNBits where its int4 is measured row-invariant here, else takes ours."""
    from click.testing import CliRunner

    from specexport.cli import main
    from specexport.exporter import row_invariance

    def kernels_of(profile, *more):
        out = tmp_path / f"{profile}-{len(list(tmp_path.iterdir()))}"
        result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "none", "--precision",
                                           "int4", "--profile", profile, "--no-validate", "--max-context", "128",
                                           "--no-attention-rows", *more, "--output", str(out)])
        assert result.exit_code == 0, result.output
        return json.loads((out / "manifest.json").read_text())["graphs"]["target"].get("kernels"), result.output

    taken, said = kernels_of("cpu-2core-vnni")
    assert taken == ["rows4"] and "as profile cpu-2core-vnni measured it faster" in said
    assert kernels_of("cpu-2core-vnni", "--no-int4-rows")[0] is None
    assert kernels_of("cpu-2core")[0] == ["rows4"]  # measured faster on the AVX2 EPYC too
    # a profile that never measured it (cpu-8core): MatMulNBits where its int4 keeps a row's bits; where it rounds
    # a one-row call otherwise (exporter/row_invariance.py: an AVX2-only CPU), ours, for exactness
    for ours in (True, False):
        monkeypatch.setattr(row_invariance, "rows_apart", lambda bits, apart=ours: apart)
        taken, said = kernels_of("cpu-8core")
        assert (taken == ["rows4"]) == ours and ("exact on this CPU" in said) == ours, said
        # --no-int4-rows there: one line says that MatMulNBits' int4 is not exact on such a CPU
        said = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--precision", "int4", "--profile",
                                         "cpu-8core", "--no-validate", "--max-context", "128", "--no-int4-rows",
                                         "--output", str(tmp_path / f"nbits{ours}")]).output
        assert ("--int4-rows is exact" in said) == ours, said
