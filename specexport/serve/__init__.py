"""`specexport serve`: an OpenAI-compatible HTTP server over the batched engine (runtime/scheduler.py).

protocol.py checks OpenAI requests and builds OpenAI responses (no web framework); metrics.py keeps the Prometheus
metrics; app.py is the FastAPI application; server.py runs it on uvicorn with draining on SIGTERM/SIGINT, on the
address listen.py binds first. This layer sits above the runtime: the runtime never imports it, nor a web framework.
"""
