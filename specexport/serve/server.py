"""Run the app on uvicorn: load the bundle, start the scheduler, serve until SIGTERM or SIGINT, then drain.

Draining: the first signal stops admitting (new requests and /ready get a 503), lets the running and queued requests
finish for at most `drain_timeout` seconds, cancels what is left (those clients get a 503 or an error event), closes
the listening socket and exits 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn

from specexport.errors import UserError, first_line
from specexport.runtime.generate import Engine
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.scheduler import Scheduler
from specexport.runtime.tokenizer import Tokenizer
from specexport.serve.app import ServeConfig, ServerState, build_app
from specexport.serve.listen import bound_socket

log = logging.getLogger("specexport.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown (uvicorn's own stops listening first, and re-raises the
    signal after it, so the process would not exit 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float, on_ready=None):
        super().__init__(config)
        self.state, self.drain_timeout, self.on_ready = state, drain_timeout, on_ready
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self.state.draining = True
        log.info('{"event": "draining", "signal": "%s", "requests": %d}', signal.Signals(sig).name,
                 self.state.scheduler.active)
        if self.loop is None:  # not started yet
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight:
            log.info('{"event": "drain timed out", "cancelled": %d}', len(self.state.inflight))
            self.state.stop_all()
            while self.state.inflight and time.monotonic() < deadline + 10:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the handlers send their last bytes
        self.should_exit = True


def warm_up(scheduler: Scheduler) -> None:
    """Two short requests at once before the port opens: the first calls of a graph (alone and batched) allocate,
    and no client should wait for that."""
    requests = [scheduler.submit("Hello", max_new_tokens=4, chat=False, stop_ids=())
                for _ in range(min(2, scheduler.max_batch))]
    for request in requests:
        request.result(timeout=600)


def chat_template_file(bundle, path) -> str:
    """The text of a chat template file for `bundle` (serve --chat-template), checked before anything loads: one
    line (UserError) for a file that cannot be read, is empty, does not parse, or fails on a one-message chat."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--chat-template {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path}: cannot read it: {first_line(e)}") from None
    if not text.strip():
        raise UserError(f"--chat-template {path}: the file is empty")
    tokenizer = Tokenizer.from_dir(Path(bundle))
    try:
        tokenizer.set_chat_template(text)
        PrefixStore.of(tokenizer)  # renders one-message chats (a template that raises on them says so: no cuts)
    except UserError as e:
        raise UserError(f"--chat-template {path}: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - the template's own fault on a plain chat (a TypeError, ...)
        raise UserError(f"--chat-template {path}: fails on a one-message chat: {type(e).__name__}: "
                        f"{first_line(e)}") from None
    return text


def open_app(bundle, max_batch: int = 8, max_queue: int = 64, api_key: str | None = None,
             model_name: str | None = None, threads: int | None = None, prefill_chunk: int | None = None,
             prefill_tokens: int | None = None, max_body_bytes: int = 4 << 20, max_context: int | None = None, served_by: str | None = None,
             device: str = "cpu", prefix_cache: int | None = None, strict: bool = False,
             allowed_origins: tuple[str, ...] = (), chat_template: str | None = None,
             tool_call_parser: str | None = None):
    """The app over `bundle`, ready: the engine loaded, its scheduler started and warmed up. `max_context`: prompt
    plus new tokens per request (the bundle's by default; the KV pool holds max_batch x max_context rows);
    `served_by`: what X-Served-By names (default host/pid); `device`: the engine's (runtime/backends: cpu, or the
    device path's cuda / cpu-iobinding, where the KV pool lives on the device); `prefix_cache`: MiB of prompts'
    beginnings kept (runtime/prefix.py; default its BUDGET); `strict`: unknown request fields get a 400 (else they
    are ignored and named); `allowed_origins`: the browser origins CORS lets in ('*': any; none: no CORS);
    `chat_template`: a Jinja chat template's text, used instead of the bundle's; `tool_call_parser`: how the model
    writes tool calls (serve/tools.py; default: what its chat template's markers say)."""
    log.setLevel(logging.INFO)  # the access log, wherever the app runs (uvicorn here, a Ray replica)
    engine = Engine.load(bundle, threads=threads, device=device)
    for warning in engine.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if max_context is not None:
        engine.limit_context(max_context)
    if chat_template is not None:  # prompts are then cut where this template ends a message (runtime/prefix.py)
        engine.tokenizer.set_chat_template(chat_template)
        engine.prefixes = PrefixStore.of(engine.tokenizer, engine.prefixes.budget)
    if prefix_cache is not None:
        engine.prefixes.budget = prefix_cache << 20
    scheduler = Scheduler(engine, max_batch=max_batch, prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens)
    pool_gb = scheduler.pool.nbytes / 2**30
    print(f"KV cache: {max_batch} sequences x {engine.max_context} tokens ({pool_gb:.2f} GiB, held as it fills; "
          f"--max-batch and --max-context bound it)", file=sys.stderr)
    warm_up(scheduler)
    config = ServeConfig(model_name=model_name or engine.bundle.path.name, max_queue=max_queue, api_key=api_key,
                         max_body_bytes=max_body_bytes, strict=strict, allowed_origins=tuple(allowed_origins),
                         tool_call_parser=tool_call_parser, **({"served_by": served_by} if served_by else {}))
    return build_app(engine, scheduler, config)


def serve(bundle, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0, on_ready=None,
          **app_options) -> None:
    """Serve open_app(bundle, **app_options) until a signal; returns after the drain. `on_ready(url)`: called once
    the socket listens (port 0 takes a free port; the url names it). The address is bound before the bundle loads:
    one it cannot have is one line at once."""
    with bound_socket(host, port) as sock:
        app = open_app(bundle, **app_options)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5, lifespan="on"),
                                app.state.serve, drain_timeout, on_ready)
        try:
            server.run(sockets=[sock])
        finally:
            app.state.serve.scheduler.close()
