"""Which hardware is this, and which bundled profile fits it (`--profile auto`).

GPUs are found through the driver's `nvidia-smi` (name and memory; no Python GPU library); otherwise the
CPU model comes from /proc/cpuinfo (or the platform), its logical core count from the OS, and its kernel features
(AVX2, AVX-512, VNNI, AMX; Arm's dot products: runtime/cpu.py) from the OS's flags. A CPU profile fits by its core
range; it was measured here when it was measured on the same kernel features (`Fit.measured_here`): only then do
its speeds choose a method and precision, and its latencies drive the tree budget. On a GPU, `auto` builds
for TensorRT when it is importable, else for ONNX Runtime's CUDA provider, else says what to install; a GPU profile
named on a host without a GPU is one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass

import onnxruntime as ort

from specexport.errors import UserError
from specexport.profiles.schema import EngineSettings, Profile, bundled, load_profile
from specexport.runtime import cpu


@dataclass(frozen=True)
class Found:
    kind: str  # "gpu" | "cpu"
    name: str
    memory_gb: float  # gpu memory (0 for a CPU)
    cores: int
    features: tuple[str, ...] = ()  # cpu: its kernel features (runtime/cpu.kernel_features)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "memory_gb": self.memory_gb, "cores": self.cores,
                "features": list(self.features)}

    def describe(self) -> str:
        """E.g. "AMD EPYC, 2 cores, avx2 avx512f avx512_vnni"."""
        if self.kind == "gpu":
            return f"{self.name}, {self.memory_gb} GB"
        return f"{self.name}, {self.cores} cores, {' '.join(self.features) or 'no vector features found'}"


@dataclass(frozen=True)
class Fit:
    """How a profile fits the hardware found: `score` 0 = not at all (more = a better fit), whether its measurements
    were made on hardware like this (`measured_here`), and why, in words."""

    score: tuple[int, ...]
    measured_here: bool
    why: str


def detect() -> Found:
    gpu = _nvidia_gpu()
    cores = os.cpu_count() or 1
    if gpu is not None:
        return Found("gpu", gpu[0], gpu[1], cores)
    return Found("cpu", cpu.model_name(), 0.0, cores, cpu.kernel_features())


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


def fits(profile: Profile, found: Found) -> Fit:
    """How well `profile` fits `found`. A GPU profile fits by memory and name (the longest matched name wins); a CPU
    profile by its core range, better where it was measured on this CPU's kernel features than where it has none
    (an unmeasured guess), and least where it was measured on other features (its settings serve; its speeds and
    latencies are another CPU's)."""
    hw = profile.hardware
    name = found.name.lower()
    named = max((len(m) for m in hw.match if m.lower() in name or m == "*"), default=0)
    if hw.kind != found.kind or not named:
        return Fit((0,), False, f"for a {hw.kind}" if hw.kind != found.kind else "another model")
    if found.kind == "gpu":
        if found.memory_gb < hw.min_memory_gb or (hw.max_memory_gb and found.memory_gb > hw.max_memory_gb):
            return Fit((0,), False, f"for {hw.min_memory_gb}-{hw.max_memory_gb or 'any'} GB")
        return Fit((3, 0, 0, named), profile.measured, f"{found.name} matches {'/'.join(hw.match)}")
    if found.cores < hw.min_cores or (hw.max_cores and found.cores > hw.max_cores):
        return Fit((0,), False, f"for {hw.min_cores}-{hw.max_cores or 'any'} cores")
    cores = f"{found.cores} cores in {hw.min_cores}-{hw.max_cores or 'any'}"
    if not hw.features:
        return Fit((2, 0, 0, named), False, f"{cores}; measured on no CPU (a guess for any)")
    measured_on = " ".join(hw.features)
    if set(hw.features) == set(found.features):
        return Fit((3, 0, 0, named), profile.measured, f"{cores}; measured on {measured_on}, as this CPU")
    # the nearest CPU measured: none of its features missing here (an AMX Xeon is nearer a VNNI EPYC than an AVX2
    # one), then the most in common
    missing, shared = len(set(hw.features) - set(found.features)), len(set(hw.features) & set(found.features))
    return Fit((1, -missing, shared, named), False, f"{cores}; measured on {measured_on}, this CPU has "
               f"{' '.join(found.features) or 'none of those'}: its speeds are another CPU's")


def auto_profile(found: Found | None = None) -> tuple[Profile, Found, Fit]:
    """The bundled profile that fits this hardware best (`fits`; then the most specific name, then the name)."""
    found = found or detect()
    scored = [(fits(p, found), p) for p in (load_profile(path) for path in bundled())]
    scored = [(f, p) for f, p in scored if f.score[0] > 0]
    if not scored:
        raise UserError(f"no bundled profile fits this {found.kind} ({found.describe()}); pass --profile NAME|PATH")
    fit, profile = max(scored, key=lambda s: (s[0].score, s[1].name))
    return profile, found, fit


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
        profile, found, fit = auto_profile()
        chosen = {"chosen": "auto", "detected": found.as_dict(), "measured_here": fit.measured_here, "why": fit.why}
        if found.kind == "gpu":
            profile, chosen["backend"] = gpu_backend(profile)
        return profile, chosen
    profile = load_profile(spec)
    if profile.hardware.kind == "gpu" and _nvidia_gpu() is None:
        cpus = [p.name for p in map(load_profile, bundled()) if p.hardware.kind == "cpu"]
        raise UserError(f"profile {profile.name} is for an NVIDIA GPU ({profile.description}) and this host has none: "
                        f"pass --profile auto or a CPU profile ({', '.join(cpus)})")
    found = detect()
    fit = fits(profile, found)
    return profile, {"chosen": spec, "detected": found.as_dict(), "measured_here": fit.measured_here, "why": fit.why}
