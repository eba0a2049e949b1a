"""The TCP ports a server binds at start-up (one server's --port, and --dp's front door and
router metrics port)."""

from __future__ import annotations

import socket


class PortUnavailable(Exception):
    pass


def bind_port(host: str, port: int, what: str = "HTTP") -> socket.socket:
    """A TCP socket bound to host:port as uvicorn binds one, at start-up: a taken port stops the
    server in a second, before any model loads (uvicorn then listens on this socket)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortUnavailable(f"cannot serve {what} on {host}:{port}: {e.strerror or e}") from None
    return sock
