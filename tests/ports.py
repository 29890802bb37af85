"""Loopback ports a test holds for the length of what it checks."""

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port bound here and never listened on, until the block ends.

    Connecting to it is refused, and no other process (a server another test starts meanwhile)
    can bind it: this socket has no SO_REUSEADDR, which Linux requires of both sockets to share a
    port. A ``packscore serve`` given it exits 3 (docs/cli.md) if it reaches its bind.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
