"""`specexport triton-serve REPO`: run a model repository on the `tritonserver` that PyTriton bundles (the
tritonserver extra: nvidia-pytriton), for machines without Triton's container.

PyTriton ships Triton's server binary, its Python backend and one backend stub per Python version. The stub runs
the model in this interpreter's Python: it needs this interpreter's libpython (LD_LIBRARY_PATH), this environment's
packages (specexport, onnxruntime, tokenizers: the backend's interpreter ignores PYTHONPATH, so the repository's
model.py adds the site folders named in SPECEXPORT_SITE) and numpy below 2 (the stub reads tensors through numpy
1.x's ABI; with numpy 2 it misreads them silently, so that is refused here). A private folder holds the backend with
the right stub; the server listens on the given address only and stops with this process.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.serve.listen import bound_socket


def pytriton_dir() -> Path:
    try:
        spec = importlib.util.find_spec("pytriton")
    except ModuleNotFoundError:  # an import hook that refuses it
        spec = None
    if spec is None or spec.origin is None:
        raise UserError("specexport triton-serve needs the tritonserver extra: pip install 'specexport[tritonserver]' "
                        "(nvidia-pytriton is not installed)")
    return Path(spec.origin).parent


def command(repo: Path, workspace: Path, host: str, http_port: int, grpc_port: int, metrics_port: int,
            log_verbose: int = 0) -> tuple[list[str], dict]:
    """The server's command line and environment, listening on the numeric address `host`; the backend (with this
    Python's stub) is set up in `workspace`."""
    if int(np.__version__.split(".")[0]) >= 2:
        raise UserError(f"Triton's Python backend stub reads tensors with numpy 1.x, this environment has numpy "
                        f"{np.__version__}: pip install 'numpy<2' (the tritonserver extra pins it)")
    root = pytriton_dir()
    dist = root / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"PyTriton has no Python backend stub for Python {version}")
    backend = workspace / "backends" / "python"
    backend.mkdir(parents=True)
    for item in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist / "backends" / "python" / item, backend / item)
    shutil.copy2(stub, backend / stub.name)
    env = dict(os.environ)
    libs = [str(root.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["SPECEXPORT_SITE"] = os.pathsep.join(site.getsitepackages())  # the repository's model.py adds them
    v6 = ":" in host  # HTTP and metrics spell an IPv6 address ipv6:ADDR (libevhtp), gRPC [ADDR]
    http, grpc = (f"ipv6:{host}", f"[{host}]") if v6 else (host, host)
    argv = [str(dist / "bin" / "tritonserver"), f"--model-repository={repo}",
            f"--backend-directory={workspace / 'backends'}", f"--http-address={http}", f"--http-port={http_port}",
            f"--grpc-address={grpc}", f"--grpc-port={grpc_port}", f"--metrics-address={http}",
            f"--metrics-port={metrics_port}", "--exit-on-error=true", "--strict-readiness=true",
            f"--log-verbose={log_verbose}"]
    return argv, env


def listen_address(host: str, ports: dict[str, int]) -> str:
    """`host` as the numeric address Triton is given, each of `ports` (option name: port) checked free for listening
    there now and no two the same: one line before Triton spends its start loading the models (it then fails on a
    port in use in its own log). Numeric, because Triton's HTTP endpoint reads only numbers: a name, or an IPv6
    address, binds it to 255.255.255.255."""
    if len(set(ports.values())) < len(ports):
        raise UserError(f"{', '.join(ports)} must be different ports")
    for option, port in ports.items():
        with bound_socket(host, port, option) as probe:
            address = probe.getsockname()[0]
    return address


def serve(repo, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          log_verbose: int = 0) -> int:
    """Run tritonserver on `repo` until it exits or this process gets SIGTERM/SIGINT (passed on: Triton finishes
    its in-flight requests, then exits); returns its exit code."""
    repo = Path(repo).resolve()
    if not repo.is_dir() or not any(p.joinpath("config.pbtxt").is_file() for p in repo.iterdir()):
        raise UserError(f"{repo} is not a Triton model repository (no model folder with a config.pbtxt)")
    host = listen_address(host, {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port})
    with tempfile.TemporaryDirectory(prefix="specexport-triton-") as workspace:
        argv, env = command(repo, Path(workspace), host, http_port, grpc_port, metrics_port, log_verbose)
        server = subprocess.Popen(argv, env=env)
        forward = lambda sig, _frame: server.send_signal(sig)  # noqa: E731
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return server.wait()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
