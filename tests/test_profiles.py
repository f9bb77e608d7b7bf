"""Hardware profiles: every bundled file loads strictly and round-trips, bad files fail with file and line,
detection picks the most specific fit, and build --profile uses and records it."""

import json

import pytest
from click.testing import CliRunner
from conftest import method_export

from specexport.cli import main
from specexport.errors import UserError
from specexport.profiles import bundled, dump, load_profile, names, parse
from specexport.profiles import detect as detection
from specexport.profiles.detect import Found, auto_profile
from specexport.runtime.generate import Engine
from specexport.runtime.governor import profiled_latency

GOOD = (bundled()[0]).read_text()


def test_every_bundled_profile_loads_and_round_trips():
    assert len(names()) >= 12
    for path in bundled():
        profile = load_profile(path)
        assert profile.name == path.stem
        assert profile.measured or profile.source.startswith("Unmeasured")  # says so, and where numbers come from
        assert parse(dump(profile), str(path)) == profile


def edited(old, new):
    assert old in GOOD
    return GOOD.replace(old, new, 1)


def line_of(text, needle):
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("text, needle, message", [
    (lambda: edited("[limits]\n", "[limits]\nmax_speed = 3\n"), "max_speed", "unknown key 'max_speed'"),
    (lambda: edited("max_context = ", "max_context = -"), "max_context", "max_context must be >= 1"),
    (lambda: edited("max_context = ", "max_context = \"a lot\" #"), "max_context", "'max_context' must be an int"),
    (lambda: edited("measured = false", "measured = \"no\""), "measured", "'measured' must be a bool"),
    (lambda: edited("max_tree_tokens = ", "max_tree_tokens = 8 #"), "[ngram]", "over this profile's max_tree_tokens = 8"),
    (lambda: edited("[eagle]\n", "[eagle]\nwidth = 3\n"), "width", "unknown key 'width'"),
    (lambda: edited("[eagle]\n", "[eagle]\ntypical = true\n"), "typical", "unknown key 'typical'"),
    (lambda: edited("depth = ", "depth = \"deep\" #"), "depth = ", "depth must be an integer"),
    (lambda: edited("depth = ", "depth = 0 #"), "[eagle]", "--depth must be in 1..16"),
    (lambda: edited("[eagle]", "[eagle]\n[turbo]"), "[turbo]", "unknown section 'turbo'"),
    (lambda: edited("[eagle]", "[measurements]\nbatch_sequences = [1, 4]\nbatch_widths = [1, 2]\nbatch_ms = [[1.0, 2.0]]"
                               "\n[eagle]"), "batch_ms", "batch_ms must have a row per batch_sequences entry"),
    (lambda: edited("[eagle]", "[measurements]\nbatch_sequences = [4, 1]\nbatch_widths = [1]\nbatch_ms = [[1.0], [2.0]]"
                               "\n[eagle]"), "batch_sequences", "batch_sequences must rise from 1 or more"),
    (lambda: edited("[eagle]", "[measurements]\nbatch_ms = [[\"fast\"]]\n[eagle]"), "batch_ms", "must be a float"),
    (lambda: edited("[eagle]", "[measurements]\nbatch_sequences = [1]\nbatch_widths = [1, 2]\nbatch_ms = [[1.0, 2.0]]"
                               "\nbatch_single_ms = [[1.0]]\n[eagle]"), "batch_single_ms", "must have batch_ms's shape"),
])  # fmt: skip
def test_bad_profiles_fail_with_file_and_line(text, needle, message):
    text = text()
    with pytest.raises(UserError) as e:
        parse(text, "bad.toml")
    assert str(e.value).startswith(f"bad.toml:{line_of(text, needle)}: ") and message in str(e.value), str(e.value)


def test_missing_parts_and_unknown_names():
    with pytest.raises(UserError, match="missing section \\[ngram\\]"):
        parse(GOOD[:GOOD.index("[ngram]")], "x.toml")
    with pytest.raises(UserError, match="not valid TOML"):
        parse("name = ", "x.toml")
    with pytest.raises(UserError, match="unknown profile 'tpu-v9'"):
        load_profile("tpu-v9")


@pytest.mark.parametrize("found, name", [
    (Found("gpu", "NVIDIA H100 80GB HBM3", 79.6, 32), "h100-sxm"),
    (Found("gpu", "NVIDIA H100 PCIe", 79.6, 32), "h100-pcie"),
    (Found("gpu", "NVIDIA H200", 139.8, 16), "h200"),
    (Found("gpu", "NVIDIA A100-SXM4-40GB", 39.4, 8), "a100-40gb"),
    (Found("gpu", "NVIDIA A100-SXM4-80GB", 79.2, 8), "a100-80gb"),
    (Found("gpu", "NVIDIA L4", 22.5, 8), "l4"),
    (Found("gpu", "NVIDIA L40S", 44.5, 8), "l40s"),
    (Found("cpu", "AMD EPYC", 0, 2, ("avx2",)), "cpu-2core"),
    (Found("cpu", "AMD EPYC", 0, 2, ("avx2", "avx512f", "avx512_vnni")), "cpu-2core-vnni"),
    (Found("cpu", "Intel(R) Xeon(R) Platinum 8480+", 0, 2, ("avx2", "avx512f", "avx512_vnni", "amx_int8")),
     "cpu-2core-vnni"),  # measured on neither: the VNNI one, whose features this CPU all has, is nearer
    (Found("cpu", "Intel(R) Xeon(R) Silver 4110", 0, 2, ("avx2", "avx512f")), "cpu-2core"),  # no VNNI here
    (Found("cpu", "unknown", 0, 2), "cpu-2core"),  # no features found: the profile that assumes the fewest
    (Found("cpu", "Intel(R) Core(TM) i7", 0, 8), "cpu-8core"),
    (Found("cpu", "AMD EPYC 9654", 0, 192), "cpu-server"),
])  # fmt: skip
def test_auto_picks_the_most_specific_fit(found, name):
    assert auto_profile(found)[0].name == name


def test_no_fit_is_one_clear_error():
    with pytest.raises(UserError, match="no bundled profile fits this gpu"):
        auto_profile(Found("gpu", "Some Future Accelerator", 512, 8))


def test_detect_a_cpu_without_any_gpu_library(monkeypatch):
    monkeypatch.setattr(detection.shutil, "which", lambda name: None)
    found = detection.detect()
    assert found.kind == "cpu" and found.cores >= 1 and found.name


def test_build_with_a_profile_records_it(tiny_folder, tmp_path):
    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "ngram", "--profile",
                                       "cpu-8core", "--output", str(out), "--no-validate"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["profile"]["name"] == "cpu-8core" and manifest["profile"]["chosen"] == "cpu-8core"
    assert manifest["precision"] == "int8" and manifest["method"]["draft_length"] == 8
    assert manifest["method"]["max_matches"] == 2  # the profile's, as no --max-matches was given
    assert "profile      cpu-8core" in CliRunner().invoke(main, ["info", str(out)]).output
    bad = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--profile", "tpu-v9", "--output",
                                    str(tmp_path / "c")])
    assert bad.exit_code == 1 and "unknown profile 'tpu-v9'" in bad.output and not (tmp_path / "c").exists()


def _profile(tiny_folder, tmp_path, method: dict, contexts: str):
    """Build a tiny bundle (tmp_path/b) with `method` (method_export), profile it quickly: (the CLI result, the
    profile written)."""
    from specexport.exporter.export import ExportOptions, export_bundle
    from specexport.exporter.graph import GraphOptions

    export_bundle(str(tiny_folder), tmp_path / "b", ExportOptions(graph=GraphOptions(fused_accept=True),
                                                                  max_context=160, validate=False, **method),
                  quiet=True)
    out = tmp_path / "measured.toml"
    result = CliRunner().invoke(main, ["profile", str(tmp_path / "b"), "--output", str(out), "--base", "cpu-2core",
                                       "--new-tokens", "12", "--max-tokens", "8", "--contexts", contexts, "--reps", "2",
                                       "--threads", "1"])
    assert result.exit_code == 0, result.output
    return result, out


def test_profile_command_measures_chooses_and_reports(tiny_folder, tmp_path):
    from test_medusa import random_heads, write_heads

    heads = write_heads(tmp_path / "heads", random_heads())
    result, out = _profile(tiny_folder, tmp_path, method_export("medusa", heads=str(heads), tree="chain_3"), "16,64")
    assert "chosen auto:" in result.output and "prediction error" in result.output
    profile = load_profile(out)
    chosen = json.loads(profile.methods["medusa"].tree)  # the tree as rank paths
    assert profile.measured and profile.name == "measured" and chosen and all(isinstance(p, list) for p in chosen)
    assert profile.measurements.tree_tokens == (1, 2, 3, 4, 6, 8) and len(profile.measurements.verify_ms) == 6
    assert profile.engine.precision == "fp32" and "measured by specexport profile" in profile.source
    report = (tmp_path / "measured-report" / "report.md").read_text()
    assert "## Verification latency (ms)" in report and "## Trees side by side" in report
    m = profile.measurements  # the batched call by sequences (default --max-batch 16) and width (to --max-tokens)
    assert m.batch_sequences == (1, 2, 4, 8, 16) and m.batch_widths == (1, 2, 4, 8) and m.batch_context == 16
    assert len(m.batch_ms) == 5 and all(len(row) == 4 and min(row) > 0 for row in m.batch_ms)
    # the graph takes ragged rows: the same calls with one real row a sequence (what a width costs alone)
    assert len(m.batch_single_ms) == 5 and all(len(row) == 4 and min(row) > 0 for row in m.batch_single_ms)
    assert "## Batched verification latency (ms)" in report and "one real row a sequence" in report
    for png in ("latency.png", "accept_lengths.png", "predicted_vs_measured.png"):
        assert (tmp_path / "measured-report" / png).read_bytes()[:4] == b"\x89PNG"
    # the measured profile builds: its explicit tree becomes the bundle's (in GroupQueryAttention, as measured: a
    # bundle in our attention kernel measures its own table)
    built = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "medusa", "--heads", str(heads),
                                      "--profile", str(out), "--output", str(tmp_path / "c"), "--no-validate",
                                      "--precision", "fp32", "--no-attention-rows"])
    assert built.exit_code == 0, built.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["method"]["tree"] == chosen
    # ... and carries the batched table, which the batched engine's tree budget reads instead of measuring (it was
    # measured on an fp32 bundle: another precision's kernels scale otherwise, and the scheduler would measure)
    table = profiled_latency(Engine.load(tmp_path / "c", threads=1))
    assert table is not None and table.as_ms() == [list(row) for row in m.batch_ms]
    assert table.as_ms(single=True) == [list(row) for row in m.batch_single_ms]
    ours = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "medusa", "--heads", str(heads),
                                     "--profile", str(out), "--output", str(tmp_path / "d"), "--no-validate",
                                     "--precision", "fp32", "--attention-rows"])
    assert ours.exit_code == 0 and profiled_latency(Engine.load(tmp_path / "d", threads=1)) is None, ours.output
    again = CliRunner().invoke(main, ["profile", str(tmp_path / "b"), "--output", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output


def test_draft_lengths_replay_from_a_longer_proposal():
    """Hand-worked: a proposal cut to depth K, and the accept length of each cut against the emitted tokens (the
    runtime's greedy rule, replayed)."""
    from specexport.tune.measure import cut_depth, replay

    tokens, parents = [4, 5, 6, 7, 9, 8], [-1, 0, 1, 2, 0, 4]  # 5-6-7 and 9-8 below the root 4
    assert cut_depth(tokens, parents, 1) == ([4, 5, 9], [-1, 0, 0])
    assert cut_depth(tokens, parents, 2) == ([4, 5, 6, 9, 8], [-1, 0, 1, 0, 3])
    assert cut_depth(tokens, parents, 3) == (tokens, parents)
    emitted = [5, 6, 4, 4]
    assert [replay(*cut_depth(tokens, parents, k), emitted) for k in (1, 2, 3)] == [2, 3, 3]
    assert replay(tokens, parents, [9, 8, 1]) == 3
    assert replay(tokens, parents, [1]) == 1


def test_a_short_proposal_is_the_start_of_a_long_one(tiny_folder, tmp_path):
    """The premise of the replay: on the same history, draft length K proposes the first K levels of draft length 8
    (a draft model's tree, prompt lookup's chain)."""
    from specexport.exporter.export import ExportOptions, export_bundle
    from specexport.exporter.graph import GraphOptions
    from specexport.runtime.generate import Engine
    from specexport.runtime.sampling import Sampler, SamplingParams
    from specexport.tune.measure import cut_depth

    for method in (method_export("draft", draft_model="self:1", draft_length=3, draft_branching=(2,)),
                   method_export("ngram", draft_length=4, max_matches=1)):
        out = tmp_path / method["method"]
        export_bundle(str(tiny_folder), out, ExportOptions(graph=GraphOptions(fused_accept=True), max_context=128,
                                                           validate=False, **method), quiet=True)
        engine = Engine.load(out, threads=1)
        history = engine.encode("abcab abcab abc", chat=False)
        proposals = {}
        for k in (1, 2, 5, 8):
            engine.configure(draft_length=k)
            proposer = engine.proposer(Sampler(SamplingParams()))
            proposer.start(len(history), 128)
            proposals[k] = proposer.propose(history)
        longest = proposals[8]
        assert len(longest) > 3, method["method"]
        for k in (1, 2, 5):
            cut = cut_depth(longest.tokens, longest.parents, k)
            assert (proposals[k].tokens, proposals[k].parents) == cut, (method["method"], k)


def test_profile_command_chooses_a_draft_length(tiny_folder, tmp_path):
    result, out = _profile(tiny_folder, tmp_path, method_export("ngram", draft_length=3, max_matches=1), "16")
    assert "chosen draft length" in result.output and "prediction error" in result.output
    profile = load_profile(out)
    lengths = [int(line.split("draft length ")[1].split()[0].rstrip(")")) for line in result.output.splitlines()
               if line.startswith("  draft length")]
    assert profile.methods["ngram"].draft_length in lengths and profile.methods["ngram"].max_matches == 1
    assert "## Trees side by side" in (tmp_path / "measured-report" / "report.md").read_text()
    run = CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--prompt", "abab", "--max-new-tokens", "4",
                                    "--draft-length", "2"])
    assert run.exit_code == 0 and "(draft length 2)" in run.output, run.output
    for bad, message in ((["--draft-length", "0"], "--draft-length must be in 1..64"),
                         (["--depth", "2"], "--depth applies to eagle, eagle3")):
        wrong = CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--prompt", "ab"] + bad)
        assert wrong.exit_code == 1 and message in wrong.output, wrong.output


def test_medusa_accept_length_replays_recorded_steps():
    """Hand-worked: head d's candidates by rank, the tokens emitted after the root, and trees of rank paths."""
    import numpy as np

    from specexport.runtime import rank_tree
    from specexport.tune.measure import replay

    candidates = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    samples = [[11, 20, 32], [10, 99, 30], [12, 20]]

    def tau(paths):
        tree = rank_tree.make(paths)
        return np.mean([replay(tree.medusa_tokens(1, candidates), tree.parents, emitted) for emitted in samples])

    assert tau([(0,), (1,), (1, 0), (1, 0, 2)]) == (4 + 2 + 1) / 3
    assert tau([(0,), (0, 0)]) == (1 + 2 + 1) / 3
    assert tau([(2,), (2, 0), (2, 0, 0)]) == (1 + 1 + 3) / 3


def test_a_measured_profile_keeps_the_other_methods_sources():
    import dataclasses

    from specexport.profiles.detect import resolve_profile
    from specexport.tune import _source

    base, _ = resolve_profile("cpu-8core")
    first = _source(base, "CPU X (2 cores)", "medusa on 2026-01-01 (bundle m int8)")
    assert first == "measured by specexport profile on CPU X (2 cores): medusa on 2026-01-01 (bundle m int8)"
    measured = dataclasses.replace(base, measured=True, source=first)
    second = _source(measured, "CPU X (2 cores)", "eagle3 on 2026-01-02 (bundle m int8)")
    assert second.endswith("medusa on 2026-01-01 (bundle m int8); eagle3 on 2026-01-02 (bundle m int8)")
    again = _source(dataclasses.replace(base, measured=True, source=second), "CPU X (2 cores)",
                    "medusa on 2026-01-03 (bundle m int8)")
    assert again.endswith("eagle3 on 2026-01-02 (bundle m int8); medusa on 2026-01-03 (bundle m int8)")
    assert "medusa on 2026-01-01" not in again
    other = _source(dataclasses.replace(base, measured=True, source=second), "GPU Y (80 GB)", "draft on 2026-01-04 (b)")
    assert other == "measured by specexport profile on GPU Y (80 GB): draft on 2026-01-04 (b)"
