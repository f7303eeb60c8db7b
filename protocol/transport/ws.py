"""Thin asyncio adapter between the sans-I/O sessions and the ``websockets`` library (v13+ asyncio API).

One binary websocket message = one frame. The adapter only moves bytes: every decision is made by
``ServerSession`` / ``ClientSession``.

Server::

    async def handler(channel: ServerChannel):
        async for msg in channel:          # ends when the client closes normally
            await channel.send(...)

    async with serve(handler, "0.0.0.0", 8765, expected_fingerprint=fp, auth_token=tok) as server:
        await server.serve_forever()

Client::

    async with await open_channel("ws://host:8765", fingerprint=fp, token=tok) as channel:
        await channel.send(Generate(...))
        async for msg in channel: ...

Oversized frames: websockets is given ``max_size = ws_max_size(max_frame_bytes)``, a margin above
the protocol limit. A frame between the two limits reaches the core, which answers with an Error
frame FRAME_TOO_LARGE and closes the connection (the sender's ``recv`` raises
``RemoteError(FRAME_TOO_LARGE)``). A frame above the margin is refused by websockets itself,
which closes with code 1009 before reading it; the adapter maps that close to
``RemoteError(FRAME_TOO_LARGE)`` on the sender's side too, so both cases look the same to callers.
Locally, ``send`` refuses a message above ``max_frame_bytes`` with ``ProtocolError(FRAME_TOO_LARGE)``
before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any, Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as _ws_serve
from websockets.exceptions import ConnectionClosed

from relayinfer.protocol.errors import ChannelClosed, ErrorCode, ProtocolError, RelayInferError, RemoteError
from relayinfer.protocol.transport.limits import ConnectionGate, ConnectionLimits, gated_connection, quiet_accept_errors
from relayinfer.protocol.messages import MAX_FRAME_BYTES, Error, Hello, Message, Welcome
from relayinfer.protocol.session import (ClientSession, HandshakeDone, MessageReceived, PeerError, ProtocolViolation,
    ServerSession)

COMPRESSION = None
"""websockets' `compression` on both sides: None, so neither offers or accepts permessage-deflate
(websockets' default is to negotiate it). The large frames are tensors (KV hand-off pieces, fp16)
that deflate by about 5 % at ~54 ms of CPU per MiB on the sender (measured, zlib level 6, window
2^12), which on a busy cloud core delayed the request's own tokens behind its KV pieces; the token
frames are a few dozen bytes."""

__all__ = ["ws_max_size", "ServerChannel", "ClientChannel", "accept", "serve", "open_channel"]

_CLOSE_CODES = {  # websocket close code used after sending an Error frame with this code
    ErrorCode.BAD_FRAME: 1002, ErrorCode.UNKNOWN_MESSAGE: 1002, ErrorCode.HANDSHAKE_REQUIRED: 1002,
    ErrorCode.FRAME_TOO_LARGE: 1009, ErrorCode.INTERNAL: 1011, ErrorCode.OVERLOADED: 1013,
}


def ws_max_size(max_frame_bytes: int) -> int:
    """websockets ``max_size`` (bytes) for a protocol limit: the limit plus max(limit/4, 64 KiB) margin,
    so that moderately oversized frames are answered with an Error frame instead of a bare 1009 close."""
    return max_frame_bytes + max(max_frame_bytes // 4, 64 * 1024)


async def _send_quietly(conn: ServerConnection | ClientConnection, frame: bytes) -> None:
    try:
        await conn.send(frame)
    except ConnectionClosed:
        pass  # the next recv reports the closure


async def _close(conn: ServerConnection | ClientConnection, code: int = 1000, reason: str = "") -> None:
    """Close the websocket (close `code`, `reason`), reading and dropping whatever the peer still
    sends meanwhile. Without that, a peer whose frames fill the incoming queue (websockets'
    `max_queue`: reading pauses when it is full) gets its close frame left unread, and the close
    waits out websockets' `close_timeout` (10 s) with the connection, and its session slot, held.
    Every close in this module goes through here."""

    async def drain() -> None:
        try:
            while True:
                await conn.recv()
        except Exception:  # noqa: BLE001  closed, or another task is reading (it drains then)
            pass

    reader = asyncio.ensure_future(drain())
    try:
        await conn.close(code, reason)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _fail(conn: ServerConnection | ClientConnection, session: ServerSession | ClientSession,
                code: ErrorCode, message: str) -> None:
    """Send a connection-level Error frame and close the websocket with the matching close code."""
    await _send_quietly(conn, session.fail(code, message))
    await _close(conn, _CLOSE_CODES.get(ErrorCode(code), 1008), ErrorCode(code).value)


class _Channel:
    """Common send/recv loop over one websocket connection and one session."""

    def __init__(self, ws: ServerConnection | ClientConnection, session: ServerSession | ClientSession) -> None:
        self.ws = ws
        self.session = session
        self._received: deque[Message] = deque()

    @property
    def hello(self) -> Hello | None:
        """The client's Hello (None before the handshake)."""
        return self.session.hello

    @property
    def welcome(self) -> Welcome | None:
        """The server's Welcome (None before the handshake)."""
        return self.session.welcome

    async def send(self, msg: Message) -> None:
        """Send one message. Raises ``ProtocolError`` from ``session.send`` (closed, before the handshake,
        FRAME_TOO_LARGE) or ``ChannelClosed`` / ``RemoteError`` if the connection is gone."""
        frame = self.session.send(msg)
        try:
            await self.ws.send(frame)
        except ConnectionClosed as exc:
            self.session.close()
            raise self._closed_error(exc) from None

    async def send_large(self, msgs: list[Message], limit: int = MAX_FRAME_BYTES) -> None:
        """Send messages larger than this session's own limit (sized for what the peer sends; a
        KV hand-off to a device) but within `limit`, the frame size every peer accepts. The limit
        is lifted only while they are encoded (no await in between: receives keep their limit)."""
        own, self.session.max_frame_bytes = self.session.max_frame_bytes, max(limit, self.session.max_frame_bytes)
        try:
            frames = [self.session.send(m) for m in msgs]
        finally:
            self.session.max_frame_bytes = own
        for frame in frames:
            try:
                await self.ws.send(frame)
            except ConnectionClosed as exc:
                self.session.close()
                raise self._closed_error(exc) from None

    async def recv(self) -> Message:
        """Next message from the peer (only one task may call recv at a time).

        Raises ``ProtocolError`` if the peer broke the protocol (an Error frame has been sent and the
        connection closed), ``RemoteError`` if the peer sent a connection-level Error, and
        ``ChannelClosed`` when the connection closes (``clean`` tells a normal close). Per-request
        ``Error`` messages (with a request_id) are returned, not raised.
        """
        while not self._received:
            await self._receive_events()
        return self._received.popleft()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection normally (websocket close ``code``, ``reason`` up to 123 bytes)."""
        self.session.close()
        await _close(self.ws, code, reason)

    def __aiter__(self) -> "_Channel":
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.recv()
        except ChannelClosed as exc:
            if exc.clean:
                raise StopAsyncIteration from None
            raise

    async def __aenter__(self) -> "_Channel":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # -- internals --------------------------------------------------------------------------------

    async def _receive_events(self) -> list:
        """Read one websocket message, feed the session, flush its output and act on its events."""
        try:
            data = await self.ws.recv()
        except ConnectionClosed as exc:
            self.session.close()
            raise self._closed_error(exc) from None
        if isinstance(data, str):
            await _fail(self.ws, self.session, ErrorCode.BAD_FRAME, "text websocket message; frames must be binary")
            raise ProtocolError(ErrorCode.BAD_FRAME, "peer sent a text websocket message")
        events = self.session.receive_frame(data)
        if any(isinstance(e, HandshakeDone) for e in events):
            # the session is open: the full frame limit holds before the Welcome leaves, so a
            # peer that sends a large frame the moment it reads the Welcome is not refused
            _set_max_size(self.ws, self.session.max_frame_bytes)
        for frame in self.session.data_to_send():
            await _send_quietly(self.ws, frame)
        for event in events:
            if isinstance(event, MessageReceived):
                self._received.append(event.message)
            elif isinstance(event, ProtocolViolation):
                code = ErrorCode(event.error.code)
                await _close(self.ws, _CLOSE_CODES.get(code, 1008), code.value)
                raise ProtocolError(code, event.error.message)
            elif isinstance(event, PeerError):
                await _close(self.ws)
                raise RemoteError(event.error.code, event.error.message, retry_after_ms=event.error.retry_after_ms)
        return events

    def _closed_error(self, exc: ConnectionClosed) -> RelayInferError:
        limit = ws_max_size(self.session.max_frame_bytes)
        we_first = exc.sent is not None and (exc.rcvd is None or exc.rcvd_then_sent is False)
        if we_first and exc.sent.code == 1009:
            return ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                                 f"peer sent a websocket message above {limit} bytes; connection closed")
        if exc.rcvd is not None and exc.rcvd.code == 1009:
            return RemoteError(ErrorCode.FRAME_TOO_LARGE,
                               f"peer closed the connection: message too big ({exc.rcvd.reason})")
        close = exc.rcvd if exc.rcvd is not None else exc.sent
        code = close.code if close is not None else None
        reason = close.reason if close is not None else ""
        return ChannelClosed(f"connection closed: {exc}", code, reason, clean=code in (1000, 1001))


class ServerChannel(_Channel):
    """Server side of one accepted connection, after a successful handshake (see :func:`accept`).

    ``hello``: the client's Hello; ``welcome``: the Welcome sent; ``session_id``: ``welcome.session_id``.
    """

    @property
    def session_id(self) -> str:
        """Id of this connection, as sent in the Welcome."""
        return self.session.session_id


class ClientChannel(_Channel):
    """Client side of a connection, after a successful handshake (see :func:`open_channel`)."""


async def accept(ws: ServerConnection, session: ServerSession, timeout: float = 10.0) -> ServerChannel:
    """Run the server handshake on an accepted websocket and return the open channel.

    Waits up to ``timeout`` seconds for the Hello. Raises ``ProtocolError`` (Error frame sent,
    connection closed) on a bad Hello, ``RemoteError`` if the client sent an Error, ``ChannelClosed``
    if the client went away, and ``TimeoutError`` (after sending HANDSHAKE_REQUIRED and closing).
    """
    channel = ServerChannel(ws, session)
    try:
        with _handshake_limit(ws, session):
            await asyncio.wait_for(_until_handshake(channel), timeout)
    except asyncio.TimeoutError:
        if not session.closed:
            await _fail(ws, session, ErrorCode.HANDSHAKE_REQUIRED, f"no hello within {timeout} s")
        raise TimeoutError(f"no hello within {timeout} s") from None
    return channel


@contextlib.contextmanager
def _handshake_limit(ws: ServerConnection | ClientConnection, session: ServerSession | ClientSession):
    """Until the handshake is done websockets refuses messages above the handshake limit (plus the
    margin of `ws_max_size`) itself, so an unauthenticated peer cannot make it buffer megabytes."""
    _set_max_size(ws, session.handshake_max_bytes)
    try:
        yield
    finally:
        _set_max_size(ws, session.max_frame_bytes)


def _set_max_size(ws: ServerConnection | ClientConnection, max_frame_bytes: int) -> None:
    """The largest websocket message websockets itself accepts from now on: `ws_max_size` of
    `max_frame_bytes` (a no-op for a connection object without that setting)."""
    proto = getattr(ws, "protocol", None)
    if proto is not None and hasattr(proto, "max_message_size"):
        proto.max_message_size = ws_max_size(max_frame_bytes)


async def _until_handshake(channel: _Channel) -> None:
    while not any(isinstance(e, HandshakeDone) for e in await channel._receive_events()):
        pass


def serve(
    handler: Callable[[ServerChannel], Awaitable[None]],
    host: str | None,
    port: int | None,
    *,
    expected_fingerprint: str,
    auth_token: str | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    handshake_timeout: float | None = None,
    server: str = "",
    admit: Callable[[], "Error | None"] | None = None,
    release: Callable[[], None] | None = None,
    device_model_url: str = "",
    gate: ConnectionGate | None = None,
    **serve_kwargs: Any,
) -> Any:
    """Start a websockets server whose ``handler`` receives handshaken :class:`ServerChannel`\\ s.

    Returns websockets' ``serve`` object: use ``async with serve(...) as server`` (a
    ``websockets.asyncio.server.Server``; ``port=0`` picks a free port, see ``server.sockets``).
    Connections failing the handshake are answered with an Error frame and closed without calling
    ``handler``. A ``RelayInferError`` escaping ``handler`` ends only that connection: quietly if the
    channel is already closed (protocol violation, remote error, closure), otherwise with an Error
    frame carrying the exception's code and message; any other exception sends an INTERNAL Error
    frame and is re-raised (logged by websockets). ``admit``, if given, is called for each new
    connection right after the websocket upgrade, before the Hello: it returns None to admit it
    (the caller counts the session from then on: an open websocket that never says Hello holds a
    session slot too), or a connection-level ``Error`` (e.g. OVERLOADED with ``retry_after_ms``)
    that is sent instead of the Welcome before closing. ``release``, if given, is called once when
    an admitted connection ends, whatever ended it.

    Connection limits (`protocol.transport.limits`): ``gate`` (default: a new ``ConnectionGate`` with the
    default ``ConnectionLimits``; share one between a server's ports) caps open connections, total
    and per client address, at accept (503 + Retry-After beyond); the websocket opening handshake
    (``open_timeout``), the TLS handshake and the Hello (``handshake_timeout``) are each bounded by
    the gate's ``header_timeout_s`` unless given. Failed ``accept()`` calls are logged once per 10 s.
    Extra keyword arguments go to ``websockets.asyncio.server.serve``.
    """

    async def _handler(ws: ServerConnection) -> None:
        session = ServerSession(expected_fingerprint, auth_token, max_frame_bytes, server=server,
                                device_model_url=device_model_url)
        refusal = admit() if admit is not None else None
        if refusal is not None:
            await _send_quietly(ws, session.send(refusal))
            await _close(ws, _CLOSE_CODES.get(ErrorCode(refusal.code), 1008), refusal.code)
            return
        try:
            try:
                channel = await accept(ws, session, hello_timeout)
            except (RelayInferError, TimeoutError):
                return  # already answered with an Error frame and closed
            try:
                await handler(channel)
            except RelayInferError as exc:  # a closed channel ends quietly; any other error is told to the client
                if not session.closed:
                    await _fail(ws, session, exc.code, exc.message)
            except Exception:
                if not session.closed:
                    await _fail(ws, session, ErrorCode.INTERNAL, "internal server error")
                raise
        finally:
            if release is not None:  # the session ends with its handler, before the close handshake
                release()
            await _close(ws)  # what the client still sends is not read (no-op if closed already)

    gate = gate or ConnectionGate()
    hello_timeout = gate.limits.header_timeout_s if handshake_timeout is None else handshake_timeout
    serve_kwargs.setdefault("open_timeout", gate.limits.header_timeout_s)
    ssl = serve_kwargs.pop("ssl", None)  # the gate makes the TLS handshake, after counting the connection
    serve_kwargs.pop("ssl_handshake_timeout", None)  # the gate's header_timeout_s bounds it
    try:
        quiet_accept_errors()
    except RuntimeError:  # no running loop yet: the caller's loop keeps its own handler
        pass
    serve_kwargs.setdefault("compression", COMPRESSION)
    return _ws_serve(_handler, host, port, max_size=ws_max_size(max_frame_bytes),
                     create_connection=gated_connection(gate, ssl), **serve_kwargs)


async def open_channel(
    url: str,
    fingerprint: str,
    token: str | None = None,
    *,
    client: str = "",
    max_frame_bytes: int = MAX_FRAME_BYTES,
    open_timeout: float = 10.0,
    **connect_kwargs: Any,
) -> ClientChannel:
    """Connect to ``url`` (ws:// or wss://), handshake, and return the open :class:`ClientChannel`.

    ``open_timeout`` (seconds) bounds the TCP/websocket opening and the handshake, each.
    Raises ``RemoteError`` if the server refuses the Hello (its code: FINGERPRINT_MISMATCH,
    UNAUTHORIZED, VERSION_MISMATCH, OVERLOADED, ...), ``ProtocolError`` if the Welcome is bad,
    ``OSError`` / ``TimeoutError`` if the server is unreachable, and websockets'
    ``InvalidHandshake`` if the HTTP upgrade fails.
    """
    connect_kwargs.setdefault("compression", COMPRESSION)
    ws = await connect(url, max_size=ws_max_size(max_frame_bytes), open_timeout=open_timeout, **connect_kwargs)
    session = ClientSession(fingerprint, token, max_frame_bytes, client=client)
    channel = ClientChannel(ws, session)
    try:
        await _send_quietly(ws, session.start())
        with _handshake_limit(ws, session):
            await asyncio.wait_for(_until_handshake(channel), open_timeout)
    except asyncio.TimeoutError:
        await _close(ws)
        raise TimeoutError(f"no welcome from {url} within {open_timeout} s") from None
    except BaseException:
        await _close(ws)
        raise
    return channel
