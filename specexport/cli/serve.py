"""serve: the OpenAI-compatible server over a bundle (the serve extra: FastAPI, uvicorn, prometheus-client)."""

from __future__ import annotations

import importlib.util
import ipaddress
import re
from pathlib import Path

import click

from specexport.bundle import load_bundle
from specexport.cli import needs_extra
from specexport.errors import UserError
from specexport.runtime import prefix
from specexport.runtime.backends import DEVICES
from specexport.serve.server import chat_template_file
from specexport.serve.server import serve as run_server
from specexport.serve.tools import PARSERS

ORIGIN = re.compile(r"[a-z][a-z0-9+.\-]*://[^/\s,]+")  # a browser's Origin: scheme://host[:port], no path


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback unless told otherwise; 0.0.0.0 for every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: a free port.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True,
              help="The most requests decoded together in one target call.")
@click.option("--max-queue", type=click.IntRange(0), default=64, show_default=True,
              help="Requests waiting beyond the batch; past that a request gets a 429 with Retry-After.")
@click.option("--api-key", envvar="SPECEXPORT_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (also from "
                   "$SPECEXPORT_API_KEY).")
@click.option("--served-model-name", default=None, help="The model name clients send (default: the bundle's folder "
                                                        "name).")
@click.option("--drain-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds SIGTERM/SIGINT waits for running requests before cancelling them.")
@click.option("--threads", type=click.IntRange(1), default=None, help="ORT intra-op threads (default: all cores).")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None,
              help="The most tokens of one prompt fed per step (a long prompt holds the running streams back one "
                   "chunk per step). [default: 512; 128 where prompts go in the trees' call (--attention-rows)]")
@click.option("--prefill-tokens", type=click.IntRange(1), default=None,
              help="Feed several waiting prompts' chunks in one call, up to this many prompt tokens a step (fewer "
                   "steps for a burst of arrivals; each prompt in the call waits for the whole call). [default: one "
                   "prompt a step, measured best on a 2-core CPU; 256 where prompts go in the trees' call]")
@click.option("--max-context", type=click.IntRange(2), default=None,
              help="Prompt plus new tokens per request (default: the bundle's context). The KV cache holds "
                   "--max-batch x this many tokens.")
@click.option("--prefix-cache", type=click.IntRange(0), default=prefix.BUDGET >> 20, show_default=True, metavar="MIB",
              help="KV rows of prompts' beginnings kept for later prompts (system prompts, a conversation's earlier "
                   "turns), in MiB; 0: none kept.")
@click.option("--max-body-bytes", type=click.IntRange(1024), default=4 << 20, show_default=True,
              help="Larger request bodies get a 413.")
@click.option("--strict", is_flag=True,
              help="Refuse request fields this server does not know with a 400. Without it they are accepted, "
                   "ignored, and named in the response's X-Specexport-Ignored-Fields header and the log (as vLLM "
                   "accepts them); fields it knows but cannot honour are refused either way.")
@click.option("--allowed-origins", multiple=True, metavar="ORIGINS",
              help="Browser origins allowed to call the API (CORS), e.g. https://app.example.com; comma-separated or "
                   "repeated; '*': any. Default: none (no CORS headers: a page from another origin cannot call it).")
@click.option("--chat-template", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="A Jinja chat template used instead of the bundle's (requests' chat_template_kwargs are its "
                   "variables).")
@click.option("--tool-call-parser", type=click.Choice(sorted(PARSERS)), default=None,
              help="How the model writes tool calls (default: what its chat template's markers say: <tool_call> is "
                   "hermes, [TOOL_CALLS] mistral, <|python_tag|> llama3_json).")
@click.option("--device", type=click.Choice([d for d in DEVICES if d != "auto"]), default="cpu", show_default=True,
              help="cuda: the engine and its KV pool on the GPU (ONNX Runtime's I/O binding; onnxruntime-gpu). "
                   "cpu-iobinding: that device path run on the CPU.")
@click.option("--ray", "on_ray", is_flag=True, help="Serve on Ray Serve: replicas, each with its own engine, behind "
                                                      "Ray's proxy (the ray extra).")
@click.option("--replicas", type=click.IntRange(1), default=None, help="--ray: this many replicas (default 1).")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="--ray: between MIN and MAX replicas, scaled on ongoing requests (--max-batch per replica).")
@click.option("--address", default=None, help="--ray: a Ray cluster to join (default: a local instance).")
@click.option("--num-cpus", type=click.FloatRange(0, min_open=True), default=None,
              help="--ray: CPUs each replica reserves (default: --threads, else the cores of the machine the "
                   "bundle's profile was chosen for, else 1).")
@click.option("--detach", is_flag=True, help="--ray --address: leave the application on the cluster and exit once it "
                                             "runs; deploying again is a rolling update (a new bundle replaces the "
                                             "replicas without dropping requests).")
@click.option("--start-timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="--ray: seconds for every replica to start before the deployment is given up.")
def serve(bundle, host, port, max_batch, max_queue, api_key, served_model_name, drain_timeout, threads,
          prefill_chunk, prefill_tokens, max_context, prefix_cache, max_body_bytes, strict, allowed_origins,
          chat_template, tool_call_parser, device, on_ray, replicas, autoscale, address, num_cpus, detach,
          start_timeout):
    """Serve a bundle behind an OpenAI-compatible API (chat and text completions, streaming, /v1/models), with
    /health, /ready and Prometheus /metrics, and vLLM's /tokenize, /detokenize and /version. Requests are batched on
    one engine (continuous batching); SIGTERM or Ctrl-C drains them and exits 0.

    \b
    Example:
      specexport serve smollm2-plain --port 8000
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-plain", "messages": [{"role": "user", "content": "Hi!"}]}'
    """
    load_bundle(bundle)  # one line for a path that is not a bundle, before anything starts
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key must not be empty")
    origins = _origins(allowed_origins)
    template = chat_template_file(bundle, chat_template) if chat_template is not None else None
    if not _loopback(host) and api_key is None:
        click.echo(f"warning: listening on {host} without --api-key: anyone who reaches it can use it", err=True)

    def ready(url: str) -> None:
        click.echo(f"serving {bundle.name} as {served_model_name or bundle.name} on {url} (OpenAI API under /v1; "
                   f"Ctrl-C or SIGTERM drains and stops)", err=True)

    options = dict(max_batch=max_batch, max_queue=max_queue, api_key=api_key, model_name=served_model_name,
                   threads=threads, prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, max_context=max_context,
                   prefix_cache=prefix_cache,
                   max_body_bytes=max_body_bytes, device=device, strict=strict, allowed_origins=origins,
                   chat_template=template, tool_call_parser=tool_call_parser)
    ray_only = {"--replicas": replicas, "--autoscale": autoscale, "--address": address, "--num-cpus": num_cpus,
                "--detach": detach or None}
    if not on_ray:
        given = [name for name, value in ray_only.items() if value is not None]
        if given:
            raise UserError(f"{', '.join(given)} need --ray")
        run_server(bundle, host=host, port=port, drain_timeout=drain_timeout, on_ready=ready, **options)
        return
    if replicas is not None and autoscale is not None:
        raise UserError("give --replicas or --autoscale, not both")
    try:
        from specexport.serve import rayserve

        if importlib.util.find_spec("ray") is None:  # not imported here: rayserve sets Ray's environment first
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
    except ModuleNotFoundError as e:
        needs_extra("serve --ray", "ray", e)
    rayserve.run(bundle, host=host, port=port, address=address, on_ready=ready, replicas=replicas or 1,
                 autoscale=_range(autoscale) if autoscale else None, num_cpus=num_cpus, start_timeout=start_timeout,
                 detach=detach,
                 **options)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise UserError(f"--autoscale takes MIN:MAX replicas, 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def _origins(given: tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-origins: each scheme://host[:port] (no path), or '*'; comma-separated or repeated."""
    origins = tuple(o.strip() for text in given for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise UserError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], e.g. "
                            f"https://app.example.com, or *)")
    return origins


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
