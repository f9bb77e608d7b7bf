"""Where a server listens: a socket bound to host:port before the server starts, so that an address it cannot have
(a port in use, a host that does not resolve or is not this machine's) is one line before a model loads."""

from __future__ import annotations

import socket

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
