"""The Python side of libspecexport: what the C library (src/python.c) calls, with plain arguments, to drive the
runtime. One implementation of the loop: this module only translates (C options -> Engine settings, Python errors
-> the C ABI's status codes, the engine's streams -> the C callback).

Every entry point raises `EmbedError` (a status of include/specexport.h and one line) for whatever goes wrong; the
C side turns it into the status and the thread's last error, and never prints a traceback.
"""

from __future__ import annotations

import ctypes
import gc
import json
import queue

from specexport.errors import UserError, first_line
from specexport.options import fields
from specexport.runtime.backends import host as backend
from specexport.runtime.backends.protocol import pools
from specexport.runtime.generate import Engine
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.scheduler import Scheduler

# specexport_status in include/specexport.h (tests/test_embed.py checks that the values agree)
OK, INVALID_ARGUMENT, BUNDLE, CLOSED, CALLBACK, NOT_FOUND, PYTHON, RUNTIME = range(8)
# specexport_stop_reason
STOP_REASONS = {"eos": 1, "stop_string": 2, "length": 3, "context": 4, "cancelled": 5}
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_BATCH = 8  # specexport_open_options.max_batch 0
_END = object()


class EmbedError(Exception):
    """A failure with its C status (`specexport_status`, read by python.c) and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.specexport_status = status


def _fail(status: int, error: Exception, other: int = RUNTIME) -> EmbedError:
    """A UserError is `status` with its line; anything else is `other`, named by its type."""
    if isinstance(error, UserError):
        return EmbedError(status, first_line(error))
    return EmbedError(other, f"{type(error).__name__}: {first_line(error)}")


class Embedded:
    """An open engine as the C side holds it: the Engine and, where its backend batches (ONNX Runtime's, on the host
    or the device path), the Scheduler its generations share; else (TensorRT, max_batch -1) each generation runs
    alone."""

    def __init__(self, engine: Engine, max_batch: int):
        self.engine = engine
        batches = max_batch != -1 and pools(engine.target)
        self.scheduler = Scheduler(engine, max_batch=max_batch or DEFAULT_MAX_BATCH) if batches else None

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()


def open_engine(path: str, threads: int = 0, device: str | None = None, settings: str | None = None,
                verify: bool = True, max_batch: int = 0) -> Embedded:
    """Load a bundle (every graph now, so that concurrent generations never race to load one) with the method's
    run-time settings from `settings`, a JSON object of the method's field names; `max_batch`: see Embedded."""
    if threads < 0:
        raise EmbedError(INVALID_ARGUMENT, f"threads must be >= 0 (0: every core), got {threads}")
    if max_batch < -1:
        raise EmbedError(INVALID_ARGUMENT, f"max_batch must be -1 (no batching), 0 (the default, "
                                           f"{DEFAULT_MAX_BATCH}) or more, got {max_batch}")
    device = device or "auto"
    if device not in DEVICES:
        raise EmbedError(INVALID_ARGUMENT, f"device must be one of {', '.join(DEVICES)}, got {device!r:.40}")
    given = _settings(settings)
    try:
        backend.providers(device)
    except UserError as e:
        raise _fail(INVALID_ARGUMENT, e) from None
    try:
        engine = Engine.load(path, threads=threads or None, device=device, verify=verify)
        for name in engine.bundle.graphs:
            if name != "target":
                engine.graph(name)
    except Exception as e:  # noqa: BLE001 - a bundle that cannot load, whatever the reason, is one line
        raise _fail(BUNDLE, e, other=BUNDLE) from None
    known = [f.name for f in fields(engine.method.Settings)]
    for name in given:
        if name not in known:
            raise EmbedError(INVALID_ARGUMENT, f"setting '{name:.40}' does not apply to this {engine.bundle.method} "
                                               f"bundle (its settings: {', '.join(known) or 'none'})")
    try:
        engine.configure(**given)
        return Embedded(engine, max_batch)
    except Exception as e:  # noqa: BLE001
        raise _fail(INVALID_ARGUMENT, e) from None


def close_engine(engine: Embedded) -> None:
    """Before the C side drops its engine: stop its batching thread (its generations are over by then)."""
    engine.close()


def _settings(text: str | None) -> dict:
    if not text:
        return {}
    try:
        given = json.loads(text)
    except ValueError as e:
        raise EmbedError(INVALID_ARGUMENT, f"settings is not JSON: {e}") from None
    if not isinstance(given, dict):
        raise EmbedError(INVALID_ARGUMENT, f"settings must be a JSON object of setting names, got {text:.40}")
    return given


def collect() -> None:
    """After an engine is dropped: free its sessions (and their threads) now rather than at some later collection,
    and hand the freed heap back to the system where the C library is glibc's (`malloc_trim`: else the KV caches' and
    ONNX Runtime's freed blocks stay in the process; a service opening and closing the tiny EAGLE-3 bundle grew
    ~0.5 MB a cycle without it, ~20 KB with it)."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _malloc_trim()


def generate(engine: Embedded, prompt: str | None, prompt_ids: list[int] | None, raw: bool, max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, seed: int, stop: list[str], stop_ids: list[int],
             stream, cancelled, min_p: float = 0.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
             presence_penalty: float = 0.0, min_tokens: int = 0, constraint_kind: str | None = None,
             constraint: str | None = None) -> tuple:
    """One generation. `stream(ids, text) -> bool` (or None) receives the tokens and the text as they become final
    (True: stop), on this (the calling) thread; `cancelled() -> bool` is polled before each step (batched: while
    the thread waits for the next step's tokens). Returns the stats as a tuple (python.c reads it): prompt, new
    tokens, steps, drafted, accepted, ttft, seconds, tokens/s, tau, stop reason."""
    embedded, engine = engine, engine.engine
    if (prompt is None) == (prompt_ids is None):
        raise EmbedError(INVALID_ARGUMENT, "give exactly one of prompt and prompt_ids")
    vocab = engine.bundle.manifest["model"]["vocab"]
    if any(not 0 <= t < vocab for t in stop_ids):
        raise EmbedError(INVALID_ARGUMENT, f"stop_ids must be token ids in 0..{vocab - 1}")
    if seed < -1:
        raise EmbedError(INVALID_ARGUMENT, f"seed must be -1 (a fresh random stream) or in [0, 2^63), got {seed}")
    out = Stream(stream, cancelled)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=None if seed == -1 else seed,
                                  min_p=min_p, repetition_penalty=repetition_penalty,
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  min_tokens=min_tokens,
                                  constraint=Constraint(constraint_kind, constraint) if constraint_kind else None)
        request = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop),
                       stop_ids=tuple(sorted(engine.tokenizer.eos_token_ids | set(stop_ids))), chat=not raw)
        prompt = prompt if prompt is not None else prompt_ids
        if embedded.scheduler is not None:
            result = _scheduled(embedded.scheduler, prompt, request, out)
        else:
            result = engine.generate(prompt, on_text=out.on_text if stream else None,
                                     on_step=out.on_step if stream else None, cancel=out.check, **request)
    except Exception as e:  # noqa: BLE001 - every failure is a status and one line
        raise _fail(INVALID_ARGUMENT, e) from None
    out.finish(result.tokens)
    s = result.stats
    return (s.prompt_tokens, s.new_tokens, s.steps, s.drafted, s.accepted, s.ttft_s, s.seconds, s.tokens_per_s,
            s.tau, STOP_REASONS[result.stop_reason])


def _scheduled(scheduler: Scheduler, prompt, request: dict, out: "Stream"):
    """A generation on the engine's scheduler, batched with the others: its text and token ids come through a
    queue to this thread, which hands them to the callback. The scheduler itself reads the cancellation (and a
    callback's stop) before each step, so the step after a cancel never runs for it."""
    events: queue.Queue = queue.Queue()
    handle = scheduler.submit(prompt, on_text=lambda piece: events.put(piece), on_tokens=lambda ids: events.put(ids),
                              on_end=lambda _: events.put(_END), cancel=lambda: out.stopped or out.cancelled(),
                              **request)
    while (item := events.get()) is not _END:
        if isinstance(item, str):
            out.on_text(item)
        else:
            out.step_tokens([int(t) for t in item])
    return handle.result()


class Stream:
    """The engine's streams, reshaped for the C callback: token ids once they are final, each chunk with the text
    that became final meanwhile. A step's tokens are final when the engine polls for cancellation before the next
    step (it has emitted them all by then: an end of sequence, a stop string or the budget cut a step short only at
    the end), or when the generation returns; the prefill's token is the root of the first step. The text is what
    the engine hands to `on_text` (stop strings cut, a possible stop string's start held back)."""

    def __init__(self, sink, cancelled):
        self.sink, self.cancelled = sink, cancelled
        self.sent = 0  # token ids streamed so far
        self.stepped = False  # a step has run (and its root, the prefill's token, is sent)
        self.pending: list[int] = []  # the last step's tokens, not yet known to be emitted
        self.text = ""  # final text not yet streamed
        self.stopped = False  # the callback asked to stop (or failed): nothing more goes to it

    def on_text(self, chunk: str) -> None:
        self.text += chunk

    def on_step(self, record) -> None:
        if not self.stepped:
            self.stepped = True
            self._send([int(record.tree.tokens[0])])
        self.pending = [int(t) for t in record.acceptance.tokens]

    def step_tokens(self, ids: list[int]) -> None:
        """A batched step's emitted tokens (final: the scheduler cut them at a stop), with the text so far."""
        self._send(ids)

    def check(self) -> bool:
        self._send(self.pending)
        self.pending = []
        return self.stopped or bool(self.cancelled())

    def finish(self, tokens: list[int]) -> None:
        self._send(tokens[self.sent:])

    def _send(self, ids: list[int]) -> None:
        """These ids and the text so far, if any, to the callback."""
        if self.sink is None or self.stopped or not (ids or self.text):
            return
        text, self.text = self.text, ""
        self.sent += len(ids)
        self.stopped = bool(self.sink(ids or None, text or None))
