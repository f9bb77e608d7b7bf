"""A submitted generation as its submitter holds it (runtime/scheduler.py makes them): its text streamed as steps
accept it, its result awaited, its cancellation asked. The scheduler's thread feeds it (`_text`, `_finish`); every
other method is for the submitter's threads."""

from __future__ import annotations

import queue
import threading
import time

from specexport.errors import UserError
from specexport.runtime.generate import Generation

_DONE = object()


class Request:
    """A submitted generation, as its submitter holds it: `stream()` its text, `result()`, `cancel()`. Thread-safe."""

    def __init__(self, rid: int, prompt_tokens: int, on_end=None, on_tokens=None, cancel=None, on_logprobs=None):
        self.id, self.prompt_tokens = rid, prompt_tokens
        self._on_end, self._on_tokens, self._on_logprobs = on_end, on_tokens, on_logprobs
        self._asked = getattr(cancel, "is_set", cancel)  # the submitter's own cancellation, read at each step
        self.submitted = time.perf_counter()
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter time, tokens) of each step that emitted
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._result: Generation | None = None
        self._error: str | None = None

    def cancel(self) -> None:
        """Stop at the next step; the result keeps what was generated (stop_reason "cancelled")."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set() or (self._asked is not None and bool(self._asked()))

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def stream(self, timeout: float | None = None):
        """The text as it is accepted, piece by piece, until the request ends (raises UserError if it failed).
        `timeout`: the most seconds to wait for each piece."""
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no text for {timeout} s") from None
            if item is _DONE:
                break
            yield item
        if self._error is not None:
            raise UserError(self._error)

    def result(self, timeout: float | None = None) -> Generation:
        """Wait for the end of the request; its Generation (raises UserError with its message if it failed)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if self._error is not None:
            raise UserError(self._error)
        return self._result

    # -- the scheduler's side ------------------------------------------------------------------
    def _text(self, piece: str) -> None:
        self._events.put(piece)

    def _finish(self, result: Generation | None, error: str | None = None) -> None:
        self._result, self._error = result, error
        self._finished.set()
        self._events.put(_DONE)
        if self._on_end is not None:
            self._on_end(self)

    @property
    def generation(self) -> Generation | None:
        """The result once the request has ended (None while it runs, or when it failed)."""
        return self._result

    @property
    def error(self) -> str | None:
        """Why the request failed (None while it runs, or when it did not)."""
        return self._error
