"""triton: a Triton Inference Server model repository over a bundle; triton-serve: run one on PyTriton's bundled
tritonserver (the tritonserver extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specexport.serve.tritonserver.repository import write_repository


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), required=True, help="The model repository to write.")
@click.option("--name", default=None, help="The model's name in Triton (default: the bundle's folder name).")
@click.option("--copy", is_flag=True, help="Copy the bundle into the repository (default: name its absolute path, "
                                           "which every node running the model must see).")
@click.option("--instances", type=click.IntRange(1), default=None,
              help="Model instances (processes), each with its own batched engine; they share the cores (default: "
                   "one per group of the cores the bundle's profile was chosen for; one per GPU for TensorRT).")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True,
              help="The most requests one instance decodes together in one target call.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="ORT intra-op threads per instance (default: this machine's cores / --instances).")
@click.option("--max-context", type=click.IntRange(2), default=None,
              help="Prompt plus new tokens per request (default: the bundle's); the KV cache holds --max-batch x this.")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None, help="Prompt tokens fed per step.")
@click.option("--no-batching", is_flag=True, help="Run an instance's requests one at a time (always so for a bundle of "
                                                  "TensorRT engines, batch 1 in this version).")
@click.option("--overwrite", is_flag=True, help="Replace a repository this command wrote before.")
def triton(bundle, output, name, copy, instances, max_batch, threads, max_context, prefill_chunk, no_batching,
           overwrite):
    """Write a Triton Inference Server model repository serving BUNDLE: a decoupled Python-backend model with the
    batched engine inside (text or token ids in; text, ids, finish reason and tau out; streamed with stream=true).

    \b
    Example:
      specexport triton smollm2-plain --output repo
      specexport triton-serve repo            # or: tritonserver --model-repository repo
      curl -X POST 127.0.0.1:8000/v2/models/smollm2-plain/generate -d '{"text_input": "Hi!", "max_tokens": 32}'
    """
    model = write_repository(bundle, output, name=name, copy=copy, instances=instances, max_batch=max_batch,
                             threads=threads, max_context=max_context, prefill_chunk=prefill_chunk,
                             batching=not no_batching, overwrite=overwrite)
    click.echo(f"wrote {model} (model {model.name}); serve it with: specexport triton-serve {output}")


@click.command("triton-serve")
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address (IPv4, IPv6 or a name) every endpoint listens on.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--log-verbose", type=click.IntRange(0), default=0, show_default=True, help="Triton's log level.")
def triton_serve(repo, host, http_port, grpc_port, metrics_port, log_verbose):
    """Run a model repository on the tritonserver PyTriton bundles (HTTP/REST with generate and generate_stream,
    gRPC, Prometheus metrics), until SIGTERM or Ctrl-C.

    \b
    Example:
      specexport triton-serve repo --http-port 8000 --grpc-port 8001
    """
    from specexport.serve.tritonserver.launch import serve

    sys.exit(serve(repo, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                   log_verbose=log_verbose))
