"""The server's Prometheus metrics, named as vLLM's dashboards know them, under the `specexport:` prefix.

Requests running and waiting (read from the scheduler at each scrape), prompt and generation tokens, prompt tokens
prefilled and those copied from kept prompt beginnings (the prefix cache's queries and hits, read from the engine's
store at each scrape), finished requests by reason, time to first token, time per output token and end-to-end
latency histograms, the batch size of each target call, and speculation: drafts, draft tokens, accepted tokens,
accepted tokens per position. Counters are exported with `_total`, as prometheus_client writes them.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from specexport.runtime.generate import Generation
from specexport.runtime.request import Request
from specexport.runtime.scheduler import Scheduler

P = "specexport:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `_created` series beside every counter and histogram (as vLLM)


class Metrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, scheduler: Scheduler, model: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        running = Gauge(P + "num_requests_running", "Requests in the batch (decoding or prefilling).",
                        ["model_name"], registry=r)
        running.labels(**labels).set_function(lambda: len(scheduler.running) + len(scheduler.prefilling))
        waiting = Gauge(P + "num_requests_waiting", "Requests queued for a slot in the batch.", ["model_name"],
                        registry=r)
        waiting.labels(**labels).set_function(lambda: len(scheduler.waiting))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests.", ["model_name"],
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=r).labels(**labels)
        self.success = Counter(P + "request_success", "Requests finished, by finish reason (stop, length, abort: "
                               "cancelled or disconnected, error).", ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused before admission, by HTTP status.",
                                ["model_name", "status"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "A request's mean time between tokens after its "
                              "first.", ["model_name"], buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.batch = Histogram(P + "batch_size", "Sequences in each target call.", ["model_name"],
                               buckets=BATCH_BUCKETS, registry=r).labels(**labels)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Steps that verified draft tokens.", ["model_name"],
                              registry=r).labels(**labels)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified.", ["model_name"],
                                    registry=r).labels(**labels)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["model_name"],
                                registry=r).labels(**labels)
        self.per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each depth "
                               "of the tree (0: the first drafted token).", ["model_name", "position"], registry=r)
        self.labels = labels
        r.register(_PrefixCache(scheduler.engine, model))

    def step(self, sequences: int, width: int) -> None:
        """A target call of the scheduler (its on_step hook; the scheduler's thread)."""
        self.batch.observe(sequences)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def reject(self, status: int) -> None:
        self.rejected.labels(status=str(status), **self.labels).inc()

    def finished(self, request: Request, result: Generation | None, reason: str) -> None:
        """A request ended (reason: stop, length, abort or error); its latencies and speculation counted."""
        self.success.labels(finished_reason=reason, **self.labels).inc()
        if result is None:
            return
        stats = result.stats
        self.generation_tokens.inc(stats.new_tokens)
        if stats.new_tokens:
            self.ttft.observe(stats.ttft_s)
            self.e2e.observe(stats.seconds)
        if stats.new_tokens > 1 and len(request.arrivals) > 1:
            self.tpot.observe((request.arrivals[-1][0] - request.arrivals[0][0]) / (stats.new_tokens - 1))
        self.drafts.inc(stats.drafting_steps)
        self.draft_tokens.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for length in stats.accept_lengths:
            for position in range(length - 1):
                self.per_pos.labels(position=str(position), **self.labels).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCache:
    """The engine's prefix store as two counters, read at each scrape: prompt tokens prefilled (queries) and those
    copied from kept chunks (hits)."""

    def __init__(self, engine, model: str):
        self.engine, self.model = engine, model

    def collect(self):
        store = self.engine.prefixes
        for name, doc, value in (("prefix_cache_queries", "Prompt tokens prefilled.", store.queries),
                                 ("prefix_cache_hits", "Prompt tokens copied from kept prompt beginnings instead of "
                                  "computed.", store.hits)):
            family = CounterMetricFamily(P + name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
