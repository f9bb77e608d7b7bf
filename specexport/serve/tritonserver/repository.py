"""`specexport triton BUNDLE --output REPO`: a Triton Inference Server model repository over a bundle.

    REPO/NAME/config.pbtxt     Python backend, decoupled; the inputs and outputs of tritonserver/__init__.py;
                               instance_group (CPU; a GPU each for a bundle of TensorRT engines); parameters: the
                               bundle, its manifest's sha256, batching, the engine's settings
    REPO/NAME/1/model.py       imports specexport.serve.tritonserver.model (specexport must be importable by the
                               server's Python backend: installed in its environment)
    REPO/NAME/1/bundle/        with --copy: the bundle itself (its files' sha256 checked at load); otherwise the
                               config names the bundle's absolute path, which every node running the model must see

The repository is written whole or not at all (fsutil.staged_output); --overwrite replaces only a repository this
command wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from specexport.bundle import load_bundle
from specexport.errors import UserError
from specexport.fsutil import staged_output
from specexport.serve.tritonserver import INPUTS, OUTPUTS
from specexport.serve.tritonserver.model import manifest_sha256

MODEL_PY = '''\
# Written by `specexport triton`: Triton's Python backend loads this file; the model is specexport's own.
import os
import site
import sys

# `specexport triton-serve` names its environment's site folders here (the backend's interpreter ignores PYTHONPATH);
# under another tritonserver, specexport is installed in the backend's own environment.
_before = list(sys.path)
for _folder in filter(None, os.environ.get("SPECEXPORT_SITE", "").split(os.pathsep)):
    site.addsitedir(_folder)
sys.path[:] = [p for p in sys.path if p not in _before] + _before

from specexport.serve.tritonserver.model import TritonPythonModel  # noqa: E402,F401
'''
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def write_repository(bundle, output, name: str | None = None, copy: bool = False, instances: int | None = None,
                     max_batch: int = 8, threads: int | None = None, max_context: int | None = None,
                     prefill_chunk: int | None = None, batching: bool = True, overwrite: bool = False) -> Path:
    """Write the repository; returns the model's folder. `instances`: model instances (each its own process,
    engine and KV pool), by default one per group of as many cores as the bundle's profile was chosen for (one in
    all without a profile; one per GPU for TensorRT engines); `threads` defaults to this machine's cores / instances
    (the machine that writes the repository is taken to be the one that serves it). `batching`:
    concurrent requests share target calls (the batched scheduler, ONNX Runtime bundles); else, and always for a
    bundle of TensorRT engines (one GPU per instance), an instance runs its requests one at a time."""
    loaded = load_bundle(bundle)
    on_gpu = loaded.manifest["flavour"] != "ort"  # TensorRT engines: a GPU per instance, requests one at a time
    name = name or Path(bundle).resolve().name
    if not NAME.fullmatch(name):
        raise UserError(f"model name {name!r}: use letters, digits, '_', '.' and '-' (at most 128, not starting "
                        "with '.' or '-')")
    cores = os.cpu_count() or 1
    if instances is None:
        group = loaded.profile_cores
        instances = max(1, cores // group) if group and not on_gpu else 1
    if instances < 1 or max_batch < 1:
        raise UserError("--instances and --max-batch must be >= 1")
    threads = threads or max(1, cores // instances)
    source = Path(bundle).resolve()
    with staged_output(Path(output), overwrite, "a Triton model repository written by specexport triton",
                       is_repository) as repo:
        version = repo / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(MODEL_PY)
        if copy:
            shutil.copytree(source, version / "bundle")
            load_bundle(version / "bundle")  # every file's sha256 against the manifest
        parameters = {"bundle": "bundle" if copy else str(source), "manifest_sha256": manifest_sha256(source),
                      "batching": str(batching and not on_gpu).lower(), "max_batch": max_batch, "threads": threads,
                      "max_context": max_context or "",
                      "prefill_chunk": prefill_chunk or ""}
        (repo / name / "config.pbtxt").write_text(config_pbtxt(name, instances, parameters,
                                                               "KIND_GPU" if on_gpu else "KIND_CPU"))
    return Path(output) / name


def config_pbtxt(name: str, instances: int, parameters: dict, kind: str = "KIND_CPU") -> str:
    def tensor(entry, optional):
        tname, dtype, dims = entry
        return (f"  {{ name: {_quote(tname)} data_type: {dtype} dims: {dims}" + (" optional: true" if optional else "")
                + " }")

    lines = ["# Written by `specexport triton`: the bundle's batched engine behind Triton's Python backend.",
             f"name: {_quote(name)}", 'backend: "python"', "max_batch_size: 0  # the model batches by itself",
             "model_transaction_policy { decoupled: true }",
             "input [", ",\n".join(tensor(e, True) for e in INPUTS), "]",
             "output [", ",\n".join(tensor(e, False) for e in OUTPUTS), "]",
             f"instance_group [ {{ count: {instances} kind: {kind} }} ]"]
    lines += [f"parameters {{ key: {_quote(k)} value {{ string_value: {_quote(str(v))} }} }}"
              for k, v in parameters.items()]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def is_repository(folder: Path) -> bool:
    """A repository `specexport triton` wrote: every entry a model folder whose model.py is ours."""
    entries = list(folder.iterdir())
    return bool(entries) and all((e / "1" / "model.py").is_file() and (e / "1" / "model.py").read_text(
        errors="replace") == MODEL_PY for e in entries)
