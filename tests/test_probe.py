"""`build --method best` on a CPU whose kernel features no bundled profile was measured on (tune/probe.py): the
probe measures the candidates here once, keeps a profile per machine and model, and the next build reads it; `info`
and `build` say which profile fits and why. The CPU is a fake one (an AMX Xeon's features) on this machine."""

import json
import re

import pytest
from click.testing import CliRunner

from specexport.cli import main
from specexport.exporter import row_invariance
from specexport.profiles import detect as detection
from specexport.profiles.detect import Found, auto_profile, fits
from specexport.profiles.schema import load_profile
from specexport.runtime import cpu
from specexport.tune import probe

AMX = Found("cpu", "Intel(R) Xeon(R) Platinum 8480+", 0.0, 2, ("avx2", "avx512f", "avx512_vnni", "amx_int8"))
AVX2 = Found("cpu", "AMD EPYC 7B12", 0.0, 2, ("avx2",))


@pytest.fixture
def amx_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(detection, "detect", lambda: AMX)
    monkeypatch.setattr(probe, "detect", lambda: AMX)
    monkeypatch.setattr(cpu, "kernel_features", lambda: AMX.features)
    monkeypatch.setattr(cpu, "describe", AMX.describe)
    monkeypatch.setattr(row_invariance, "rows_apart", lambda bits: False)  # MatMulNBits is exact on an AMX Xeon
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "PROMPTS", 2)
    monkeypatch.setattr(probe, "NEW_TOKENS", 16)
    return tmp_path


def test_a_profile_fits_by_cores_and_was_measured_on_the_same_features():
    """cpu-2core was measured on an AVX2 EPYC: it fits a 2-core AMX Xeon (its settings serve) but was not measured
    there, and less well than cpu-2core-vnni, whose features the Xeon all has; on an AVX2 CPU it was measured.
    Unmeasured profiles fit any CPU's features."""
    profile, _, fit = auto_profile(AVX2)
    assert profile.name == "cpu-2core" and fit.measured_here and "measured on avx2, as this CPU" in fit.why
    fit = fits(load_profile("cpu-2core"), AMX)
    assert fit.score[0] > 0 and not fit.measured_here and fit.score < fits(load_profile("cpu-2core-vnni"), AMX).score
    assert "measured on avx2, this CPU has avx2 avx512f avx512_vnni amx_int8" in fit.why
    assert not fits(load_profile("cpu-8core"), AMX).score[0]  # 4-15 cores
    assert fits(load_profile("cpu-8core"), Found("cpu", "x", 0.0, 8, AMX.features)).why.endswith("a guess for any)")


def build(*args):
    return CliRunner().invoke(main, ["build", *map(str, args)])


def test_best_probes_once_then_reads_the_kept_profile(tiny_folder, amx_machine):
    """The first build probes (every candidate in int4 and int8, plain decoding among them) and builds the fastest;
    the second reads the profile kept for this machine and model and probes nothing; --no-probe skips the probe."""
    first = build("--model", tiny_folder, "--method", "best", "--profile", "auto", "--output", amx_machine / "a",
                  "--no-validate")
    assert first.exit_code == 0, first.output
    assert "probing none, " in first.output and "no profile was measured on its features" in first.output
    kept = list((amx_machine / "cache" / "probes").glob("*.toml"))
    assert len(kept) == 1
    profile = load_profile(kept[0])
    assert profile.measured and profile.hardware.features == AMX.features
    assert set(profile.speed["none"]) == {"int4", "int8"} and len(profile.speed) >= 2
    # int4 in both kernels where ours compiles here: the profile keeps the one plain decoding ran faster in
    nbits = float(re.search(r"none int4 ([\d.]+) tokens/s", first.output).group(1))
    ours = re.search(r"none int4 rows4 ([\d.]+) tokens/s", first.output)
    assert ours or "int4 in MatMulNBits only" in first.output
    assert profile.engine.int4_kernel == ("rows4" if ours and float(ours.group(1)) > nbits else "")
    assert profile.speed["none"]["int4"] == max(nbits, float(ours.group(1)) if ours else 0.0)
    best = max(profile.speed, key=lambda m: max(profile.speed[m].values()))
    manifest = json.loads((amx_machine / "a" / "manifest.json").read_text())
    assert manifest["method"]["name"] == best and manifest["precision"] == max(profile.speed[best],
                                                                              key=profile.speed[best].get)
    taken = manifest["graphs"]["target"].get("kernels", [])
    if manifest["precision"] == "int4":  # built in the kernel the probe measured faster
        assert ("rows4" in taken) == bool(profile.engine.int4_kernel)
    assert ("attention_rows" in taken) == bool(ours)  # our attention where our kernels compile (a CPU profile's)
    assert manifest["profile"]["hardware"]["features"] == list(AMX.features)
    assert manifest["profile"]["chosen"] == "probe"

    again = build("--model", tiny_folder, "--method", "best", "--profile", "auto", "--output", amx_machine / "b",
                  "--no-validate")
    assert again.exit_code == 0, again.output
    assert "probing" not in again.output and "the probe kept for" in again.output
    assert json.loads((amx_machine / "b" / "manifest.json").read_text())["method"]["name"] == best

    kept[0].unlink()
    skipped = build("--model", tiny_folder, "--method", "best", "--no-probe", "--profile", "auto", "--output",
                    amx_machine / "c", "--no-validate")
    assert skipped.exit_code == 0, skipped.output
    assert "probing" not in skipped.output and "its speeds were measured on another CPU" in skipped.output
    assert not list((amx_machine / "cache" / "probes").glob("*.toml"))


def test_the_probe_keeps_the_exact_int4_kernel_where_matmulnbits_is_not(monkeypatch):
    """Where MatMulNBits' int4 rounds a row alone otherwise (as `build` then takes our kernel), the kept profile's
    int4 kernel and figures are ours even where MatMulNBits ran plain decoding faster; elsewhere the faster one."""
    measured = {"none": {"int4": 120.0, "int4 rows4": 100.0, "int8": 90.0}, "ngram": {"int4": 150.0,
                                                                                   "int4 rows4": 140.0}}
    for apart, kernel in ((True, "rows4"), (False, "")):
        monkeypatch.setattr(row_invariance, "rows_apart", lambda bits, apart=apart: apart)
        assert probe._int4_kernel(measured) == kernel
        assert probe._folded(measured, kernel)["ngram"]["int4"] == (140.0 if apart else 150.0)
    measured["none"]["int4 rows4"] = 130.0
    assert probe._int4_kernel(measured) == "rows4"  # faster, exact or not
    del measured["none"]["int4 rows4"]  # our kernel did not compile here: MatMulNBits
    monkeypatch.setattr(row_invariance, "rows_apart", lambda bits: True)
    assert probe._int4_kernel(measured) == ""


def test_serving_probes_under_load_once(tiny_folder, amx_machine):
    """`build --serving` where no profile was measured: a probe kept without [serve_speed] (one request at a time) is
    measured again with SERVE_CLIENTS requests at once, in int4 and in the serving int8 (each row quantized alone);
    the build takes the precision fastest under load, and the next serving build reads the kept profile."""
    first = build("--model", tiny_folder, "--method", "best", "--profile", "auto", "--output", amx_machine / "a",
                  "--no-validate")
    assert first.exit_code == 0, first.output
    kept = list((amx_machine / "cache" / "probes").glob("*.toml"))
    assert len(kept) == 1 and not load_profile(kept[0]).serve_speed  # a one-request probe

    served = build("--model", tiny_folder, "--method", "none", "--serving", "--profile", "auto", "--output",
                   amx_machine / "s", "--no-validate")
    assert served.exit_code == 0, served.output
    assert "probing none, " in served.output and f"{probe.SERVE_CLIENTS} requests at once" in served.output
    profile = load_profile(kept[0])
    assert set(profile.serve_speed["none"]) == {"int4", "int8"} and all(
        v > 0 for by in profile.serve_speed.values() for v in by.values())
    assert profile.speed  # the one-request speeds are measured again with them
    manifest = json.loads((amx_machine / "s" / "manifest.json").read_text())
    want = max(profile.serve_speed["none"], key=profile.serve_speed["none"].get)
    assert manifest["precision"] == want
    if want == "int8":
        assert manifest["runtime"]["int8_kernel"] == "channel"

    again = build("--model", tiny_folder, "--method", "none", "--serving", "--profile", "auto", "--output",
                  amx_machine / "t", "--no-validate")
    assert again.exit_code == 0, again.output
    assert "probing" not in again.output and "the probe kept for" in again.output
    assert json.loads((amx_machine / "t" / "manifest.json").read_text())["precision"] == want


def test_info_names_the_profile_and_this_cpu(tiny_folder, amx_machine):
    """`info` says which profile a bundle was built with, the features it was measured on and why it was chosen, and
    whether this CPU has those features."""
    out = amx_machine / "p"
    assert build("--model", tiny_folder, "--method", "ngram", "--profile", "auto", "--output", out,
                 "--no-validate").exit_code == 0
    info = CliRunner().invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "profile      cpu-2core-vnni (" in info.output and "measured on avx2 avx512f avx512_vnni" in info.output
    assert "this CPU     Intel(R) Xeon(R) Platinum 8480+, 2 cores, avx2 avx512f avx512_vnni amx_int8: its profile " \
           "was not measured on these features" in info.output


def test_no_probe_needs_best(tiny_folder, tmp_path):
    result = build("--model", tiny_folder, "--method", "ngram", "--no-probe", "--output", tmp_path / "x")
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == "Error: --no-probe is for --method best and --serving"
