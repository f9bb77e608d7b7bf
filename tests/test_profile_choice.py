"""What a profile chooses for a build: the precision per method and the best method, from its measured [speed]
(never from method names), and build takes the detected profile when none is given."""

import json

import pytest
from click.testing import CliRunner

from specexport.cli import main
from specexport.errors import UserError
from specexport.profiles import best_method, bundled, dump, load_profile, parse, precision_for

CPU = (next(p for p in bundled() if p.stem == "cpu-2core")).read_text()
SPEED = "\n[speed]\nnone = { int4 = 120.0, int8 = 80.0 }\nngram = { int8 = 130.5 }\nmedusa = { fp32 = 40 }\n"


def with_speed(speed: str = SPEED) -> str:
    text = CPU.split("\n[speed]")[0]
    return text + speed


def test_precision_and_best_method_follow_the_measured_speed():
    profile = parse(with_speed(), "p.toml")
    assert profile.speed == {"none": {"int4": 120.0, "int8": 80.0}, "ngram": {"int8": 130.5}, "medusa": {"fp32": 40.0}}
    assert precision_for(profile, "none") == "int4" and precision_for(profile, "ngram") == "int8"
    assert precision_for(profile, "medusa") == "fp32"
    assert precision_for(profile, "eagle3") == profile.engine.precision  # not measured: the engine's
    assert best_method(profile) == "ngram"
    assert parse(dump(profile), "p.toml") == profile and profile.as_dict()["speed"]["none"]["int4"] == 120.0
    faster = parse(with_speed(SPEED.replace("int4 = 120.0", "int4 = 140.0")), "p.toml")
    assert best_method(faster) == "none"


def test_a_serving_build_reads_the_serve_speed_where_measured():
    """[serve_speed] (16 requests at once) decides for a serving build, method by method where it has the method,
    [speed] otherwise; a build for one request at a time never reads it."""
    serve = "\n[serve_speed]\nnone = { int4 = 250.0, int8 = 330.0 }\nsuffix = { int8 = 370.0 }\n"
    profile = parse(with_speed(SPEED + serve), "p.toml")
    assert profile.serve_speed == {"none": {"int4": 250.0, "int8": 330.0}, "suffix": {"int8": 370.0}}
    assert precision_for(profile, "none") == "int4" and precision_for(profile, "none", serving=True) == "int8"
    assert precision_for(profile, "medusa", serving=True) == "fp32"  # not measured serving: [speed]'s
    assert best_method(profile) == "ngram" and best_method(profile, serving=True) == "suffix"
    assert parse(dump(profile), "p.toml") == profile and profile.as_dict()["serve_speed"]["suffix"]["int8"] == 370.0
    alone = parse(with_speed(), "p.toml")  # no [serve_speed]: a serving build chooses as any other
    assert precision_for(alone, "none", serving=True) == "int4" and best_method(alone, serving=True) == "ngram"
    with pytest.raises(UserError, match="'none.int8' must be tokens/s > 0, got -1"):
        parse(with_speed(SPEED + serve.replace("330.0", "-1")), "p.toml")


def test_build_serving_takes_the_precision_measured_under_load(tiny_folder, tmp_path, monkeypatch):
    profile = tmp_path / "p.toml"
    profile.write_text(with_speed(SPEED + "\n[serve_speed]\nnone = { int4 = 250.0, int8 = 330.0 }\n"))
    out = tmp_path / "served"
    result = build("--model", tiny_folder, "--method", "none", "--profile", profile, "--serving", "--output", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8"
    assert "precision int8 (the fastest serving, as profile cpu-2core measured)" in result.output
    # served int8 quantizes each row alone, so that batching never changes a request's tokens
    assert manifest["runtime"]["int8_activations"] == "row" and manifest["runtime"]["int8_kernel"] == "channel"
    alone = build("--model", tiny_folder, "--method", "none", "--profile", profile, "--output", tmp_path / "alone")
    assert alone.exit_code == 0, alone.output
    assert json.loads((tmp_path / "alone" / "manifest.json").read_text())["precision"] == "int4"
    given = build("--model", tiny_folder, "--method", "none", "--profile", profile, "--serving", "--precision",
                  "fp32", "--output", tmp_path / "given")  # a given precision wins
    assert given.exit_code == 0, given.output
    assert json.loads((tmp_path / "given" / "manifest.json").read_text())["precision"] == "fp32"


def test_a_profile_without_speed_keeps_its_engine_precision():
    with pytest.raises(UserError, match="'speed' must be a section"):
        parse("speed = 3\n" + with_speed(""), "p.toml")
    profile = parse(with_speed(""), "p.toml")
    assert profile.speed == {} and precision_for(profile, "none") == profile.engine.precision
    with pytest.raises(UserError, match="has no measured \\[speed\\]"):
        best_method(profile)


@pytest.mark.parametrize("speed, needle, message", [
    ("\n[speed]\nbeam = { int8 = 1.0 }\n", "beam", "unknown method 'beam'"),
    ("\n[speed]\nnone = { int3 = 1.0 }\n", "none =", "unknown precision 'int3'"),
    ("\n[speed]\nnone = { int8 = 0 }\n", "none =", "'none.int8' must be tokens/s > 0, got 0"),
    ("\n[speed]\nnone = { int8 = \"fast\" }\n", "none =", "must be tokens/s > 0"),
    ("\n[speed]\nnone = 80.0\n", "none =", "must be a table of precision = tokens/s"),
])  # fmt: skip
def test_a_bad_speed_section_fails_with_file_and_line(speed, needle, message):
    text = with_speed(speed)
    with pytest.raises(UserError) as e:
        parse(text, "bad.toml")
    line = next(n for n, t in enumerate(text.splitlines(), 1) if needle in t)
    assert message in str(e.value) and str(e.value).startswith(f"bad.toml:{line}: "), str(e.value)


def test_the_cpu_profiles_carry_suffix_hybrid_and_speed():
    for name in ("cpu-2core", "cpu-8core", "cpu-server"):
        profile = load_profile(name)
        assert {"suffix", "hybrid"} <= set(profile.methods)
        assert profile.speed and precision_for(profile, "none") == "int4"  # plain int4 decodes fastest on CPUs
        assert best_method(profile) in profile.speed


def build(*args, env=None):
    return CliRunner().invoke(main, ["build", *map(str, args), "--no-validate"], env=env)


def test_build_takes_the_detected_profile_by_default(tiny_folder, tmp_path, monkeypatch):
    profile = tmp_path / "p.toml"
    profile.write_text(with_speed().replace("draft_length = 8", "draft_length = 5"))
    monkeypatch.setattr("specexport.profiles.resolve_profile",  # this machine's: the profile above
                        lambda spec: (load_profile(profile if spec == "auto" else spec),
                                      {"chosen": spec, "measured_here": True, "why": "measured on this CPU's features"}))
    out = tmp_path / "a"
    result = build("--model", tiny_folder, "--method", "ngram", "--output", out, env={"SPECEXPORT_PROFILE": None})
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["profile"]["chosen"] == "auto" and manifest["method"]["draft_length"] == 5
    assert manifest["precision"] == "int8"  # ngram's measured precision
    best = build("--model", tiny_folder, "--method", "best", "--output", tmp_path / "b", "--draft-length", "4",
                 env={"SPECEXPORT_PROFILE": None})
    assert best.exit_code == 0, best.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["method"]["name"] == "ngram" and manifest["method"]["draft_length"] == 4
    assert "method ngram: the fastest that profile cpu-2core measured" in best.output


def test_best_needs_a_profile_and_off_means_none(tiny_folder, tmp_path):
    result = build("--model", tiny_folder, "--method", "best", "--profile", "off", "--output", tmp_path / "b")
    assert result.exit_code == 1 and not (tmp_path / "b").exists()
    assert result.output.strip().splitlines()[-1] == \
        "Error: --method best chooses by a profile's measured speed: not with --profile off"
    result = build("--model", tiny_folder, "--serving", "--profile", "off", "--output", tmp_path / "s")
    assert result.exit_code == 1 and not (tmp_path / "s").exists()
    assert result.output.strip().splitlines()[-1] == \
        "Error: --serving chooses by a profile's measured speed under load: not with --profile off"
    result = build("--model", tiny_folder, "--method", "ngram", "--output", tmp_path / "c")  # SPECEXPORT_PROFILE=off
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest.get("profile") is None and manifest["precision"] == "int8"
