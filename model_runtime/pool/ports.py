"""Loopback ports (standard library only: the HTTP side imports it without torch)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free right now. Another process may still take it before it is bound;
    a caller that cannot afford that binds it itself (the worker pool hands rank 0 a bound socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
