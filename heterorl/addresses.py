"""Network addresses as the project writes them: ``HOST:PORT``, or with a scheme, ``tcp://HOST:PORT`` (ZeroMQ),
``ray://HOST:PORT``, ``http://HOST:PORT``; an IPv6 host in brackets, ``tcp://[::1]:5555``. `parse_host_port` is
the one parser every caller uses (a leaf: it imports nothing of heterorl but its errors)."""

from __future__ import annotations

from heterorl.errors import ConfigError


def parse_host_port(address: str, what: str, example: str) -> tuple[str, int]:
    """(HOST, PORT) of ``[SCHEME://]HOST:PORT``. HOST is as written, an IPv6 host in its brackets, so that
    ``f"tcp://{host}:{port}"`` is an address again (strip them for `socket`). ConfigError naming ``what`` (the
    option or config key the address came from), the address and a form that works (``example``) when there is no
    host or no numeric port."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not (sep and host and port.isdigit()):
        raise ConfigError(f"{what} {address!r} is not HOST:PORT with a numeric port: give one such as {example}")
    return host, int(port)


__all__ = ["parse_host_port"]
