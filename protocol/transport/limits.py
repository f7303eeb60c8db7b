"""Connection limits shared by every server (torch-free): caps at accept, a request-head timeout on
HTTP ports, and accept() errors logged once per interval.

One `ConnectionGate` per server process holds the limits of all its ports (`ConnectionLimits`):

- at most ``max_connections`` open connections in all, and ``max_connections_per_client`` per
  client IP address, counted the moment the kernel hands a connection over (``connection_made``);
  a connection beyond either cap gets ``HTTP/1.1 503`` with ``Retry-After`` and is closed at once,
  before any byte of it is read (a websocket upgrade is an HTTP request, so both kinds of port
  answer the same way);
- on an HTTP port (`GatedSite`, an aiohttp site) the request head (request line and headers) must
  arrive within ``header_timeout_s`` of the connection opening, else the connection is closed; between
  requests a keep-alive connection idles at most ``idle_timeout_s`` (aiohttp's ``keepalive_timeout``,
  which also closes a connection whose next head does not arrive in that time: see `runner_kwargs`);
- on a websocket port (`gated_connection`, a ``websockets`` connection factory) the opening handshake
  is bounded by websockets' ``open_timeout`` and the protocol Hello by the handshake timeout of
  ``protocol.transport.ws.serve``, both ``header_timeout_s``;
- TLS is done by the gate after the connection was counted (the listening socket is plain and
  ``loop.start_tls`` runs the handshake), so a TLS handshake that never finishes holds a slot like
  any other connection and is bounded by ``header_timeout_s``.

`MemoryBudget` is the one byte budget of a server's requests (see its docstring).

`quiet_accept_errors(loop)` replaces asyncio's one traceback per failed ``accept()`` (EMFILE,
ENFILE, ENOBUFS, ENOMEM: asyncio retries every second per listening socket) by one warning line per
``interval_s`` with the count.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ConnectionLimits", "ConnectionGate", "GatedSite", "gated_connection", "quiet_accept_errors",
           "runner_kwargs", "LOOPBACK_HOSTS", "is_loopback", "MemoryBudget", "Charge", "trim_heap"]

log = logging.getLogger("relayinfer.limits")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str | None) -> bool:
    """True when `host` (a listen address) reaches only this machine: 127.0.0.0/8, ::1 or
    localhost. An empty host, 0.0.0.0 and :: listen on every interface: False."""
    if not host:
        return False
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public address


@dataclass(frozen=True)
class ConnectionLimits:
    """Limits of a server's ports (see the module docstring).

    Attributes:
        max_connections: open connections at most, all ports and clients together (>= 1).
        max_connections_per_client: open connections at most from one client IP address (>= 1).
        header_timeout_s: seconds for an HTTP request head, a websocket opening handshake, the
            protocol Hello and a TLS handshake, each (> 0).
        idle_timeout_s: seconds an HTTP keep-alive connection may idle between requests, and
            the most an OpenAI request body may take to arrive in full (408 beyond) (> 0).
        retry_after_s: the `Retry-After` of a refused connection (seconds, whole, >= 0).
    """

    max_connections: int = 512
    max_connections_per_client: int = 128
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0 (seconds), got {v}")
        if not (self.retry_after_s >= 0 and math.isfinite(self.retry_after_s)):
            raise ValueError(f"retry_after_s must be >= 0 (seconds), got {self.retry_after_s}")


def _peer_ip(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return str(peer or "?")


class ConnectionGate:
    """Counts the open connections of one server (all its ports) and refuses those beyond
    `limits` (see the module docstring). `open` / `per_client`: the current counts; `refused`:
    connections refused so far; `timed_out`: HTTP connections closed for a late request head;
    `tls_failed`: TLS handshakes that failed, timed out or were cut; `handshakes`: the tasks of the
    TLS handshakes under way."""

    def __init__(self, limits: ConnectionLimits | None = None) -> None:
        self.limits = limits or ConnectionLimits()
        self.open = 0
        self.per_client: dict[str, int] = {}
        self.refused = 0
        self.timed_out = 0
        self.tls_failed = 0
        self.handshakes: set[asyncio.Task] = set()  # TLS handshakes under way

    def enter(self, transport: asyncio.BaseTransport, plain: bool = True) -> str | None:
        """Count a new connection and return its client address, or refuse it: answer 503 with
        `Retry-After` (`plain`: the connection is not TLS; a TLS one is closed without a word, as
        no handshake was made to say it in), close it and return None."""
        ip = _peer_ip(transport)
        lim = self.limits
        why = (f"the server holds its limit of {lim.max_connections} open connections"
               if self.open >= lim.max_connections else
               f"{ip} holds the limit of {lim.max_connections_per_client} open connections per client"
               if self.per_client.get(ip, 0) >= lim.max_connections_per_client else None)
        if why is not None:
            self.refused += 1
            body = f"{why}; retry after {lim.retry_after_s:.0f} s\n".encode()
            if not plain:
                transport.abort()
                return None
            try:
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: text/plain; "
                                b"charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                % (math.ceil(lim.retry_after_s), len(body), body))
                transport.close()
            except Exception:  # the peer may already be gone
                transport.abort()
            return None
        self.open += 1
        self.per_client[ip] = self.per_client.get(ip, 0) + 1
        return ip

    def leave(self, ip: str) -> None:
        """A counted connection (`enter` returned `ip`) closed."""
        self.open -= 1
        n = self.per_client.get(ip, 0) - 1
        if n > 0:
            self.per_client[ip] = n
        else:
            self.per_client.pop(ip, None)

    def close(self) -> None:
        """Cut the TLS handshakes under way (a server that stops: the listeners are closed, and
        nothing else holds these connections)."""
        for task in list(self.handshakes):
            task.cancel()

    def http_factory(self, inner: Callable[[], asyncio.Protocol], ssl: Any = None) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` (called without ``ssl``) around `inner`
        (aiohttp's ``web.Server``): caps at accept, the TLS handshake (with `ssl`) and the
        request-head timeout."""
        return lambda: _GatedConn(inner(), self, ssl, head_timeout=True)

    def protocol(self, inner: asyncio.Protocol, ssl: Any = None) -> asyncio.Protocol:
        """The protocol to hand to asyncio for one accepted connection whose application protocol
        is `inner`: counted at accept, refused beyond the caps, TLS (with `ssl`, a server
        ``ssl.SSLContext``) done here, bounded by ``header_timeout_s``."""
        return _GatedConn(inner, self, ssl, head_timeout=False)


def runner_kwargs(limits: ConnectionLimits) -> dict:
    """``web.AppRunner`` keyword arguments for `limits`: ``keepalive_timeout = idle_timeout_s``."""
    return {"keepalive_timeout": limits.idle_timeout_s}


class _GatedConn(asyncio.Protocol):
    """One accepted connection: counted by the gate the moment the kernel hands it over (before any
    TLS handshake: a handshake that never finishes holds a slot, and is closed after
    ``header_timeout_s``), then handed to `inner` (the application protocol: aiohttp's request
    handler or a websockets connection), over TLS when `ssl` is given (``loop.start_tls``: the
    listening socket itself is plain). With `head_timeout` (HTTP ports) the connection is closed
    when no complete request head (``\\r\\n\\r\\n``) arrived within ``header_timeout_s`` of its opening."""

    def __init__(self, inner: asyncio.Protocol, gate: ConnectionGate, ssl: Any = None, head_timeout: bool = False
                 ) -> None:
        self.inner, self.gate, self.ssl = inner, gate, ssl
        self.ip: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.BaseTransport | None = None
        self._head_timeout = head_timeout
        self._made = False  # inner.connection_made was called
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.ip = self.gate.enter(transport, plain=self.ssl is None)
        if self.ip is None:
            return
        loop = asyncio.get_running_loop()
        if self._head_timeout:  # from the opening: the TLS handshake counts into the head's time
            self._timer = loop.call_later(self.gate.limits.header_timeout_s, self._late_head)
        self._transport = transport
        if self.ssl is None:
            self._app_made(transport)
            return
        transport.pause_reading()  # start_tls takes the bytes from here on (the ClientHello included)
        task = loop.create_task(self._start_tls(transport))
        self.gate.handshakes.add(task)
        task.add_done_callback(self.gate.handshakes.discard)

    async def _start_tls(self, raw: asyncio.BaseTransport) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw, self, self.ssl, server_side=True, ssl_handshake_timeout=self.gate.limits.header_timeout_s)
        except BaseException as e:  # a failed, timed-out or cancelled handshake: free the slot
            self.gate.tls_failed += 1
            raw.abort()
            self._lost()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if tls is None or self.ip is None:  # closed meanwhile (the request-head timeout of an HTTP port)
            self.gate.tls_failed += 1
            raw.abort()
            self._lost()
            return
        self._transport = tls
        self._app_made(tls)

    def _app_made(self, transport: asyncio.BaseTransport) -> None:
        self._made = True
        self.inner.connection_made(transport)
        early, self._early = self._early, []
        for data in early:  # decrypted bytes that came with the end of the handshake
            if self._made:
                self.data_received(data)

    def _late_head(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self.gate.timed_out += 1
            self._transport.abort()  # the request head did not arrive in time: nothing to answer

    def data_received(self, data: bytes) -> None:
        if not self._made:
            if self.ip is not None:  # TLS: start_tls delivers data before it returns the transport
                self._early.append(data)
            return
        if self._timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self._made else None

    def pause_writing(self) -> None:
        if self._made:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._made:
            self.inner.resume_writing()

    def _lost(self) -> None:
        """Give the gate slot back (once)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        if self.ip is not None:
            ip, self.ip = self.ip, None
            self.gate.leave(ip)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost()
        if self._made:
            self._made = False
            self.inner.connection_lost(exc)


def _gated_site_class():
    from aiohttp import web

    class GatedSite(web.BaseSite):
        """An aiohttp TCP site whose connections pass a `ConnectionGate` (caps at accept, the
        request-head timeout, the TLS handshake bound). ``port``: the bound port once started."""

        def __init__(self, runner: "web.BaseRunner", host: str | None, port: int, gate: ConnectionGate, *,
                     ssl_context=None, backlog: int = 128) -> None:
            super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
            self._host, self._port, self._gate = host, port, gate

        @property
        def name(self) -> str:
            return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

        @property
        def port(self) -> int:
            return self._server.sockets[0].getsockname()[1] if self._server is not None else self._port

        async def start(self) -> None:
            await super().start()
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self._gate.http_factory(self._runner.server, self._ssl_context),
                                                    self._host, self._port, backlog=self._backlog)

    return GatedSite


def __getattr__(name: str):  # GatedSite needs aiohttp, which the device install does not have
    if name == "GatedSite":
        return _gated_site_class()
    raise AttributeError(name)


def gated_connection(gate: ConnectionGate, ssl: Any = None):
    """A ``create_connection`` for ``websockets.asyncio.server.serve`` (called without ``ssl``):
    each connection passes `gate` at accept (beyond a cap the client gets 503 + Retry-After, or a
    plain close on a TLS port, and no handler runs) and, with `ssl`, its TLS handshake is made by
    the gate (bounded by ``header_timeout_s``) after it was counted."""
    from websockets.asyncio.server import ServerConnection

    def create_connection(*args: Any, **kwargs: Any) -> asyncio.Protocol:
        return gate.protocol(ServerConnection(*args, **kwargs), ssl)

    return create_connection


_ACCEPT_MESSAGES = ("socket.accept() out of system resource", "Error on reading from the event loop self pipe",
                    "Accept failed on a socket")


def quiet_accept_errors(loop: asyncio.AbstractEventLoop | None = None, interval_s: float = 10.0) -> None:
    """Log failed ``accept()`` calls of `loop` (default: the running loop) as one warning line per
    `interval_s` seconds with their count and the last error, instead of asyncio's traceback each
    time; other exceptions go to the loop's previous handler. Idempotent per loop."""
    loop = loop or asyncio.get_running_loop()
    if getattr(loop, "_relayinfer_quiet_accept", False):
        return
    previous = loop.get_exception_handler()
    state = {"count": 0, "last_log": -math.inf}

    def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
        msg = str(context.get("message", ""))
        if msg.startswith(_ACCEPT_MESSAGES):
            state["count"] += 1
            now = time.monotonic()
            if now - state["last_log"] >= interval_s:
                exc = context.get("exception")
                log.warning("accept() failed %d time(s) in the last %.0f s (last: %s); new connections wait until "
                            "descriptors are free", state["count"], interval_s, exc or msg)
                state["count"], state["last_log"] = 0, now
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        loop._relayinfer_quiet_accept = True  # type: ignore[attr-defined]
    except AttributeError:  # a loop class with __slots__: the handler is then set again (harmless)
        pass


class MemoryBudget:
    """One byte budget for everything a server's requests hold (KV caches, prefill and attention
    scratch, KV hand-off copies, received frames and decoded tiles).

    `try_charge(path, nbytes)` returns a `Charge` (give it back with `release()`, idempotent) or
    None when `used + nbytes` would pass `limit_bytes`; the caller then answers OVERLOADED /
    503 + Retry-After. `reserve(path, nbytes)` charges memory held for the server's lifetime (the
    batching engine's preallocated KV pool) and raises ValueError when it alone passes the limit.
    `used`: bytes charged now; `by_path`: the same by path; `refused`: refusals by path.
    Thread-safe (charges are taken on the event loop and may be released on a worker thread).
    """

    def __init__(self, limit_bytes: int) -> None:
        import threading

        if limit_bytes < 1:
            raise ValueError(f"memory budget must be >= 1 byte, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.used = 0
        self.by_path: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """Bytes not charged (>= 0)."""
        return max(self.limit_bytes - self.used, 0)

    def reserve(self, path: str, nbytes: int) -> "Charge":
        """Charge `nbytes` for good (released only by the returned Charge). Raises ValueError
        naming both sizes (MiB) when it does not fit."""
        charge = self.try_charge(path, nbytes)
        if charge is None:
            raise ValueError(f"{path} needs {nbytes / 2**20:.0f} MiB but the memory budget is "
                             f"{self.limit_bytes / 2**20:.0f} MiB ({self.used / 2**20:.0f} MiB already charged)")
        return charge

    def try_charge(self, path: str, nbytes: int) -> "Charge | None":
        """A Charge of `nbytes` (>= 0) under `path`, or None if it does not fit (counted in `refused`)."""
        nbytes = max(int(nbytes), 0)
        with self._lock:
            if self.used + nbytes > self.limit_bytes:
                self.refused[path] = self.refused.get(path, 0) + 1
                return None
            self.used += nbytes
            self.by_path[path] = self.by_path.get(path, 0) + nbytes
        return Charge(self, path, nbytes)

    def _release(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            self.by_path[path] = self.by_path.get(path, 0) - nbytes

    def refusal(self, what: str, nbytes: int) -> str:
        """The message of a refusal: what needed how much, and what the budget holds."""
        return (f"{what} needs {nbytes / 2**20:.1f} MiB of memory and {self.free / 2**20:.1f} MiB of the "
                f"server's {self.limit_bytes / 2**20:.0f} MiB budget are free")


class Charge:
    """Bytes charged to a `MemoryBudget` under a path; `release()` gives them back (once)."""

    __slots__ = ("budget", "path", "nbytes")

    def __init__(self, budget: MemoryBudget, path: str, nbytes: int) -> None:
        self.budget, self.path, self.nbytes = budget, path, nbytes

    def release(self) -> None:
        """Give the bytes back; later calls do nothing. Large releases return freed heap pages to
        the system (`trim_heap`), so the process's RSS follows the budget."""
        if self.budget is None:
            return
        budget, self.budget = self.budget, None
        budget._release(self.path, self.nbytes)
        if self.nbytes >= 16 << 20:
            trim_heap()


def trim_heap() -> None:
    """Return free heap memory to the OS (glibc `malloc_trim(0)`; a no-op elsewhere). Large
    tensors freed by a request stay in the process otherwise: glibc raises its mmap threshold after
    the first large free, so later buffers of up to 32 MiB come from the heap, which rarely shrinks."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
