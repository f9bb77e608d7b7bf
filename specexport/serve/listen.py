"""Where a server listens: a socket bound to host:port before the server starts, so that an address it cannot have
(a port in use, a host that does not resolve or is not this machine's) is one line before a model loads; a free
port for a server another process binds (Ray's proxy)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from specexport.errors import UserError


def bound_socket(host: str, port: int, option: str = "--port") -> socket.socket:
    """A TCP socket bound to `host` (an address or a name: its first address) and `port` (0: a free one), not yet
    listening, with SO_REUSEADDR as servers set it (a port in TIME_WAIT is free); `option` names the port's option
    in the message when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({option}): {e.strerror}") from None
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that another process will bind (Ray's proxy, a test's server). Drawn
    below the kernel's ephemeral range, where it places every bind to port 0 and every outgoing connection: a Ray
    instance opens hundreds of those, and one took a port drawn from that range before the proxy could bind it.
    Above Ray's worker ports (10002-19999). Where no such range is left (a kernel set so), the kernel's pick."""
    with bound_socket(host, 0) as probe:  # the host checked once: one that is not this machine's is one line
        kernel_pick = probe.getsockname()[1]
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    rng = random.Random()
    for _ in range(200 if ephemeral > 21000 else 0):
        try:
            with bound_socket(host, rng.randrange(20000, ephemeral)) as probe:
                return probe.getsockname()[1]
        except UserError:
            continue
    return kernel_pick
