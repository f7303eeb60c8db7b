"""Error codes and exception classes shared by every relayinfer component.

Kept flat on purpose: one ``ErrorCode`` enum (the values travel on the wire in ``Error.code``) and a
tree of exception classes rooted at :class:`RelayInferError`. Other components append their own
exception classes here (subclassing ``RelayInferError``) so that one ``except RelayInferError``
catches everything the SDK raises on purpose.
"""

from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "RelayInferError",
    "ProtocolError",
    "RemoteError",
    "ChannelClosed",
]


class ErrorCode(str, enum.Enum):
    """Machine-readable error codes; the string value is what travels in ``Error.code``."""

    BAD_FRAME = "bad_frame"  # frame is not a valid message (bad msgpack, wrong field types, bad tensor)
    FRAME_TOO_LARGE = "frame_too_large"  # frame exceeds the connection's max frame size
    UNKNOWN_MESSAGE = "unknown_message"  # valid msgpack but the "type" tag is not known
    VERSION_MISMATCH = "version_mismatch"  # peers speak different PROTOCOL_VERSIONs
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # peers run different model files
    UNAUTHORIZED = "unauthorized"  # auth token missing or rejected
    HANDSHAKE_REQUIRED = "handshake_required"  # a message arrived before the Hello/Welcome exchange
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt does not fit the model's context
    BAD_REQUEST = "bad_request"  # well-formed message with invalid content or at the wrong time
    OVERLOADED = "overloaded"  # server refuses new work for now; retry later or run locally
    UNKNOWN_REQUEST = "unknown_request"  # request_id not known (finished, cancelled or never sent)
    INTERNAL = "internal"  # bug or unexpected failure on the peer
    CONNECTION_CLOSED = "connection_closed"  # local only: the transport closed under us


class RelayInferError(Exception):
    """Base class of every error relayinfer raises on purpose.

    ``code`` is an :class:`ErrorCode`; ``message`` a human-readable sentence naming what was wrong.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = ErrorCode(code)

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"


class ProtocolError(RelayInferError):
    """Bad input detected locally: malformed frame, failed handshake, misuse of a session.

    Raised by ``messages.decode``, ``framing.FrameBuffer`` and the session/channel objects.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message, code)


class RemoteError(RelayInferError):
    """The peer sent an ``Error`` frame (or closed the connection with a meaning we can map).

    ``code`` is the peer's code as an :class:`ErrorCode` (``INTERNAL`` if the peer sent a code this
    version does not know; the raw string stays in ``raw_code``). ``request_id`` is the request the
    error refers to, or ``None`` for a connection-level error. ``retry_after_ms``: the peer's
    back-off hint with OVERLOADED (ms), else None.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None,
                 retry_after_ms: float | None = None) -> None:
        try:
            known = ErrorCode(code)
        except ValueError:
            known = ErrorCode.INTERNAL
        super().__init__(message, known)
        self.raw_code = str(code.value if isinstance(code, ErrorCode) else code)
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms


class ChannelClosed(RelayInferError):
    """The transport closed. ``close_code``/``reason`` come from the websocket close frame if any.

    ``clean`` is True for a normal closure (1000/1001), False when the connection was lost.
    """

    code = ErrorCode.CONNECTION_CLOSED

    def __init__(self, message: str, close_code: int | None = None, reason: str = "", clean: bool = False) -> None:
        super().__init__(message)
        self.close_code = close_code
        self.reason = reason
        self.clean = clean
