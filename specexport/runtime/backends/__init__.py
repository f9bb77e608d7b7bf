"""Which backend runs a bundle's graph on a device (`runtime.backends.protocol.Backend`)."""

from __future__ import annotations

from pathlib import Path

from specexport.errors import UserError
from specexport.runtime.backends.host import GraphSession, providers
from specexport.runtime.backends.iobinding import DeviceSession
from specexport.runtime.backends.protocol import Backend
from specexport.runtime.backends.tensorrt import TensorRTSession

DEVICES = ("auto", "cpu", "cuda", "cpu-iobinding")


def open_graph(path: Path, info: dict, threads: int | None = None, device: str = "auto", spin: bool = True) -> Backend:
    """The backend for a graph on `device`: auto (CUDA when this onnxruntime has it, else CPU), cpu (host buffers),
    cuda (device-resident I/O binding), cpu-iobinding (the device path on CPU, for tests). A graph with a TensorRT
    engine runs on TensorRT unless the device is a CPU one (its ONNX graph then runs on ONNX Runtime)."""
    if device not in DEVICES:
        raise UserError(f"unknown device '{device}'; choose from {', '.join(DEVICES)}")
    if info.get("engine") and device not in ("cpu", "cpu-iobinding"):  # a TensorRT plan (exporter/tensorrt/build.py)
        return TensorRTSession(path, info, threads, device, spin)
    if device == "cpu-iobinding" or "CUDAExecutionProvider" in providers(device):
        return DeviceSession(path, info, threads, "cpu" if device == "cpu-iobinding" else "cuda", spin)
    return GraphSession(path, info, threads, device, spin)
