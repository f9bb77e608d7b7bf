"""The profile file: one commented TOML file per GPU SKU or CPU class, loaded strictly into frozen settings.

A profile says how to build and run on its hardware: engine (backend, precision, graph flavour), shape limits
(context, tokens per verification), and per method the settings it chose (each method's section holds its
runtime Settings fields: runtime/methods). Unknown keys, missing keys and wrong types fail with the file and line.
A profile not measured on its hardware says so (`measured = false`) and where its numbers come from (`source`);
`specexport profile` writes measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from specexport.errors import UserError, read_user_text
from specexport.options import fields as setting_fields
from specexport.options import with_given
from specexport.runtime import cpu, kernels, methods

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).parent / "data"
KINDS = ("gpu", "cpu")
BACKENDS = ("onnxruntime", "tensorrt")
PRECISIONS = ("fp32", "int8", "int4", "fp16", "bf16")
FLAVOURS = ("ort", "onnx", "trt")
# method sections: section name -> the runtime Settings it holds (EAGLE-1/2 and EAGLE-3 share "eagle")
METHOD_SECTIONS = {m.profile_section: m for m in methods.METHODS.values() if m.profile_section}


@dataclass(frozen=True)
class Hardware:
    kind: str  # "gpu" | "cpu"
    match: tuple[str, ...]  # case-insensitive substrings of the GPU name / CPU model that select this profile
    min_memory_gb: float = 0.0  # gpu: at least this much memory
    max_memory_gb: float = 0.0  # gpu: at most (0 = no bound)
    min_cores: int = 0  # cpu: logical cores
    max_cores: int = 0  # cpu: (0 = no bound)
    # cpu: the kernel features (runtime/cpu.KERNEL_FEATURES) of the CPU its speeds were measured on; its [speed]
    # and latencies hold on a CPU with the same ones (empty: not measured, any CPU)
    features: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSettings:
    backend: str
    precision: str
    flavour: str
    # "rows4": int4 builds of the ort flavour take specexport's own kernel (--int4-rows), measured faster here at
    # every row count; "": ONNX Runtime's MatMulNBits
    int4_kernel: str = ""


@dataclass(frozen=True)
class Limits:
    max_context: int
    max_tree_tokens: int  # tokens per verification step, root included


@dataclass(frozen=True)
class Measurements:
    """What `specexport profile` measured (empty in unmeasured profiles)."""

    tree_tokens: tuple[int, ...] = ()
    verify_ms: tuple[float, ...] = ()  # per entry of tree_tokens, at `context` tokens of context
    context: int = 0
    propose_ms: float = 0.0
    predicted_tokens_per_s: float = 0.0
    measured_tokens_per_s: float = 0.0
    # one batched target call by sequences (rows of batch_ms) and width (columns), each sequence after batch_context
    # tokens: the batched engine's tree budget reads it (runtime/budget.BatchLatency)
    batch_context: int = 0
    batch_sequences: tuple[int, ...] = ()
    batch_widths: tuple[int, ...] = ()
    batch_ms: tuple[tuple[float, ...], ...] = ()
    # the same calls with one real row a sequence (a graph with ragged rows: what a width costs alone; empty: not
    # measured, and the batched engine measures it when it starts)
    batch_single_ms: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    measured: bool
    source: str  # where the numbers come from
    hardware: Hardware
    engine: EngineSettings
    limits: Limits
    methods: dict = field(default_factory=dict)  # method section -> its runtime Settings
    measurements: Measurements = Measurements()
    speed: dict = field(default_factory=dict)  # method -> precision -> measured tokens/s ([speed]; may be empty)
    serve_speed: dict = field(default_factory=dict)  # the same, many requests at once ([serve_speed]; may be empty)
    path: str = ""

    def as_dict(self) -> dict:
        """For a bundle's manifest: plain JSON values, the file named but not where it lies."""
        data = {k: dataclasses.asdict(getattr(self, k)) for k in SECTIONS}
        data.update({k: getattr(self, k) for k in TOP_LEVEL}, path=Path(self.path).name)
        data["methods"] = {name: dataclasses.asdict(s) for name, s in self.methods.items()}
        data.update({key: {m: dict(by) for m, by in getattr(self, key).items()} for key in SPEED_TABLES})
        return data


SECTIONS = {"hardware": Hardware, "engine": EngineSettings, "limits": Limits, "measurements": Measurements}
TOP_LEVEL = ("name", "description", "measured", "source")
# optional, [name] method = { precision = tokens/s, ... } as measured on this hardware: [speed] one request at a time
# (benchmarks/side_by_side.py), [serve_speed] the aggregate over 16 concurrent requests (benchmarks/bench_batch.py, C = 16)
SPEED_TABLES = ("speed", "serve_speed")


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
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{where}: not valid TOML ({e})") from None
    lines = text.splitlines()

    def fail(section: str | None, key: str | None, message: str):
        raise UserError(f"{where}:{_line(lines, section, key)}: {message}")

    for key in data:
        if key not in TOP_LEVEL and key not in SECTIONS and key not in METHOD_SECTIONS and key not in SPEED_TABLES:
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
    values["methods"] = {}
    for section, method in METHOD_SECTIONS.items():
        table = data.get(section)
        if table is None:
            fail(None, None, f"missing section [{section}]")
        if not isinstance(table, dict):
            fail(None, section, f"'{section}' must be a section")
        values["methods"][section] = _method_section(method, table, lambda key, m, s=section: fail(s, key, m))
    for table in SPEED_TABLES:
        values[table] = _speed(table, data.get(table, {}), lambda key, m, t=table: fail(t, key, m))
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


def _speed(name: str, table, fail) -> dict:
    """[speed] or [serve_speed]: per method (a runtime method's name), per precision, the tokens/s measured (> 0)."""
    if not isinstance(table, dict):
        fail(None, f"'{name}' must be a section")
    speed = {}
    for method, by in table.items():
        if method not in methods.METHODS:
            fail(method, f"unknown method '{method}' (allowed: {', '.join(methods.METHODS)})")
        if not isinstance(by, dict) or not by:
            fail(method, f"'{method}' must be a table of precision = tokens/s, e.g. {{ int8 = 80.0 }}")
        for precision, value in by.items():
            if precision not in PRECISIONS:
                fail(method, f"'{method}': unknown precision '{precision}' (allowed: {', '.join(PRECISIONS)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                fail(method, f"'{method}.{precision}' must be tokens/s > 0, got {value!r}")
        speed[method] = {precision: float(value) for precision, value in by.items()}
    return speed


def _method_section(method, table: dict, fail):
    """A method's section: its runtime Settings fields (those a bundle saves), each optional (the default)."""
    known = [f.name for f in setting_fields(method.Settings) if f.build]
    for key in table:
        if key not in known:
            fail(key, f"unknown key '{key}' (allowed: {', '.join(known)})")
    for key, value in table.items():  # each value's kind, so an error names its own line
        try:
            with_given(method.Settings(), {key: value}, "profile")
        except UserError as e:
            fail(key, str(e).removeprefix("profile: "))
    return with_given(method.Settings(), table, "profile")


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "tuple[str, ...]": (str,), "tuple[int, ...]": (int,),
          "tuple[float, ...]": (float,), "tuple[tuple[int, ...], ...]": ((int,),),
          "tuple[tuple[float, ...], ...]": ((float,),)}


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
    checks = [
        ("hardware", "kind", p.hardware.kind in KINDS, f"kind must be one of {', '.join(KINDS)}"),
        ("hardware", "match", bool(p.hardware.match), "match needs at least one name"),
        ("hardware", "features", set(p.hardware.features) <= set(cpu.KERNEL_FEATURES),
         f"features must be among {', '.join(cpu.KERNEL_FEATURES)}"),
        ("engine", "backend", p.engine.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}"),
        ("engine", "precision", p.engine.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}"),
        ("engine", "flavour", p.engine.flavour in FLAVOURS, f"flavour must be one of {', '.join(FLAVOURS)}"),
        ("engine", "int4_kernel", p.engine.int4_kernel in ("", *kernels.NAMES),
         f"int4_kernel must be empty or one of {', '.join(kernels.NAMES)}"),
    ]
    for key in ("max_context", "max_tree_tokens"):
        checks.append(("limits", key, getattr(p.limits, key) >= 1, f"{key} must be >= 1, got {getattr(p.limits, key)}"))
    for key in ("min_memory_gb", "max_memory_gb", "min_cores", "max_cores"):
        checks.append(("hardware", key, getattr(p.hardware, key) >= 0, f"{key} must be >= 0"))
    m = p.measurements
    checks.append(("measurements", "batch_ms", len(m.batch_ms) == len(m.batch_sequences) and all(
        len(row) == len(m.batch_widths) for row in m.batch_ms), "batch_ms must have a row per batch_sequences entry "
                   "and a column per batch_widths entry"))
    checks.append(("measurements", "batch_single_ms", not m.batch_single_ms or [len(r) for r in m.batch_single_ms] == [
        len(r) for r in m.batch_ms], "batch_single_ms, where given, must have batch_ms's shape"))
    for key in ("batch_sequences", "batch_widths"):
        values = getattr(m, key)
        checks.append(("measurements", key, all(v >= 1 for v in values) and list(values) == sorted(set(values)),
                       f"{key} must rise from 1 or more"))
    for section, key, ok, message in checks:
        if not ok:
            fail(section, key, message)
    budget = p.limits.max_tree_tokens
    for section, method in METHOD_SECTIONS.items():
        settings = p.methods[section]
        try:  # the method's own checks, as for a build with these settings
            method.settings({}, dataclasses.asdict(settings))
            tokens = method.tokens_per_step(settings)
        except UserError as e:
            fail(section, None, str(e))
        if tokens > budget:
            fail(section, None, f"the {section} tree has {tokens} tokens per step (root included), over this "
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
    tables = [(name, getattr(profile, name)) for name in SECTIONS if name != "measurements"]
    tables += list(profile.methods.items()) + [("measurements", profile.measurements)]
    for name, values in tables:
        kept = [f for f in setting_fields(type(values)) if f.build] if name in profile.methods else \
            dataclasses.fields(values)
        out += ["", f"[{name}]"] + [f"{f.name} = {_toml(getattr(values, f.name))}" for f in kept]
    for table in SPEED_TABLES:
        if measured := getattr(profile, table):
            out += ["", f"[{table}]"] + [f"{m} = {{ {', '.join(f'{p} = {v!r}' for p, v in by.items())} }}"
                                         for m, by in measured.items()]
    return "\n".join(out) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value) if isinstance(value, str) else str(value)
