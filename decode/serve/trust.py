"""Who may talk to ``polyspec serve`` and how (docs/SERVE.md, "Trust model"): the Host names it answers, the web
origins it lets in, and how long and how many connections it keeps.

A server on 127.0.0.1 is not private from the web pages its user visits: a page may send requests to it (a form or
``fetch`` with ``Content-Type: text/plain`` goes out without asking), and a page on a domain that resolves to
127.0.0.1 (DNS rebinding) may even read the answers, as the browser then treats the server as that domain. So the
server answers only Host names it knows (loopback names, plus ``--allowed-host``), refuses any request a web page
sends from an origin not in ``--cors-origin`` (browsers always send ``Origin`` on cross-origin requests), and takes
POST bodies only as ``application/json`` (which a page cannot send cross-origin without a CORS preflight that only
the configured origins pass). At the connection level, a client must finish its headers within the read timeout
and at most ``max_connections`` are open at once (a slow client holds a connection, not the server).

Light on purpose (no uvicorn, no fastapi at import): the CLI builds a :class:`ServeAccess` before loading a chain.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
ANY = "*"
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header: port and IPv6 brackets removed, lower case, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header[1:]
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def _origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


@dataclass(frozen=True)
class ServeAccess:
    """allowed_hosts: Host names answered besides loopback ones ("*": any). cors_origins: web origins
    (``scheme://host[:port]``) whose pages may call the API ("*": any); every other request that carries an
    ``Origin`` is refused."""

    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    @classmethod
    def for_bind(cls, bind: str, allowed_hosts: list[str] | None, cors_origins: list[str] | None) -> ServeAccess:
        """The CLI's access: the names given, plus the address the server listens on when it is a specific one
        (clients that reach 192.168.1.5 send Host: 192.168.1.5)."""
        hosts = [host_name(h) for h in allowed_hosts or []]
        if bind not in WILDCARD_BINDS and not is_loopback(bind):
            hosts.append(host_name(bind))
        return cls(tuple(dict.fromkeys(hosts)), tuple(_origin(o) for o in cors_origins or []))

    def host_allowed(self, header: str | None) -> bool:
        """A request without Host (HTTP/1.0: no browser sends one) or naming a loopback or allowed name."""
        if not header:
            return True
        name = host_name(header)
        return ANY in self.allowed_hosts or is_loopback(name) or name in self.allowed_hosts

    def origin_allowed(self, origin: str | None) -> bool:
        """No Origin (not sent by a web page across origins) or one of cors_origins."""
        return origin is None or ANY in self.cors_origins or _origin(origin) in self.cors_origins

    def describe(self) -> str:
        hosts = "any" if ANY in self.allowed_hosts else ", ".join(["loopback names", *self.allowed_hosts])
        origins = ", ".join(self.cors_origins) or "none"
        return f"Host: {hosts}; web origins: {origins}"


def guarded_protocol(read_timeout: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks it), with a deadline for each request's headers
    (``read_timeout`` seconds from the connection, or from the end of the previous answer) and at most
    ``max_connections`` connections at once (one more is answered 503 and closed). uvicorn itself bounds neither:
    a client that never finishes its headers holds its connection for ever."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _timer: Any = None
        _seen: Any = None
        _begun = False  # bytes of a next request arrived since the timer was armed

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                                b"Content-Length: 0\r\n\r\n")
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._cancel()
            self._seen, self._begun = self.cycle, False
            self._timer = self.loop.call_later(read_timeout, self._late)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _late(self) -> None:
            """No request's headers were completed since the timer was armed and none is being answered: close (with
            a 408 when part of a request came; an idle kept-alive connection just closes, as uvicorn's own timer
            closes it)."""
            self._timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if self.cycle is self._seen and idle and not self.transport.is_closing():
                if self._begun:
                    self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                                         b"Content-Length: 0\r\n\r\n")
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            self._begun = True
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._seen:  # a request's headers are complete
                self._cancel()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

    return Guarded


__all__ = ["ServeAccess", "is_loopback", "host_name", "guarded_protocol", "LOOPBACK_NAMES"]
