"""The Hugging Face Hub: the local cache, the offline choice, and downloads of what the exporter reads.

A download fetches a repository's config, safetensors weights and tokenizer into the normal cache (never pickled
weights, never subfolders), with huggingface_hub's progress bars; every failure is one line. Offline (set_offline,
HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE) nothing is fetched.
"""

import json
import os
import re
import sys
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from specexport.errors import UserError, first_line

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
# Exceptions (by class name) that mean the Hub could not be reached (refused, DNS, timeout, dropped), in Python
# and in the HTTP clients huggingface_hub has used: requests before 1.0, httpx in 1.x, httpx2 since 2.0.
NETWORK_ERRORS = {"ConnectionError", "TimeoutError", "Timeout", "TransportError"}
SHARD = re.compile(r"-\d+-of-\d+\.")  # model-00001-of-00004.safetensors


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
            return any(all((folder / shard).is_file() for shard in index_shards(index)) for index in indexes)
        except UserError:  # a damaged index
            return False
    weights = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
    return any(not SHARD.search(w.name) for w in weights)  # shards without their index: not all there yet


# ---- downloading --------------------------------------------------------------------------------


def download(repo_id: str, gguf_file: str | None = None) -> Path:
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


def index_shards(index: Path) -> list[str]:
    """The shard files a weights index (*.index.json) names; UserError when it is damaged."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        raise UserError(f"{index} is damaged (no valid weight_map)") from None


def freeze_offline() -> None:
    """Keep the user's offline choice before HF_HUB_OFFLINE is set for loading (it then stops telling that choice)."""
    global _offline
    if _offline is None:
        _offline = offline_mode()
