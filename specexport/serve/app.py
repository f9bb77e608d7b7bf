"""The FastAPI application: the OpenAI routes over one Scheduler, vLLM's /tokenize, /detokenize and /version, health
and readiness, metrics, access logs, and CORS for the browser origins the server is given (none by default).

Every request gets an id: the client's own `X-Request-Id` when it sends one, else a new one (the `X-Request-Id`
header of its response, its access-log line, and its completion's id). Generation requests are checked
(serve/protocol.py; fields it does not know are named in the response's X-Specexport-Ignored-Fields header and the
access log, or refused with `strict`), encoded and submitted to the scheduler; the scheduler's thread hands their
text to the event loop through an asyncio queue. A client that disconnects cancels its requests (the scheduler drops
them at its next step). No traceback reaches a client: a fault is a 500 with OpenAI's error object, logged with its
id; a stream that fails after its first event ends with an error event, then [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specexport import __version__
from specexport.errors import UserError, first_line
from specexport.runtime.generate import Engine
from specexport.runtime.request import Request as Submitted
from specexport.runtime.scheduler import Scheduler
from specexport.serve import fields, logprobs, protocol, tools
from specexport.serve.metrics import CONTENT_TYPE, Metrics
from specexport.serve.protocol import FINISH, ApiError, Job

log = logging.getLogger("specexport.serve")
CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # an X-Request-Id kept: visible ASCII, at most 128 characters
EXPOSED_HEADERS = ["X-Request-Id", "X-Served-By", fields.IGNORED_HEADER, "Retry-After"]  # what a page's script reads
NAMES_WARNED = 1000  # unknown field names warned about once each, at most (then only the access log names them)


@dataclass
class ServeConfig:
    model_name: str
    max_queue: int = 64  # requests waiting beyond the batch before new ones get a 429
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1
    served_by: str = field(default_factory=lambda: f"{socket.gethostname()}/{os.getpid()}")  # X-Served-By
    strict: bool = False  # request fields this server does not know get a 400 (else: ignored, and named)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins let in ('*': any); none: no CORS headers at all
    tool_call_parser: str | None = None  # serve/tools.py's parser (None: the one the chat template's markers name)


@dataclass
class ServerState:
    """What the routes share: the engine and its scheduler, metrics, and the server's phase."""

    engine: Engine
    scheduler: Scheduler
    config: ServeConfig
    metrics: Metrics
    draining: bool = False  # SIGTERM/SIGINT seen: new requests get a 503
    stopped: bool = False  # the drain timed out: what still ran was cancelled
    inflight: set = field(default_factory=set)  # submitted requests not yet ended
    warned: set = field(default_factory=set)  # unknown request fields the log has warned about

    @property
    def tool_parser(self) -> tools.Parser | None:
        """How this model writes tool calls (serve/tools.py): --tool-call-parser's, else its chat template's."""
        return tools.parser_for(self.engine.tokenizer.template_source, self.config.tool_call_parser)

    def stop_all(self) -> None:
        """Cancel every request still running or queued (the end of a drain that timed out)."""
        self.stopped = True
        for request in list(self.inflight):
            request.cancel()


def build_app(engine: Engine, scheduler: Scheduler, config: ServeConfig) -> FastAPI:
    state = ServerState(engine, scheduler, config, Metrics(scheduler, config.model_name))
    scheduler.on_step = state.metrics.step

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()  # the server (uvicorn, a Ray replica) is shutting down

    app = FastAPI(title="specexport", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    if config.allowed_origins:  # inside the access log: a preflight gets its id and its line too
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=EXPOSED_HEADERS, max_age=600)
    app.add_middleware(AccessLog, served_by=config.served_by)
    app.state.serve = state
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if e.status in (429, 503):
            state.metrics.reject(e.status)
        _note(request, error=e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 404:
            message, code = f"unknown path: {request.method} {request.url.path}", "unknown_url"
        elif e.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        _note(request, error=message)
        return JSONResponse(protocol.error_body(e.status_code, message, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def fault(request: Request, e: Exception):
        rid = request.scope.get("state", {}).get("request_id", "-")
        log.exception("request %s failed", rid)
        _note(request, error=f"internal error: {first_line(e)}")
        return JSONResponse(protocol.error_body(500, f"internal server error (request {rid})"), status_code=500)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise ApiError(503, "the engine's scheduler has stopped")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.draining:
            raise ApiError(503, "the server is shutting down")
        return {"status": "ready", "model": config.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": created, "owned_by": "specexport"}

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, config)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        _authorize(request, config)
        if model != config.model_name:
            raise _unknown_model(model)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, state, protocol.chat_request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, state, protocol.completion_request)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        def work(raw, content_type):
            asked = protocol.tokenize_request(protocol.parse_body(raw, content_type), config.strict)
            _check_model(state, asked.model)
            return protocol.tokenize(state.engine, asked), asked.ignored

        return await _tokenization(request, state, work)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        def work(raw, content_type):
            model, tokens, ignored = protocol.detokenize_request(protocol.parse_body(raw, content_type), config.strict)
            _check_model(state, model)
            return protocol.detokenize(state.engine, tokens), ignored

        return await _tokenization(request, state, work)

    return app


class AccessLog:
    """Pure ASGI middleware: a request id for every HTTP request, the client's own `X-Request-Id` when it sends one
    (1 to 128 visible ASCII characters; another is a 400), else a new one (`X-Request-Id` on the response, with
    `X-Served-By`: the host and process that answered, one of several replicas behind Ray) and one JSON line in the
    log when it ends (status, time, and what the route noted: tokens, finish reasons, error)."""

    def __init__(self, app, served_by: str):
        self.app, self.served_by = app, served_by.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        kept = given is not None and CLIENT_REQUEST_ID.fullmatch(given) is not None
        rid = given if kept else "req-" + secrets.token_hex(8)
        scope.setdefault("state", {})
        scope["state"]["request_id"], scope["state"]["log"], scope["state"]["own_id"] = rid, {}, kept
        status, start = [0], time.perf_counter()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", rid.encode()),
                                                                          (b"x-served-by", self.served_by)]
            await send(message)

        try:
            if given is not None and not kept:
                message = "X-Request-Id must be 1 to 128 visible ASCII characters (no spaces)"
                scope["state"]["log"]["error"] = message
                await JSONResponse(protocol.error_body(400, message, "X-Request-Id"), status_code=400)(
                    scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            line = {"request_id": rid, "method": scope["method"], "path": scope["path"], "status": status[0],
                    "ms": round(1e3 * (time.perf_counter() - start), 1), **scope["state"]["log"]}
            log.info(json.dumps(line, ensure_ascii=False))


def _note(request: Request, **fields) -> None:
    """Add fields to the request's access-log line."""
    request.scope.setdefault("state", {}).setdefault("log", {}).update(fields)


def _authorize(request: Request, config: ServeConfig) -> None:
    if config.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")


def _unknown_model(model: str) -> ApiError:
    return ApiError(404, f"the model {model} does not exist on this server", "model", "model_not_found")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request.stream())
        raise ApiError(413, f"the body has {int(declared)} bytes; this server takes at most {limit}",
                       code="request_too_large")
    chunks, size, pieces = [], 0, request.stream()
    async for piece in pieces:
        size += len(piece)
        if size > limit:
            await _drain(pieces)
            raise ApiError(413, f"the body is larger than this server's limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(piece)
    return b"".join(chunks)


DRAIN_BYTES, DRAIN_SECONDS = 64 << 20, 10.0


async def _drain(pieces) -> None:
    """Read and drop the rest of a refused body, up to DRAIN_BYTES and DRAIN_SECONDS: a client that writes its whole
    body before reading (Python's urllib, `requests`) then reads the 413; answered with the body unread, the
    connection closes under it and it sees a reset instead."""
    async def read() -> None:
        drained = 0
        async for piece in pieces:
            drained += len(piece)
            if drained > DRAIN_BYTES:
                return

    with contextlib.suppress(asyncio.TimeoutError, ClientDisconnect):
        await asyncio.wait_for(read(), DRAIN_SECONDS)


async def _generate(request: Request, state: ServerState, parse) -> Response:
    """A chat or text completion: checked, queued (429 when the queue is full), then answered whole or streamed."""
    config, scheduler = state.config, state.scheduler
    _authorize(request, config)
    if state.draining:
        raise ApiError(503, "the server is shutting down")
    raw = await _read_body(request, config.max_body_bytes)
    job, prompts = await asyncio.to_thread(_prepare, state, parse, raw, request.headers.get("content-type"))
    if scheduler.active + len(prompts) * job.n > scheduler.max_batch + config.max_queue:
        raise ApiError(429, f"the server is at capacity ({scheduler.max_batch} running, {config.max_queue} queued); "
                            f"retry later", code="rate_limit_exceeded",
                       headers={"Retry-After": str(config.retry_after_s)})
    rid = request.scope["state"]["request_id"]
    rid = ("chatcmpl-" if job.chat else "cmpl-") + (rid if request.scope["state"]["own_id"] else rid[4:])
    queue: asyncio.Queue = asyncio.Queue()
    submitted = _submit(state, job, prompts, queue, asyncio.get_running_loop())
    _note(request, prompt_tokens=sum(len(p) for p in prompts), stream=job.stream)
    headers = _ignored(request, state, job.ignored)
    echoed = protocol.echo_prompts(state.engine, job, prompts)
    if job.stream:
        return _EventStream(_stream(request, state, job, rid, submitted, queue, echoed), submitted, headers)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, submitted))
    try:
        ended = 0
        while ended < len(submitted):
            _, piece = await queue.get()
            ended += piece is None
    finally:
        watcher.cancel()
        for r in submitted:
            r.cancel()  # a no-op for ended requests; stops the rest when this handler is cancelled
    results = _results(request, state, submitted)
    texts = logprobs.Texts(state.engine.tokenizer) if job.logprobs is not None else None
    answer = await asyncio.to_thread(protocol.completion, job, rid, int(time.time()), state.config.model_name, results,
                                     texts, echoed, state.tool_parser)
    return JSONResponse(answer, headers=headers)


def _prepare(state: ServerState, parse, raw: bytes, content_type: str | None) -> tuple[Job, list[list[int]]]:
    """The request checked and its prompts encoded (in a worker thread: a long prompt never stalls the streams)."""
    job: Job = parse(protocol.parse_body(raw, content_type), state.config.strict)
    _check_model(state, job.model)
    protocol.stop_ids(state.engine, job)  # its ids checked against the vocabulary before the request queues
    if job.tools:
        _tool_calls(state, job)
    if job.sampling.constraint is not None:  # compiled here, off the event loop: the submit only copies it
        try:
            state.engine.grammars.matcher(job.sampling.constraint)
        except UserError as e:
            raise protocol.bad(first_line(e), job.constraint_param) from None
    return job, [protocol.prompt_ids(state.engine, job, p) for p in job.prompts]


def _tool_calls(state: ServerState, job: Job) -> None:
    """A chat with tools: its template must render them, and where it calls tools, this server must read its calls;
    tool_choice "required" or a named function makes the call the only thing the model can write (a grammar)."""
    if not tools.renders_tools(state.engine.tokenizer.template_source):
        raise protocol.bad("this model's chat template does not render tools; start the server with --chat-template "
                           "FILE whose template does (one that reads `tools`)", "tools")
    parser = state.tool_parser
    if not job.calls_tools:
        return
    if parser is None:
        raise protocol.bad("this model's chat template writes tool calls in no format this server reads; start the "
                           f"server with --tool-call-parser ({', '.join(tools.PARSERS)})", "tools")
    if job.tool_choice == "auto":
        return
    if job.sampling.constraint is not None:
        raise protocol.bad(f"tool_choice {job.tool_choice} and {job.constraint_param} both constrain the answer; send "
                           "one", "tool_choice")
    named = None if job.tool_choice == "required" else job.tool_choice  # (a named function: one call of it)
    job.sampling = dataclasses.replace(job.sampling, constraint=parser.constraint(
        job.tools, named, job.parallel_tool_calls and named is None))
    job.constraint_param = "tool_choice"


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.config.model_name:
        raise _unknown_model(model)


def _ignored(request: Request, state: ServerState, names: tuple[str, ...]) -> dict:
    """The response's headers for the request fields this server did not know and ignored: named in
    X-Specexport-Ignored-Fields and the access-log line, and the first time a name is seen, in a warning."""
    if not names:
        return {}
    shown = fields.named(list(names))
    _note(request, ignored_fields=shown)
    new = [name for name in names if name not in state.warned]
    if new and len(state.warned) < NAMES_WARNED:
        state.warned.update(new)
        log.warning(json.dumps({"event": "request fields ignored", "fields": fields.named(new),
                                "why": "not known to this server (serve --strict refuses them); each response names "
                                       f"its own in {fields.IGNORED_HEADER}"}))
    return {fields.IGNORED_HEADER: shown}


async def _tokenization(request: Request, state: ServerState, work) -> Response:
    """/tokenize or /detokenize: `work(raw body, content type)` -> (answer, ignored fields), in a worker thread."""
    _authorize(request, state.config)
    raw = await _read_body(request, state.config.max_body_bytes)
    answer, ignored = await asyncio.to_thread(work, raw, request.headers.get("content-type"))
    return JSONResponse(answer, headers=_ignored(request, state, ignored))


def _submit(state: ServerState, job: Job, prompts: list[list[int]], queue: asyncio.Queue, loop) -> list[Submitted]:
    """Submit each prompt's n choices (choice p * n + j: OpenAI's order); the scheduler's thread posts (index, text),
    for a stream that asks for them (index, logprobs entries), and at the end (index, None) to `queue`. A prompt's
    choices share its prefill where its beginning is kept (runtime/prefix.py), as any prompts that begin alike do."""
    def post(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def ended(index: int):
        def on_end(request: Submitted) -> None:
            state.inflight.discard(request)
            state.metrics.finished(request, request.generation, protocol.outcome(request.generation))
            post((index, None))
        return on_end

    submitted, stop_ids = [], protocol.stop_ids(state.engine, job)
    streamed = job.stream and job.logprobs is not None
    for index, ids in ((p * job.n + j, ids) for p, ids in enumerate(prompts) for j in range(job.n)):
        try:
            request = state.scheduler.submit(ids, max_new_tokens=job.max_tokens or state.engine.max_context,
                                             sampling=job.choice_sampling(index % job.n), stop=job.stop,
                                             stop_ids=stop_ids, chat=False,
                                             on_text=lambda piece, index=index: post((index, piece)),
                                             on_end=ended(index),
                                             on_logprobs=(lambda e, index=index: post((index, e))) if streamed else None)
        except UserError as e:
            for r in submitted:
                r.cancel()
            raise protocol.bad(first_line(e)) from None
        state.inflight.add(request)
        state.metrics.admitted(len(ids))
        submitted.append(request)
    return submitted


async def _cancel_on_disconnect(request: Request, submitted: list[Submitted]) -> None:
    """Wait for the client to go away (the body is read: the next message is the disconnect), then cancel."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for r in submitted:
                r.cancel()
            return


def _results(request: Request, state: ServerState, submitted: list[Submitted]) -> list:
    """The ended requests' generations; an ApiError when one failed or was stopped by the server."""
    results = [r.generation for r in submitted]
    _note(request, completion_tokens=sum(r.stats.new_tokens for r in results if r is not None),
          finish=[protocol.outcome(r) for r in results])
    failed = next((r.error for r in submitted if r.error is not None), None)
    if failed is not None:
        raise ApiError(500, f"generation failed: {failed}")
    if any(r.stop_reason == "cancelled" for r in results):
        raise ApiError(503, "the server shut down before the request finished" if state.stopped else
                       "the request was cancelled")
    return results


class _EventStream(StreamingResponse):
    """The server-sent events of `submitted`, which are cancelled however the response ends: a client gone before
    the first event (the generator never started, so its own cleanup never runs), a fault, or the end."""

    def __init__(self, events, submitted: list[Submitted], headers: dict | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self.submitted = submitted

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for r in self.submitted:
                r.cancel()  # a no-op for ended requests


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _stream(request: Request, state: ServerState, job: Job, rid: str, submitted: list[Submitted],
                  queue: asyncio.Queue, echoed: list[protocol.Prompt]):
    """Server-sent events as the OpenAI client reads them: the role first (chat) or the echoed prompt (an echoing
    completion), text pieces and, where asked, each step's logprobs, a last chunk per choice with its finish reason,
    the usage chunk when asked, then [DONE]. A chat that calls tools sends its content and its calls whole at its end
    (the text must be read whole to tell a call from content). A failure mid-stream (a request that failed or was stopped, a fault
    here) is an error event (OpenAI's error object), then [DONE]. Starlette cancels this generator when the client
    disconnects (_EventStream then cancels the requests)."""
    created, model, complete = int(time.time()), state.config.model_name, False
    texts = logprobs.Texts(state.engine.tokenizer)
    held = [[] for _ in submitted] if job.calls_tools else None  # a tool-calling chat's text, read at its end
    offsets = [len(echoed[i // job.n].text) if echoed else 0 for i in range(len(submitted))]  # completions' text_offset
    try:
        try:
            for index in range(len(submitted)):
                if job.chat:
                    yield _sse(protocol.chunk(job, rid, created, model, index, role=True))
                elif echoed:
                    yield _sse(protocol.chunk(job, rid, created, model, index, text=echoed[index // job.n].text))
            ended = 0
            while ended < len(submitted):
                index, piece = await queue.get()
                if isinstance(piece, str) and held is not None:
                    held[index].append(piece)
                    continue
                if isinstance(piece, str):
                    yield _sse(protocol.chunk(job, rid, created, model, index, text=piece))
                    continue
                if piece is not None:  # a step's logprobs
                    if job.chat:
                        scores = {"content": logprobs.chat(texts, piece)["content"]}
                    else:
                        scores = logprobs.completion(texts, [(e, e.token) for e in piece], offsets[index])
                        offsets[index] += sum(len(t) for t in scores["tokens"])
                    yield _sse(protocol.chunk(job, rid, created, model, index, scores=scores))
                    continue
                ended += 1
                result = submitted[index].generation
                if result is None or result.stop_reason == "cancelled":
                    continue
                finish = FINISH[result.stop_reason]
                if held is not None:  # the content, then the calls, as whole deltas
                    content, calls, finish = protocol.answer(job, result, state.tool_parser)
                    if content:
                        yield _sse(protocol.chunk(job, rid, created, model, index, text=content))
                    if calls:
                        yield _sse(protocol.chunk(job, rid, created, model, index, calls=calls))
                yield _sse(protocol.chunk(job, rid, created, model, index, finish=finish))
            results = _results(request, state, submitted)
            if job.include_usage:
                yield _sse(protocol.usage_chunk(job, rid, created, model, results))
        except ApiError as e:
            _note(request, error=e.message)
            yield _sse(e.body())
        except Exception as e:  # noqa: BLE001 - a fault here, after the response began: said as a failed request is
            request_id = request.scope["state"]["request_id"]
            log.exception("request %s failed mid-stream", request_id)
            _note(request, error=f"internal error: {first_line(e)}")
            yield _sse(protocol.error_body(500, f"internal server error (request {request_id})"))
        yield _sse("[DONE]")
        complete = True
    finally:
        if not complete:
            _note(request, disconnected=True)
