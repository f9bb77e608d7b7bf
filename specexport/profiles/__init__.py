"""Per-hardware profiles: one commented TOML file per GPU SKU or CPU class, loaded strictly into frozen settings.

A profile says how to build and run on its hardware: engine (backend, precision, execution provider, graph
flavour), shape limits (batch, context, tokens per verification), and per method the tree or its parameters.
Unknown keys, missing keys and wrong types fail with the file and line. A profile not measured on its hardware
says so (`measured = false`) and where its numbers come from (`source`); `specexport profile` writes measured ones.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError, read_user_text

HERE = Path(__file__).parent / "data"
KINDS = ("gpu", "cpu")
BACKENDS = ("onnxruntime", "tensorrt")
PRECISIONS = ("fp32", "int8", "int4", "fp16", "bf16")
PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider")
FLAVOURS = ("ort", "onnx")


@dataclass(frozen=True)
class Hardware:
    kind: str  # "gpu" | "cpu"
    match: tuple[str, ...]  # case-insensitive substrings of the GPU name / CPU model that select this profile
    min_memory_gb: float = 0.0  # gpu: at least this much memory
    max_memory_gb: float = 0.0  # gpu: at most (0 = no bound)
    min_cores: int = 0  # cpu: logical cores
    max_cores: int = 0  # cpu: (0 = no bound)


@dataclass(frozen=True)
class Engine:
    backend: str
    precision: str
    execution_provider: str
    flavour: str


@dataclass(frozen=True)
class Limits:
    max_batch: int
    max_context: int
    max_tree_tokens: int  # tokens per verification step, root included


@dataclass(frozen=True)
class Medusa:
    tree: str  # a preset or auto:N (or, with `choices`, the measured tree's label)
    choices: tuple[tuple[int, ...], ...] = ()  # an explicit tree (rank paths), as `specexport profile` writes

    @property
    def spec(self) -> str:
        """What --tree takes: the explicit choices as JSON, else the preset or auto:N."""
        import json

        return json.dumps([list(c) for c in self.choices]) if self.choices else self.tree


@dataclass(frozen=True)
class Eagle:
    depth: int
    top_k: int
    total_tokens: int


@dataclass(frozen=True)
class Draft:
    draft_length: int
    branching: tuple[int, ...] = ()  # children per node per depth; () = a chain


@dataclass(frozen=True)
class Ngram:
    draft_length: int
    max_matches: int


@dataclass(frozen=True)
class Measurements:
    """What `specexport profile` measured (empty in unmeasured profiles)."""

    tree_tokens: tuple[int, ...] = ()
    verify_ms: tuple[float, ...] = ()  # per entry of tree_tokens, at `context` tokens of context
    context: int = 0
    propose_ms: float = 0.0
    predicted_tokens_per_s: float = 0.0
    measured_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    measured: bool
    source: str  # where the numbers come from
    hardware: Hardware
    engine: Engine
    limits: Limits
    medusa: Medusa
    eagle: Eagle
    draft: Draft
    ngram: Ngram
    measurements: Measurements = Measurements()
    path: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"hardware": Hardware, "engine": Engine, "limits": Limits, "medusa": Medusa, "eagle": Eagle,
            "draft": Draft, "ngram": Ngram, "measurements": Measurements}
TOP_LEVEL = ("name", "description", "measured", "source")


def bundled() -> list[Path]:
    return sorted(HERE.glob("*.toml"))


def names() -> list[str]:
    return [p.stem for p in bundled()]


def load_profile(spec: str | Path) -> Profile:
    """A bundled profile by name, or a profile file by path."""
    path = Path(spec)
    if not path.suffix and (HERE / f"{spec}.toml").is_file():
        path = HERE / f"{spec}.toml"
    if not path.is_file():
        if path.suffix == ".toml" or path.parent != Path("."):
            raise UserError(f"profile file {path} not found")
        raise UserError(f"unknown profile '{spec}': give a file or one of {', '.join(names())} (or auto)")
    return parse(read_user_text(path, "TOML"), str(path))


def parse(text: str, where: str) -> Profile:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{where}: not valid TOML ({e})") from None
    lines = text.splitlines()

    def fail(section: str | None, key: str | None, message: str):
        raise UserError(f"{where}:{_line(lines, section, key)}: {message}")

    for key in data:
        if key not in TOP_LEVEL and key not in SECTIONS:
            fail(key if isinstance(data[key], dict) else None, None if isinstance(data[key], dict) else key,
                 f"unknown {'section' if isinstance(data[key], dict) else 'key'} '{key}'")
    values = {}
    for key, kind in (("name", str), ("description", str), ("measured", bool), ("source", str)):
        if key not in data:
            fail(None, None, f"missing key '{key}'")
        values[key] = _typed(data[key], kind, lambda m, k=key: fail(None, k, m), key)
    for section, cls in SECTIONS.items():
        table = data.get(section)
        if table is None:
            if section == "measurements":
                continue
            fail(None, None, f"missing section [{section}]")
        if not isinstance(table, dict):
            fail(None, section, f"'{section}' must be a section")
        values[section] = _section(cls, table, lambda key, m, s=section: fail(s, key, m))
    profile = Profile(**values, path=where)
    _check(profile, lambda section, key, m: fail(section, key, m))
    return profile


def _section(cls, table: dict, fail):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            fail(key, f"unknown key '{key}' (allowed: {', '.join(fields)})")
    values = {}
    for name, f in fields.items():
        if name not in table:
            if f.default is dataclasses.MISSING:
                fail(None, f"missing key '{name}'")
            continue
        values[name] = _typed(table[name], f.type, lambda m, k=name: fail(k, m), name)
    return cls(**values)


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "tuple[str, ...]": (str,), "tuple[int, ...]": (int,),
          "tuple[float, ...]": (float,), "tuple[tuple[int, ...], ...]": ((int,),)}


def _typed(value, kind, fail, name):
    kind = _TYPES.get(kind, kind)
    if isinstance(kind, tuple):
        if not isinstance(value, list):
            fail(f"'{name}' must be a list")
        return tuple(_typed(v, kind[0], fail, f"{name} entries") for v in value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        fail(f"'{name}' must be {'a' if kind is not int else 'an'} {kind.__name__}, got {value!r}")
    return value


def _check(p: Profile, fail) -> None:
    from specexport.runtime.medusa_tree import MAX_NODES, PRESETS

    checks = [
        ("hardware", "kind", p.hardware.kind in KINDS, f"kind must be one of {', '.join(KINDS)}"),
        ("hardware", "match", bool(p.hardware.match), "match needs at least one name"),
        ("engine", "backend", p.engine.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}"),
        ("engine", "precision", p.engine.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}"),
        ("engine", "execution_provider", p.engine.execution_provider in PROVIDERS,
         f"execution_provider must be one of {', '.join(PROVIDERS)}"),
        ("engine", "flavour", p.engine.flavour in FLAVOURS, f"flavour must be one of {', '.join(FLAVOURS)}"),
    ]
    for key in ("max_batch", "max_context", "max_tree_tokens"):
        checks.append(("limits", key, getattr(p.limits, key) >= 1, f"{key} must be >= 1, got {getattr(p.limits, key)}"))
    for key in ("min_memory_gb", "max_memory_gb", "min_cores", "max_cores"):
        checks.append(("hardware", key, getattr(p.hardware, key) >= 0, f"{key} must be >= 0"))
    for key in ("depth", "top_k", "total_tokens"):
        checks.append(("eagle", key, getattr(p.eagle, key) >= 1, f"{key} must be >= 1"))
    checks += [
        ("draft", "draft_length", p.draft.draft_length >= 1, "draft_length must be >= 1"),
        ("draft", "branching", all(b >= 1 for b in p.draft.branching), "branching entries must be >= 1"),
        ("ngram", "draft_length", p.ngram.draft_length >= 1, "draft_length must be >= 1"),
        ("ngram", "max_matches", p.ngram.max_matches >= 1, "max_matches must be >= 1"),
    ]
    for section, key, ok, message in checks:
        if not ok:
            fail(section, key, message)
    budget = p.limits.max_tree_tokens
    tree = p.medusa.tree
    m = re.fullmatch(r"auto:(\d+)", tree)
    if p.medusa.choices:
        from specexport.runtime.medusa_tree import make_tree

        try:
            size = make_tree([list(c) for c in p.medusa.choices]).size
        except UserError as e:
            fail("medusa", "choices", str(e))
    elif m:
        size = int(m.group(1)) + 1
    elif tree in PRESETS:
        size = len(PRESETS[tree]) + 1
    else:
        fail("medusa", "tree", f"tree must be a preset ({', '.join(PRESETS)}) or auto:N")
    if size - 1 > MAX_NODES:
        fail("medusa", "tree", f"at most {MAX_NODES} nodes")
    draft_nodes, width = 0, 1
    for b in p.draft.branching + (1,) * max(0, p.draft.draft_length - len(p.draft.branching)):
        width *= b
        draft_nodes += width
    sizes = [("medusa", "tree", size), ("eagle", "total_tokens", p.eagle.total_tokens + 1),
             ("draft", "draft_length", draft_nodes + 1),
             ("ngram", "draft_length", p.ngram.draft_length * p.ngram.max_matches + 1)]
    for section, key, tokens in sizes:
        if tokens > budget:
            fail(section, key, f"the {section} tree has {tokens} tokens per step (root included), over this "
                               f"profile's max_tree_tokens = {budget}")


def _line(lines: list[str], section: str | None, key: str | None) -> int:
    """1-based line of `key` in [section] (or of the section header; or 1 when not found)."""
    current, header = None, None
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        m = re.match(r"\[\s*([A-Za-z0-9_.-]+)\s*\]", stripped)
        if m:
            current = m.group(1)
            if current == section:
                header = n
                if key is None:
                    return n
            continue
        if key is not None and current == section and re.match(rf"{re.escape(key)}\s*=", stripped):
            return n
    return header or 1


def dump(profile: Profile, header: str = "") -> str:
    """TOML text that `parse` reads back into the same profile (comments other than `header` are not kept)."""
    out = [f"# {line}" for line in header.splitlines()]
    out += [f"{key} = {_toml(getattr(profile, key))}" for key in TOP_LEVEL]
    for section in SECTIONS:
        values = getattr(profile, section)
        out += ["", f"[{section}]"] + [f"{f.name} = {_toml(getattr(values, f.name))}" for f in dataclasses.fields(values)]
    return "\n".join(out) + "\n"


def _toml(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value) if isinstance(value, str) else str(value)
