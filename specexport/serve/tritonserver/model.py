"""The Python-backend model Triton Inference Server runs for a bundle (a repository's `1/model.py` imports it).

Decoupled: `execute` submits each request to the model instance's scheduler (runtime/scheduler.py: continuous
batching, so concurrent requests share target calls; `Serial` for TensorRT engines, batch 1 in this version, or a
repository written with --no-batching) and returns at once; the scheduler's thread sends the responses.
With `stream` true a response goes out per step that emitted tokens (its text piece and ids), then a last one with
the finish reason and tau; otherwise one response holds everything. Each request's last response carries
TRITONSERVER_RESPONSE_COMPLETE_FINAL. A bad request gets a Triton error (INVALID_ARG) and harms no other; a request
whose client has gone (a cancelled gRPC stream) is cancelled at its next step.

The repository's config.pbtxt parameters say what to load: `bundle` (a path, relative to the model's version
folder when copied), `manifest_sha256` (the manifest the repository was written for: a bundle rebuilt at the same
path is refused), `batching`, and the engine's `max_batch`, `threads`, `max_context`, `prefill_chunk`. A bundle of
TensorRT engines loads on the GPU (written to the TensorRT backend's API; not run here, where there is no GPU).
"""

from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.bundle import load_bundle
from specexport.errors import UserError, first_line
from specexport.runtime.backends.protocol import pools
from specexport.runtime.generate import Engine, Generation
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.scheduler import Scheduler
from specexport.serve.tritonserver import DEFAULT_MAX_TOKENS, INPUTS


@dataclass(frozen=True)
class Job:
    prompt: str | list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    chat: bool
    stream: bool


def parse(values: dict) -> Job:
    """A request's inputs (name -> numpy array, absent ones missing) as a Job; UserError names what is wrong."""
    unknown = sorted(set(values) - {name for name, _, _ in INPUTS})
    if unknown:
        raise UserError(f"unknown input {unknown[0]!r}")
    text, ids = values.get("text_input"), values.get("input_ids")
    if (text is None) == (ids is None):
        raise UserError("give the prompt as text_input or as input_ids (one of them)")
    if text is not None:
        prompt = _string(_scalar(text, "text_input"), "text_input")
        if not prompt:
            raise UserError("text_input is empty")
    else:
        if ids.ndim != 1 or ids.size == 0:
            raise UserError(f"input_ids must be a non-empty list of token ids, got shape {list(ids.shape)}")
        prompt = [int(t) for t in ids]
    stop = tuple(_string(s, "stop") for s in values["stop"].reshape(-1)) if "stop" in values else ()
    sampling = SamplingParams(temperature=_number(values, "temperature", 0.0), top_k=int(_number(values, "top_k", 0)),
                              top_p=_number(values, "top_p", 1.0),
                              seed=int(_scalar(values["seed"], "seed")) if "seed" in values else None,
                              min_p=_number(values, "min_p", 0.0),
                              repetition_penalty=_number(values, "repetition_penalty", 1.0),
                              frequency_penalty=_number(values, "frequency_penalty", 0.0),
                              presence_penalty=_number(values, "presence_penalty", 0.0),
                              min_tokens=int(_number(values, "min_tokens", 0)), constraint=_guide(values))
    max_tokens = int(_number(values, "max_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens < 1:
        raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
    return Job(prompt, max_tokens, sampling, stop,
               chat=not _flag(values, "raw"), stream=_flag(values, "stream"))


GUIDES = {"json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}  # TensorRT-LLM's -> ours


def _guide(values: dict) -> Constraint | None:
    """Structured output from guided_decoding_guide_type and guided_decoding_guide (TensorRT-LLM's inputs)."""
    kind = _string(_scalar(values["guided_decoding_guide_type"], "guided_decoding_guide_type"),
                   "guided_decoding_guide_type") if "guided_decoding_guide_type" in values else None
    guide = _string(_scalar(values["guided_decoding_guide"], "guided_decoding_guide"),
                    "guided_decoding_guide") if "guided_decoding_guide" in values else None
    if kind is None:
        if guide is not None:
            raise UserError("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    if kind == "json":
        return Constraint.json_object()
    if kind not in GUIDES:
        raise UserError(f"guided_decoding_guide_type must be json, {', '.join(GUIDES)}; got {kind!r}")
    if not guide:
        raise UserError(f"guided_decoding_guide_type {kind} needs its guided_decoding_guide")
    return Constraint(GUIDES[kind], guide)


def _scalar(array: np.ndarray, name: str):
    if array.size != 1:
        raise UserError(f"{name} takes one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _number(values: dict, name: str, default: float) -> float:
    if name not in values:
        return default
    value = float(_scalar(values[name], name))
    if not np.isfinite(value):
        raise UserError(f"{name} must be a finite number")
    return value


def _flag(values: dict, name: str) -> bool:
    return bool(_scalar(values[name], name)) if name in values else False


def _string(value, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        raise UserError(f"{name} is not UTF-8 text") from None


def manifest_sha256(bundle: Path) -> str:
    return hashlib.sha256((Path(bundle) / "manifest.json").read_bytes()).hexdigest()


class TritonPythonModel:
    """Triton's entry points: initialize (load the bundle, start the scheduler), execute (submit), finalize."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # only inside Triton's Python backend

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise UserError("the specexport model must be decoupled (model_transaction_policy { decoupled: true })")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        bundle = version_dir / params["bundle"]  # an absolute path stays itself
        if not (bundle / "manifest.json").is_file():
            raise UserError(f"bundle {bundle} not found on this node (the repository names it: every node that runs "
                            "this model must see it at that path)")
        if params.get("manifest_sha256") and manifest_sha256(bundle) != params["manifest_sha256"]:
            raise UserError(f"bundle {bundle} is not the one this repository was written for (its manifest changed): "
                            "write the repository again")

        def setting(name):
            return int(params[name]) if params.get(name) else None

        loaded = load_bundle(bundle)  # every file's sha256 against the manifest
        device = "cpu" if loaded.manifest["flavour"] == "ort" else "auto"  # TensorRT engines: the GPU
        self.engine = Engine(loaded, threads=setting("threads"), device=device)
        for warning in self.engine.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if setting("max_context"):
            self.engine.limit_context(setting("max_context"))
        if params.get("batching", "true") == "true" and pools(self.engine.target):
            self.scheduler = Scheduler(self.engine, max_batch=setting("max_batch") or 8,
                                       prefill_chunk=setting("prefill_chunk"))
        else:  # TensorRT engines (batch 1), or a repository written with --no-batching
            self.scheduler = Serial(self.engine)
        for request in [self.scheduler.submit("Hello", max_new_tokens=4, chat=False, stop_ids=()) for _ in range(2)]:
            request.result(timeout=600)  # the first calls (alone, batched) allocate before any client waits
        self.metrics = _Metrics(pb_utils, self.scheduler, {"model": args["model_name"],
                                                           "instance": args["model_instance_name"]})

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                values = {t.name(): t.as_numpy() for t in request.inputs()}
                job = parse(values)
                _Reply(self, sender, job)
            except UserError as e:
                self._fail(sender, str(e))
            except Exception as e:  # noqa: BLE001 - a fault here must end this request only
                self._fail(sender, f"internal error: {first_line(e)}", self.pb.TritonError.INTERNAL)
        return None

    def finalize(self) -> None:
        self.scheduler.close()
        self.metrics.close()

    def _fail(self, sender, message: str, code=None) -> None:
        error = self.pb.TritonError(message, self.pb.TritonError.INVALID_ARG if code is None else code)
        sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class Serial:
    """Requests one at a time on `Engine.generate`, on a thread of its own, behind the scheduler's `submit` (as far as
    the model uses it): for bundles the batched scheduler does not run (TensorRT engines, batch 1 in this version)
    and repositories written with --no-batching. Later requests wait their turn."""

    def __init__(self, engine: Engine):
        self.engine, self.on_step = engine, None
        self.running: list[SerialRequest] = []
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="specexport-serial", daemon=True)
        self.thread.start()

    @property
    def active(self) -> int:
        return self.queue.qsize() + len(self.running)

    def submit(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] | None = None, chat: bool = True,
               on_text=None, on_end=None, on_tokens=None) -> "SerialRequest":
        self.engine.request(prompt, max_new_tokens, stop, chat)  # a bad request raises here, never queued
        request = SerialRequest(on_end)
        self.queue.put((request, dict(prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                      stop_ids=stop_ids, chat=chat, on_text=on_text, on_tokens=on_tokens)))
        return request

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        while not self.queue.empty():
            item = self.queue.get()
            if item is not None:
                item[0].finish(None, "the model is unloading")

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            request, job = item
            self.running.append(request)
            try:
                on_step = (lambda record: self.on_step(1, len(record.tree))) if self.on_step else None
                request.finish(self.engine.generate(**job, cancel=request.cancelled, on_step=on_step))
            except Exception as e:  # noqa: BLE001 - a failure ends its request only
                request.finish(None, first_line(e))
            finally:
                self.running.clear()


class SerialRequest:
    """A request of `Serial`: cancel(), result(), and what `on_end` reads (generation, error)."""

    def __init__(self, on_end=None):
        self.on_end, self.cancelled, self.ended = on_end, threading.Event(), threading.Event()
        self.generation: Generation | None = None
        self.error: str | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def finish(self, generation: Generation | None, error: str | None = None) -> None:
        self.generation, self.error = generation, error
        self.ended.set()
        if self.on_end is not None:
            self.on_end(self)

    def result(self, timeout: float | None = None) -> Generation:
        if not self.ended.wait(timeout) or self.error is not None:
            raise UserError(self.error or f"no result after {timeout} s")
        return self.generation


class _Metrics:
    """The engine's own figures on Triton's /metrics (next to Triton's nv_inference_*): requests running and waiting
    (a queue metric to scale on), target calls, the sequences and rows they computed (sequences / calls: how many
    requests shared a call), and the tokens generated."""

    def __init__(self, pb_utils, scheduler: Scheduler | Serial, labels: dict):
        self.families = []  # kept while their metrics live (Triton refuses a metric whose family is gone)

        def metric(name, kind, description):
            self.families.append(pb_utils.MetricFamily(name=f"specexport_{name}", description=description, kind=kind))
            return self.families[-1].Metric(labels)

        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self.scheduler = scheduler
        self.running = metric("requests_running", gauge, "Requests decoding in the batch")
        self.waiting = metric("requests_waiting", gauge, "Requests waiting for a slot or prefilling")
        self.calls = metric("target_calls_total", counter, "Target calls (batched steps)")
        self.sequences = metric("sequences_total", counter, "Sequences summed over the target calls")
        self.rows = metric("rows_total", counter, "Rows summed over the target calls (padding included)")
        self.tokens = metric("generation_tokens_total", counter, "Tokens generated")
        scheduler.on_step = self.step

    def step(self, sequences: int, width: int) -> None:
        self._update(sequences, width, 0)

    def ended(self, tokens: int) -> None:
        self._update(0, 0, tokens)

    def _update(self, sequences: int, width: int, tokens: int) -> None:
        if not self.families:
            return
        try:
            if sequences:
                self.calls.increment(1)
                self.sequences.increment(sequences)
                self.rows.increment(sequences * width)
            if tokens:
                self.tokens.increment(tokens)
            self.running.set(len(self.scheduler.running))
            self.waiting.set(self.scheduler.active - len(self.scheduler.running))
        except Exception as e:  # noqa: BLE001 - metrics never stop the scheduler's thread
            print(f"specexport: metrics not updated ({first_line(e)})", file=sys.stderr)

    def close(self) -> None:
        """Drop the metrics, then their families (Triton's order)."""
        self.scheduler.on_step = None
        del self.running, self.waiting, self.calls, self.sequences, self.rows, self.tokens
        self.families.clear()


class _Reply:
    """One request's responses, sent from the scheduler's thread as its steps emit."""

    def __init__(self, model: TritonPythonModel, sender, job: Job):
        self.pb, self.sender, self.stream, self.metrics = model.pb, sender, job.stream, model.metrics
        self.pieces: list[str] = []  # text emitted since the last response (all hooks run on the scheduler's thread)
        self.handle = None
        self.handle = model.scheduler.submit(job.prompt, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                             stop=job.stop, chat=job.chat, on_text=self.pieces.append,
                                             on_tokens=self._tokens, on_end=self._end)

    def _tokens(self, ids: list[int]) -> None:
        if not self.stream:
            gone = self.sender.is_cancelled()
        else:
            text, self.pieces[:] = "".join(self.pieces), []
            gone = not self._send(self._response(text, ids, "", None))
        if gone:
            self._cancel()

    def _end(self, request) -> None:
        result: Generation | None = request.generation
        self.metrics.ended(len(result.tokens) if result is not None else 0)
        if result is None:
            error = self.pb.TritonError(request.error or "the request failed", self.pb.TritonError.INTERNAL)
            self._send(self.pb.InferenceResponse(error=error), final=True)
            return
        text = "".join(self.pieces) if self.stream else result.text
        ids = [] if self.stream else result.tokens
        self._send(self._response(text, ids, result.stop_reason, result.stats.tau), final=True)

    def _response(self, text: str, ids: list[int], reason: str, tau: float | None):
        tensors = [self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                   self.pb.Tensor("output_ids", np.asarray(ids, dtype=np.int32)),
                   self.pb.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
                   self.pb.Tensor("tau", np.array([tau or 0.0], dtype=np.float32))]
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _send(self, response, final: bool = False) -> bool:
        """Send; False when the client is gone (the request is then cancelled)."""
        final_flag = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            if self.sender.is_cancelled():
                if final:
                    self.sender.send(flags=final_flag)  # Triton lets the request go at its final flag only
                return False
            self.sender.send(response, flags=final_flag if final else 0)
            return True
        except Exception as e:  # noqa: BLE001 - never raise on the scheduler's thread
            print(f"specexport: a response could not be sent ({first_line(e)})", file=sys.stderr)
            return False

    def _cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
