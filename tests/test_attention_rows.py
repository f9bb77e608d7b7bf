"""specexport's own attention kernel (runtime/kernels/attention.c, `--attention-rows`): each real row of a batched
step against a float64 softmax of the keys it sees, its bits independent of the call's other rows, the cache written
where the rows belong, bad inputs refused, and a graph built with it from the CLI checked against transformers."""

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specexport.runtime import kernels, tree

HEADS, KV_HEADS, D = 6, 2, 72  # three query heads a key head; D past one pass of 64 outputs


def attention_rows(library, causal: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """A session of one AttentionRows node."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("q", f, ["r", HEADS * D]),
              helper.make_tensor_value_info("k", f, ["r", KV_HEADS * D]),
              helper.make_tensor_value_info("v", f, ["r", KV_HEADS * D]),
              helper.make_tensor_value_info("rows", i64, ["r"]),
              helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["b", "t", "k"]),
              helper.make_tensor_value_info("past_len", TensorProto.INT32, ["b"]),
              helper.make_tensor_value_info("past_k", f, ["b", KV_HEADS, "s", D]),
              helper.make_tensor_value_info("past_v", f, ["b", KV_HEADS, "s", D])]
    outputs = [helper.make_tensor_value_info("y", f, ["r", HEADS * D]),
               helper.make_tensor_value_info("present_k", f, ["b", KV_HEADS, "s", D]),
               helper.make_tensor_value_info("present_v", f, ["b", KV_HEADS, "s", D])]
    node = helper.make_node("AttentionRows", [i.name for i in inputs], [o.name for o in outputs],
                            domain=kernels.DOMAIN, num_heads=HEADS, kv_num_heads=KV_HEADS, scale=scale,
                            softcap=softcap, causal=causal)
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def step(seed: int, pasts, trees, width: int, capacity: int = 64, behind: int = 0):
    """A batched step: sequence b after pasts[b] cached rows verifies the tree of parents trees[b], padded to
    `width` rows (rows past its tree are padding, not in `rows`); `behind`: the mask also covers that many cache
    rows before the step (a draft's nodes written by earlier calls), each row seeing a random half of them."""
    rng = np.random.default_rng(seed)
    b = len(pasts)
    mask = np.zeros((b, width, behind + width), np.bool_)
    rows = []
    for k, parents in enumerate(trees):
        mask[k, :len(parents), behind:behind + len(parents)] = tree.ancestor_mask(parents)
        mask[k, :len(parents), :behind] = rng.random((len(parents), behind)) < 0.5
        rows += [k * width + t for t in range(len(parents))]
    r = len(rows)
    cache = rng.standard_normal((2, b, KV_HEADS, capacity, D)).astype(np.float32)
    return {"q": rng.standard_normal((r, HEADS * D)).astype(np.float32),
            "k": rng.standard_normal((r, KV_HEADS * D)).astype(np.float32),
            "v": rng.standard_normal((r, KV_HEADS * D)).astype(np.float32),
            "rows": np.asarray(rows, np.int64), "tree_mask": mask, "past_len": np.asarray(pasts, np.int32),
            "past_k": cache[0], "past_v": cache[1]}


def reference(feeds: dict, causal: bool = False, softcap: float = 0.0, scale: float = 0.0) -> tuple:
    """The step in float64: each row's keys and values written at past + t, then its softmax over what it sees."""
    keys, values = feeds["past_k"].astype(np.float64), feeds["past_v"].astype(np.float64)
    width, cols = feeds["tree_mask"].shape[1:]
    scale = scale or 1 / np.sqrt(D)
    for r, row in enumerate(feeds["rows"]):
        b, t = divmod(int(row), width)
        at = feeds["past_len"][b] + t
        keys[b, :, at] = feeds["k"][r].reshape(KV_HEADS, D)
        values[b, :, at] = feeds["v"][r].reshape(KV_HEADS, D)
    y = np.zeros(feeds["q"].shape)
    for r, row in enumerate(feeds["rows"]):
        b, t = divmod(int(row), width)
        past = int(feeds["past_len"][b])
        start = past + width - cols
        seen = np.arange(past + width) < start
        seen[start:] = np.arange(past + width - start) <= t if causal else feeds["tree_mask"][b, t]
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            s = keys[b, g, :past + width][seen] @ feeds["q"][r, h * D:(h + 1) * D] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            y[r, h * D:(h + 1) * D] = p @ values[b, g, :past + width][seen] / p.sum()
    return y, keys, values


@pytest.mark.parametrize("options, behind", [({}, 0), ({"softcap": 2.0, "scale": 0.3}, 0), ({}, 3)],
                         ids=["plain", "softcap", "earlier-nodes"])
def test_each_real_row_attends_to_what_its_tree_shows_it(rows4_library, options, behind):
    """Three sequences of different pasts and trees (a branching one, one row, a chain) padded to 5 rows, the
    longest past over one tile of 64 cache rows: each real row's output and the cache rows it wrote, against float64;
    the past inputs are left as they were."""
    feeds = step(0, [7, 130, 3], [[-1, 0, 0, 1, 2], [-1], [-1, 0, 1]], width=5, capacity=160, behind=behind)
    before = {name: feeds[name].copy() for name in ("past_k", "past_v")}
    y, present_k, present_v = attention_rows(rows4_library, **options).run(None, feeds)
    want, keys, values = reference(feeds, **options)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(present_k, keys, rtol=0, atol=0)
    np.testing.assert_allclose(present_v, values, rtol=0, atol=0)
    assert all(np.array_equal(feeds[name], before[name]) for name in before)


def test_the_causal_form_ignores_the_masks_values(rows4_library):
    """causal=1 (plain decoding's chains): row t sees the cache up to past + t, whatever the mask holds."""
    feeds = step(1, [3, 12], [[-1, 0, 1, 2], [-1, 0]], width=4)
    want = reference(feeds, causal=True)[0]
    feeds["tree_mask"][:] = False
    np.testing.assert_allclose(attention_rows(rows4_library, causal=1).run(None, feeds)[0], want, rtol=1e-4,
                               atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_call_or_the_instruction_set(rows4_library, monkeypatch):
    """A sequence's rows alone in a call of their own width, and beside two other sequences in a wider padded call
    with other threads' work, in the widest loops this CPU runs and in plain C: the same bits."""
    session = attention_rows(rows4_library)
    together = step(2, [9, 21, 4], [[-1, 0, 1], [-1, 0, 0, 1, 1, 2, 3], [-1]], width=7)
    got = session.run(None, together)[0]
    ours = together["rows"] // 7 == 0
    alone = {name: together[name] for name in ("q", "k", "v")}
    alone = {name: value[ours] for name, value in alone.items()}
    alone.update(rows=np.arange(3, dtype=np.int64), tree_mask=together["tree_mask"][:1, :3, :3],
                 past_len=together["past_len"][:1], past_k=together["past_k"][:1], past_v=together["past_v"][:1])
    assert np.array_equal(session.run(None, alone)[0], got[ours])
    monkeypatch.setenv("SPECEXPORT_ROWS_ISA", "c")  # read by each call
    assert np.array_equal(session.run(None, together)[0], got)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(rows=np.array([0, 99], np.int64)), "outside the batch"),
    (lambda f: f.update(past_len=np.array([64, 0], np.int32)), "outside the cache"),
    (lambda f: f.update(q=f["q"][:-1]), "R rows"),
    (lambda f: f.update(past_v=f["past_v"][:, :, :10]), "alike"),
])
def test_a_wrong_input_is_an_error_not_a_crash(rows4_library, change, message):
    feeds = step(3, [5, 6], [[-1], [-1]], width=1)
    change(feeds)
    with pytest.raises(Exception, match=message):
        attention_rows(rows4_library).run(None, feeds)


def test_attention_rows_from_the_cli(tiny_folder, tmp_path, rows4_library):
    """`build --attention-rows`: every layer in AttentionRows, checked against transformers (prefill, trees with and
    without a past, a batch of two), the manifest names the kernel and no lanes, `run` runs it (the exactness tests
    hold it to plain decoding), `info` names it; for a trt build it is one line and writes nothing."""
    import onnx
    from click.testing import CliRunner

    from specexport.cli import main

    head = ["build", "--model", str(tiny_folder), "--method", "ngram", "--profile", "off", "--max-context", "128"]
    result = CliRunner().invoke(main, [*head, "--precision", "fp32", "--attention-rows", "--output", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    target = manifest["graphs"]["target"]
    assert target["kernels"] == ["attention_rows"] and "tree_lanes" not in target
    assert manifest["numerics"]["max_abs_diff"] < 1e-4, manifest["numerics"]
    nodes = onnx.load(str(tmp_path / "a" / target["file"]), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("AttentionRows") == 2 and "GroupQueryAttention" not in ops
    run = CliRunner().invoke(main, ["run", str(tmp_path / "a"), "--prompt", "the cat sat on the mat the cat",
                                    "--max-new-tokens", "16", "--json"])
    assert run.exit_code == 0 and json.loads(run.output[run.output.index("{"):])["text"], run.output
    info = CliRunner().invoke(main, ["info", str(tmp_path / "a")])
    assert "specexport's kernels: attention_rows" in info.output, info.output
    bad = CliRunner().invoke(main, [*head, "--flavour", "trt", "--precision", "fp16", "--attention-rows",
                                    "--output", str(tmp_path / "c")])
    assert bad.exit_code != 0 and "--attention-rows: specexport's attention kernel is for the ort flavour" in bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "c").exists()


def test_a_cpu_profiles_build_takes_it_where_it_fits(tiny_folder, tmp_path, rows4_library, monkeypatch):
    """A build for a CPU profile takes --attention-rows by default and says so; --no-attention-rows keeps
    GroupQueryAttention (and lanes); so does a build without a profile; where the kernels do not compile, the
    default is GroupQueryAttention and the line says why."""
    from click.testing import CliRunner

    from specexport.cli import main

    def built(*more):
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "ngram", "--no-validate",
                                           "--max-context", "128", *more, "--output", str(out)])
        assert result.exit_code == 0, result.output
        target = json.loads((out / "manifest.json").read_text())["graphs"]["target"]
        return target.get("kernels"), "tree_lanes" in target, result.output

    kernels_taken, lanes, said = built("--profile", "cpu-2core", "--precision", "fp32")
    assert kernels_taken == ["attention_rows"] and not lanes and "--attention-rows" in said
    assert built("--profile", "cpu-2core", "--precision", "fp32", "--no-attention-rows")[:2] == (None, True)
    assert built("--profile", "off", "--precision", "fp32")[:2] == (None, True)
    monkeypatch.setattr(kernels, "unavailable", lambda: "no C compiler found")
    kernels_taken, lanes, said = built("--profile", "cpu-2core", "--precision", "fp32")
    assert kernels_taken is None and "GroupQueryAttention: no C compiler found" in said
