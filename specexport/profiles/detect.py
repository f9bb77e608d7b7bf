"""Which hardware is this, and which bundled profile fits it (`--profile auto`).

GPUs are found through the driver's `nvidia-smi` (name and memory; no Python GPU library); otherwise the
CPU model comes from /proc/cpuinfo (or the platform) and its logical core count from the OS. On a GPU, `auto` builds
for TensorRT when it is importable, else for ONNX Runtime's CUDA provider, else says what to install; a GPU profile
named on a host without a GPU is one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass

import onnxruntime as ort

from specexport.errors import UserError
from specexport.profiles.schema import EngineSettings, Profile, bundled, load_profile


@dataclass(frozen=True)
class Found:
    kind: str  # "gpu" | "cpu"
    name: str
    memory_gb: float  # gpu memory (0 for a CPU)
    cores: int

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "memory_gb": self.memory_gb, "cores": self.cores}


def detect() -> Found:
    gpu = _nvidia_gpu()
    cores = os.cpu_count() or 1
    if gpu is not None:
        return Found("gpu", gpu[0], gpu[1], cores)
    return Found("cpu", _cpu_model(), 0.0, cores)


def _nvidia_gpu() -> tuple[str, float] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    name, _, memory = first.rpartition(",")
    try:
        return name.strip(), round(float(memory) / 1024, 1)  # MiB -> GiB
    except ValueError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def fits(profile: Profile, found: Found) -> int:
    """How well `profile` fits `found`: 0 = not at all, else the length of the matched name (more = more specific)."""
    hw = profile.hardware
    if hw.kind != found.kind:
        return 0
    if found.kind == "gpu":
        if found.memory_gb < hw.min_memory_gb or (hw.max_memory_gb and found.memory_gb > hw.max_memory_gb):
            return 0
    elif found.cores < hw.min_cores or (hw.max_cores and found.cores > hw.max_cores):
        return 0
    name = found.name.lower()
    return max((len(m) for m in hw.match if m.lower() in name or m == "*"), default=0)


def auto_profile(found: Found | None = None) -> tuple[Profile, Found]:
    """The bundled profile that fits this hardware best (the most specific name match)."""
    found = found or detect()
    scored = [(fits(p, found), p.name, p) for p in (load_profile(path) for path in bundled())]
    scored = [s for s in scored if s[0] > 0]
    if not scored:
        raise UserError(f"no bundled profile fits this {found.kind} ({found.name}, {found.cores} cores"
                        f"{f', {found.memory_gb} GB' if found.kind == 'gpu' else ''}); pass --profile NAME|PATH")
    return max(scored, key=lambda s: (s[0], s[1]))[2], found


def importable(module: str) -> bool:
    """Whether `module` can be imported here (found without importing it)."""
    return importlib.util.find_spec(module) is not None


def gpu_backend(profile: Profile) -> tuple[Profile, str]:
    """The profile as this GPU host can build it: its TensorRT engine when `tensorrt` is importable, else ONNX
    Runtime's CUDA provider (the ort flavour at the profile's precision), else one line saying what to install."""
    if profile.engine.backend != "tensorrt" or importable("tensorrt"):
        return profile, profile.engine.backend
    if "CUDAExecutionProvider" in ort.get_available_providers():
        engine = EngineSettings("onnxruntime", profile.engine.precision, "ort")
        return dataclasses.replace(profile, engine=engine), "onnxruntime (CUDA; TensorRT is not installed)"
    raise UserError("this NVIDIA GPU host has no GPU backend: pip install tensorrt (>= 10.15) cuda-python for "
                    "TensorRT engines, or pip install onnxruntime-gpu for ONNX Runtime CUDA")


def resolve_profile(spec: str) -> tuple[Profile, dict]:
    """(profile, how it was chosen) for --profile auto|NAME|PATH."""
    if spec == "auto":
        profile, found = auto_profile()
        chosen = {"chosen": "auto", "detected": found.as_dict()}
        if found.kind == "gpu":
            profile, chosen["backend"] = gpu_backend(profile)
        return profile, chosen
    profile = load_profile(spec)
    if profile.hardware.kind == "gpu" and _nvidia_gpu() is None:
        cpu = [p.name for p in map(load_profile, bundled()) if p.hardware.kind == "cpu"]
        raise UserError(f"profile {profile.name} is for an NVIDIA GPU ({profile.description}) and this host has none: "
                        f"pass --profile auto or a CPU profile ({', '.join(cpu)})")
    return profile, {"chosen": spec}
