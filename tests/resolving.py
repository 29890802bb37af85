"""A name that resolves to chosen addresses, as a headless Service's does, for the client's update to every pod."""

import socket

_GETADDRINFO = socket.getaddrinfo  # the real resolver, whatever a test patches in


def resolving(monkeypatch, name: str, *ips: str) -> None:
    """``name`` resolves to ``ips``, each once; every other name as usual."""
    def fake(host, port, *args, **kw):
        if host != name:
            return _GETADDRINFO(host, port, *args, **kw)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]
    monkeypatch.setattr(socket, "getaddrinfo", fake)
