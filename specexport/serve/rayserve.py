"""The OpenAI server on Ray Serve: replicas, each a whole `specexport serve` app over its own batched engine, behind
Ray's HTTP proxy (the `ray` extra).

`build_app(bundle, ...)` gives a `ray.serve.Application` for users composing their own Serve applications; `run`
starts (or joins) a Ray instance, deploys it, and serves until SIGTERM or SIGINT. The proxy routes each request to
a replica with a short queue (Ray's power-of-two-choices router, which compares the replicas' ongoing requests);
autoscaling targets `max_batch` ongoing requests per replica. Every replica reads the bundle from the same path, so
on a cluster it must be on storage every node sees.

Metrics: `/metrics` through the proxy reaches whichever replica the proxy picks. Every replica also mirrors its
Prometheus registry into Ray's metrics every few seconds (`RayMetrics`), tagged with the replica: each node's Ray
metrics agent exports them as `ray_specexport_*` (with Ray's own `ray_serve_*`), so a Prometheus scraping every node
sums the replicas (`sum by (finished_reason) (ray_specexport_request_success_total)`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from specexport.errors import UserError
from specexport.serve.listen import bound_socket, free_port

DEPLOYMENT = "specexport"
MIRROR_PERIOD_S = 5.0


class RayMetrics:
    """A replica's Prometheus registry mirrored into Ray's metrics (gauges holding each sample's value, counters'
    and histograms' cumulative ones included), tagged with the replica, every `period` seconds on a thread."""

    def __init__(self, registry, replica: str, period: float = MIRROR_PERIOD_S):
        from ray.util import metrics

        self.registry, self.replica, self.period, self.gauge_type = registry, replica, period, metrics.Gauge
        self.gauges: dict = {}
        threading.Thread(target=self._loop, name="specexport-ray-metrics", daemon=True).start()

    def mirror(self) -> None:
        for family in self.registry.collect():
            for sample in family.samples:
                name = sample.name.replace(":", "_")
                if name not in self.gauges:
                    self.gauges[name] = self.gauge_type(name, family.documentation or name,
                                                        tag_keys=(*sorted(sample.labels), "replica"))
                self.gauges[name].set(sample.value, tags={**sample.labels, "replica": self.replica})

    def _loop(self) -> None:
        while True:  # for the replica's life (a daemon thread)
            time.sleep(self.period)
            try:
                self.mirror()
            except Exception as e:  # noqa: BLE001 - metrics never take a replica down
                logging.getLogger("specexport.serve").warning("Ray metrics not mirrored: %s", e)


def build_app(bundle, replicas: int = 1, autoscale: tuple[int, int] | None = None, num_cpus: float | None = None,
              max_batch: int = 8, max_queue: int = 64, api_key: str | None = None, model_name: str | None = None,
              threads: int | None = None, max_context: int | None = None, prefill_chunk: int | None = None,
              prefill_tokens: int | None = None, max_body_bytes: int = 4 << 20, device: str = "cpu", prefix_cache: int | None = None,
              strict: bool = False, allowed_origins: tuple[str, ...] = (), chat_template: str | None = None,
              tool_call_parser: str | None = None):
    """The Serve application (a `ray.serve.Application`): `replicas` copies (or `autoscale` = (min, max) on ongoing
    requests), each loading `bundle` with these server settings (specexport serve's) and `num_cpus` cores (default:
    `replica_resources`)."""
    from ray import serve

    path = str(Path(bundle).resolve())
    settings = dict(max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                    model_name=model_name or Path(path).name, threads=threads, max_context=max_context,
                    prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, max_body_bytes=max_body_bytes,
                    device=device,
                    prefix_cache=prefix_cache, strict=strict, allowed_origins=tuple(allowed_origins),
                    chat_template=chat_template, tool_call_parser=tool_call_parser)

    def replica_app():
        import ray

        from specexport.serve.server import open_app  # on the replica

        replica = f"{ray.get_runtime_context().get_node_id()[:12]}/{os.getpid()}"
        app = open_app(path, served_by=replica, **settings)
        app.state.ray_metrics = RayMetrics(app.state.serve.metrics.registry, replica)
        return app

    options = dict(name=DEPLOYMENT, max_ongoing_requests=max_batch + max_queue,
                   ray_actor_options=replica_resources(path, num_cpus, threads),
                   graceful_shutdown_timeout_s=60)
    if autoscale is not None:
        low, high = autoscale
        options["autoscaling_config"] = {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                         "target_ongoing_requests": max_batch, "upscale_delay_s": 2,
                                         "downscale_delay_s": 10}
    else:
        options["num_replicas"] = replicas

    @serve.deployment(**options)
    @serve.ingress(replica_app)
    class Replica:
        pass

    return Replica.bind()


def replica_resources(bundle: str, num_cpus: float | None, threads: int | None) -> dict:
    """What a replica reserves: `num_cpus` if given, else its `threads`, else the cores of the machine the bundle was
    built for (its profile's detected hardware: its tree and settings were chosen for that many), else 1; a bundle
    built for a GPU profile also a GPU."""
    from specexport.bundle import load_bundle

    loaded = load_bundle(bundle, verify=False)
    resources = {"num_cpus": num_cpus if num_cpus is not None else threads or loaded.profile_cores or 1}
    if loaded.profile_kind == "gpu":
        resources["num_gpus"] = 1
    return resources


def deploy(app, timeout: float) -> None:
    """serve.run with a deadline: replicas that cannot be placed (more CPUs than the cluster has) or that fail to
    start are one line (run() then removes the application: nothing half-deployed is left)."""

    failure: list[BaseException] = []
    runner = threading.Thread(target=lambda: _run_into(app, failure), daemon=True)
    runner.start()
    runner.join(timeout)
    if runner.is_alive() or failure:
        why = f"not running after {timeout:g} s (are there enough CPUs for every replica?)" if not failure else \
            str(failure[0]).strip().splitlines()[-1][:300]
        raise UserError(f"the Ray deployment failed: {why}")


def _run_into(app, failure: list) -> None:
    from ray import serve

    try:
        serve.run(app, name=DEPLOYMENT, route_prefix="/")
    except Exception as e:  # noqa: BLE001 - reported by deploy()
        failure.append(e)


def run(bundle, host: str, port: int, address: str | None, on_ready, start_timeout: float = 300,
        detach: bool = False, **app_options) -> None:
    """Deploy build_app(bundle, ...) on Ray (a local instance on this machine unless `address` names a cluster) with
    the proxy on host:port (port 0, a local instance only: a free one); block until SIGTERM/SIGINT, then shut Serve
    down (Ray drains the replicas).

    `detach` (a cluster only): return once deployed, leaving the application on the cluster. Deploying again (a new
    bundle, other settings) is Ray's rolling update: new replicas start, the proxy moves to them as they become
    ready, and the old ones finish their requests before they stop (up to 60 s); a failed update leaves the running
    replicas alone. Ray's own `serve shutdown` removes it."""
    if detach and address is None:
        raise UserError("--detach needs --address: a private local instance ends with this process")
    if port == 0 and address is not None:
        raise UserError("--port 0 (a free port) needs the local instance: on a cluster give the proxy's port")
    if address is None:  # a private local instance on loopback only (read when ray is imported), no token in ~/.ray
        if port == 0:
            port = free_port(host)
        else:  # the proxy's address, here: one it cannot have is one line before Ray starts
            bound_socket(host, port).close()
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    for name in ("ray", "ray.serve"):  # Ray's progress lines stay in its logs; the CLI says what matters
        logging.getLogger(name).setLevel(logging.ERROR)
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 num_cpus=os.cpu_count(), logging_level=logging.ERROR)
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    leave = False  # whether the application stays on the cluster when this returns
    try:
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})  # one endpoint
        except Exception as e:  # noqa: BLE001 - the proxy's failure (its port taken since, or on a cluster's head)
            why = str(e).strip().splitlines()[-1][:300]
            raise UserError(f"Ray Serve could not listen on {host}:{port}: {why}") from None
        running = DEPLOYMENT in serve.status().applications
        leave = detach and running  # a failed update leaves the replicas that run
        deploy(build_app(bundle, **app_options), start_timeout)
        leave = detach
        exports = sorted({f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
                          if n.get("Alive") and n.get("MetricsExportPort")})
        print(f"Ray's metrics (every replica's as ray_specexport_*, Ray Serve's as ray_serve_*): {' '.join(exports)}",
              file=sys.stderr)
        on_ready(f"http://{host}:{port}")
        if detach:
            print(f"{'updated' if running else 'deployed'} the application {DEPLOYMENT!r} on {address}; it stays "
                  f"there (remove it with: serve shutdown --address ...)", file=sys.stderr)
            return
        stop.wait()
        print("draining: Ray shuts the replicas down after their requests", file=sys.stderr)
    finally:
        if leave:
            pass
        elif address is None:  # our own instance: all of it goes
            serve.shutdown()
        else:  # a shared cluster: only our application
            try:
                serve.delete(DEPLOYMENT)
            except Exception as e:  # noqa: BLE001
                print(f"warning: the application {DEPLOYMENT} may be left on the cluster: {e}", file=sys.stderr)
        ray.shutdown()
