"""Sans-I/O protocol core: a pure state machine, bytes in, events out.

No sockets, no asyncio, no clocks: the transport adapter (``ws.py``, or your own) feeds received
frames in with ``receive_frame`` (or raw stream bytes with ``receive_data``), acts on the returned
events, and writes out whatever ``send`` returns and whatever ``data_to_send`` holds.

    server = ServerSession(expected_fingerprint="ab12...")
    for event in server.receive_frame(frame):
        ...                                   # HandshakeDone / MessageReceived / ProtocolViolation / PeerError
    for out in server.data_to_send():         # Welcome, Error, Pong frames produced by the core
        transport.write(out)
    transport.write(server.send(Token(...)))

States: HANDSHAKE (waiting for Hello / Welcome) -> OPEN -> CLOSED. A session closes when it rejects
the peer (``ProtocolViolation``: the Error frame is queued in ``data_to_send``; send it, then close
the transport), when the peer sends a connection-level Error (``PeerError``), or on ``fail()``.
Once closed, received frames are ignored. Pings are answered by the core (a Pong is queued) and
produce no event.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from dataclasses import dataclass
from typing import Union

from .errors import ErrorCode, ProtocolError
from .framing import FrameBuffer, check_frame_size, pack_frame
from .messages import (
    HANDSHAKE_MAX_BYTES, MAX_FRAME_BYTES, PROTOCOL_VERSION, Error, Hello, Message, Ping, Pong, Welcome, decode, encode,
)

__all__ = [
    "State", "HandshakeDone", "MessageReceived", "ProtocolViolation", "PeerError", "Event",
    "ServerSession", "ClientSession",
]


class State(enum.Enum):
    """Session state."""

    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class HandshakeDone:
    """Hello/Welcome exchange succeeded; the session is OPEN."""

    hello: Hello
    welcome: Welcome


@dataclass(frozen=True)
class MessageReceived:
    """A valid message after the handshake (including per-request ``Error``s, which carry a request_id)."""

    message: Message


@dataclass(frozen=True)
class ProtocolViolation:
    """We rejected the peer. ``error`` is the Error frame queued in ``data_to_send()``; the session is CLOSED."""

    error: Error


@dataclass(frozen=True)
class PeerError:
    """The peer sent a connection-level Error (request_id None) and will close; the session is CLOSED."""

    error: Error


Event = Union[HandshakeDone, MessageReceived, ProtocolViolation, PeerError]


def _tag(msg: Message) -> str:
    return type(msg).__struct_config__.tag


def _short(fingerprint: str, n: int = 16) -> str:
    return fingerprint if len(fingerprint) <= n else fingerprint[:n] + "…"


class _Session:
    """Behaviour shared by both ends; subclasses implement ``_handshake``."""

    def __init__(self, max_frame_bytes: int, stream: bool, handshake_max_bytes: int = HANDSHAKE_MAX_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.handshake_max_bytes = min(handshake_max_bytes, max_frame_bytes)
        self.stream = stream
        self.state = State.HANDSHAKE
        self.hello: Hello | None = None
        self.welcome: Welcome | None = None
        self.close_error: Error | None = None  # the Error (ours or the peer's) that closed the session
        self._out: list[bytes] = []
        self._buffer = FrameBuffer(max_frame_bytes) if stream else None

    @property
    def closed(self) -> bool:
        """True once the session is CLOSED."""
        return self.state is State.CLOSED

    # -- input ------------------------------------------------------------------------------------

    @property
    def frame_limit(self) -> int:
        """Largest frame accepted now (bytes): ``handshake_max_bytes`` until the handshake is done
        (a peer that has not authenticated cannot make us buffer more), then ``max_frame_bytes``."""
        return self.handshake_max_bytes if self.state is State.HANDSHAKE else self.max_frame_bytes

    def receive_frame(self, data: bytes) -> list[Event]:
        """Process one frame body (one websocket message). Never raises on bad input: returns
        ``[ProtocolViolation]`` instead. Returns ``[]`` once the session is closed."""
        if self.state is State.CLOSED:
            return []
        try:
            check_frame_size(len(data), self.frame_limit)
            msg = decode(data)
        except ProtocolError as exc:
            return [self._violation(exc.code, exc.message)]
        return self._handle(msg)

    def receive_data(self, data: bytes) -> list[Event]:
        """Process a chunk of a length-prefixed byte stream (sessions created with ``stream=True``)."""
        if self._buffer is None:
            raise RuntimeError("receive_data needs a session created with stream=True; use receive_frame")
        if self.state is State.CLOSED:
            return []
        events: list[Event] = []
        try:
            self._buffer.append(data)
            while self.state is not State.CLOSED:
                self._buffer.max_frame_bytes = self.frame_limit  # the limit of the state this frame meets
                frame = self._buffer.pop()
                if frame is None:
                    break
                events += self.receive_frame(frame)
        except ProtocolError as exc:
            events.append(self._violation(exc.code, exc.message))
        return events

    def _handle(self, msg: Message) -> list[Event]:
        if isinstance(msg, Error) and msg.request_id is None:
            self.state, self.close_error = State.CLOSED, msg
            return [PeerError(msg)]
        if self.state is State.HANDSHAKE:
            return self._handshake(msg)
        if isinstance(msg, (Hello, Welcome)):
            return [self._violation(ErrorCode.BAD_REQUEST, f"unexpected {_tag(msg)!r} after the handshake")]
        if isinstance(msg, Ping):
            self._out.append(self._frame(Pong(nonce=msg.nonce, t_ms=msg.t_ms)))
            return []
        return [MessageReceived(msg)]

    def _handshake(self, msg: Message) -> list[Event]:
        raise NotImplementedError

    # -- output -----------------------------------------------------------------------------------

    def send(self, msg: Message) -> bytes:
        """Return the wire bytes for ``msg`` (a frame body, length-prefixed if ``stream``).

        Raises ``ProtocolError``: HANDSHAKE_REQUIRED before the handshake, CONNECTION_CLOSED once
        closed, BAD_REQUEST for Hello/Welcome (the core sends those), FRAME_TOO_LARGE if the
        encoded message exceeds ``max_frame_bytes`` (the session stays usable). Sending a
        connection-level ``Error`` (request_id None) closes the session.
        """
        if self.state is State.CLOSED:
            raise ProtocolError(ErrorCode.CONNECTION_CLOSED, f"cannot send {_tag(msg)!r}: the session is closed")
        if isinstance(msg, (Hello, Welcome)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{_tag(msg)!r} is sent by the session itself")
        if self.state is State.HANDSHAKE and not isinstance(msg, Error):
            raise ProtocolError(ErrorCode.HANDSHAKE_REQUIRED, f"cannot send {_tag(msg)!r} before the handshake")
        frame = self._frame(msg)
        if isinstance(msg, Error) and msg.request_id is None:
            self.state, self.close_error = State.CLOSED, msg
        return frame

    def fail(self, code: ErrorCode, message: str) -> bytes:
        """Close the session with a connection-level Error (e.g. OVERLOADED) and return its frame.

        Raises ``ProtocolError(CONNECTION_CLOSED)`` if already closed."""
        return self.send(Error(code=ErrorCode(code).value, message=message))

    def close(self) -> None:
        """Mark the session CLOSED without an Error (the transport is closing normally)."""
        self.state = State.CLOSED

    def data_to_send(self) -> list[bytes]:
        """Pop the frames the core produced itself (Hello via ``start``, Welcome, Error, Pong), in order."""
        out, self._out = self._out, []
        return out

    def _frame(self, msg: Message) -> bytes:
        body = encode(msg)
        check_frame_size(len(body), self.max_frame_bytes)
        return pack_frame(body) if self.stream else body

    def _violation(self, code: ErrorCode, message: str) -> ProtocolViolation:
        error = Error(code=code.value, message=message)
        body = encode(error)  # not size-checked: the peer must learn why, whatever the limit
        self._out.append(pack_frame(body) if self.stream else body)
        self.state, self.close_error = State.CLOSED, error
        return ProtocolViolation(error)


class ServerSession(_Session):
    """Server end. The first frame must be a Hello; it is checked in this order:

    protocol version (VERSION_MISMATCH), auth token if ``auth_token`` is set (UNAUTHORIZED; checked
    before the fingerprint so that unauthenticated clients learn nothing about the model), model
    fingerprint (FINGERPRINT_MISMATCH). Success queues a Welcome and emits ``HandshakeDone``.

    ``max_frame_bytes``: largest accepted frame in bytes after the handshake; ``handshake_max_bytes``:
    largest accepted frame before it (default 4 KiB: a Hello is ~200 bytes); ``stream``:
    length-prefixed byte-stream framing instead of one frame per call; ``server``: name sent in the
    Welcome; ``session_id``: defaults to 16 random hex digits; ``device_model_url``: sent in the
    Welcome; when set, a Hello with an empty fingerprint is welcomed too (a device asking where the
    model is; the server then closes the session).
    """

    def __init__(
        self,
        expected_fingerprint: str,
        auth_token: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        *,
        stream: bool = False,
        server: str = "",
        session_id: str | None = None,
        handshake_max_bytes: int = HANDSHAKE_MAX_BYTES,
        device_model_url: str = "",
    ) -> None:
        super().__init__(max_frame_bytes, stream, handshake_max_bytes)
        self.expected_fingerprint = expected_fingerprint
        self.auth_token = auth_token
        self.server = server
        self.device_model_url = device_model_url
        self.session_id = session_id if session_id is not None else secrets.token_hex(8)

    def _handshake(self, msg: Message) -> list[Event]:
        if not isinstance(msg, Hello):
            return [self._violation(ErrorCode.HANDSHAKE_REQUIRED,
                                    f"expected 'hello' as the first frame, got {_tag(msg)!r}")]
        if msg.protocol_version != PROTOCOL_VERSION:
            return [self._violation(ErrorCode.VERSION_MISMATCH,
                                    f"protocol version mismatch: server speaks {PROTOCOL_VERSION}, "
                                    f"client sent {msg.protocol_version}")]
        if self.auth_token is not None:
            if msg.token is None:
                return [self._violation(ErrorCode.UNAUTHORIZED, "this server requires an auth token; the client sent none")]
            if not hmac.compare_digest(msg.token.encode(), self.auth_token.encode()):
                return [self._violation(ErrorCode.UNAUTHORIZED, "auth token rejected")]
        discovery = not msg.model_fingerprint and bool(self.device_model_url)  # "where is the model?"
        if msg.model_fingerprint != self.expected_fingerprint and not discovery:
            return [self._violation(ErrorCode.FINGERPRINT_MISMATCH,
                                    f"model fingerprint mismatch: server has {_short(self.expected_fingerprint)}, "
                                    f"client sent {_short(msg.model_fingerprint)}")]
        welcome = Welcome(protocol_version=PROTOCOL_VERSION, model_fingerprint=self.expected_fingerprint,
                          server=self.server, session_id=self.session_id, device_model_url=self.device_model_url)
        self._out.append(self._frame(welcome))
        self.hello, self.welcome, self.state = msg, welcome, State.OPEN
        return [HandshakeDone(msg, welcome)]


class ClientSession(_Session):
    """Client end. Call ``start()`` and send the Hello frame it returns; the server's Welcome is
    checked for protocol version (VERSION_MISMATCH) and fingerprint (FINGERPRINT_MISMATCH) and
    emits ``HandshakeDone``; a server Error emits ``PeerError``.

    ``fingerprint``: hash of the model file this client runs; ``token``: auth token or None;
    ``client``: free-form name sent in the Hello; other arguments as for ``ServerSession``.
    """

    def __init__(
        self,
        fingerprint: str,
        token: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        *,
        stream: bool = False,
        client: str = "",
        handshake_max_bytes: int = HANDSHAKE_MAX_BYTES,
    ) -> None:
        super().__init__(max_frame_bytes, stream, handshake_max_bytes)
        self.fingerprint = fingerprint
        self.token = token
        self.client = client

    def start(self) -> bytes:
        """Return the Hello frame to send first. Raises ``ProtocolError(BAD_REQUEST)`` if called twice."""
        if self.hello is not None or self.state is not State.HANDSHAKE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "handshake already started")
        self.hello = Hello(protocol_version=PROTOCOL_VERSION, model_fingerprint=self.fingerprint,
                           token=self.token, client=self.client)
        return self._frame(self.hello)

    def _handshake(self, msg: Message) -> list[Event]:
        if self.hello is None or not isinstance(msg, Welcome):
            return [self._violation(ErrorCode.HANDSHAKE_REQUIRED,
                                    f"expected 'welcome' in answer to 'hello', got {_tag(msg)!r}")]
        if msg.protocol_version != PROTOCOL_VERSION:
            return [self._violation(ErrorCode.VERSION_MISMATCH,
                                    f"protocol version mismatch: client speaks {PROTOCOL_VERSION}, "
                                    f"server sent {msg.protocol_version}")]
        if self.fingerprint and msg.model_fingerprint != self.fingerprint:  # "": asked where the model is
            return [self._violation(ErrorCode.FINGERPRINT_MISMATCH,
                                    f"model fingerprint mismatch: client has {_short(self.fingerprint)}, "
                                    f"server sent {_short(msg.model_fingerprint)}")]
        self.welcome, self.state = msg, State.OPEN
        return [HandshakeDone(self.hello, msg)]
