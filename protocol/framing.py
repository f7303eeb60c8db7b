"""Frames: one frame = one MessagePack-encoded message.

Over websockets one binary websocket message is one frame, nothing more to do. Over byte streams
(TCP, pipes) each frame is preceded by its length as a 4-byte big-endian unsigned integer:

    +----------------+---------------------------+
    | length (u32 BE)| body (length bytes)       |
    +----------------+---------------------------+

:class:`FrameBuffer` reassembles frames from arbitrary chunks and refuses an oversized frame as soon
as its header arrives, before buffering any of its body.
"""

from __future__ import annotations

import struct

from .errors import ErrorCode, ProtocolError
from .messages import MAX_FRAME_BYTES

__all__ = ["HEADER_BYTES", "pack_frame", "FrameBuffer", "check_frame_size"]

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
"""Length prefix size in bytes (4)."""


def check_frame_size(size: int, max_frame_bytes: int) -> None:
    """Raise ``ProtocolError(FRAME_TOO_LARGE)`` if a frame of ``size`` bytes exceeds ``max_frame_bytes``."""
    if size > max_frame_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                            f"frame of {size} bytes exceeds the limit of {max_frame_bytes} bytes")


def pack_frame(body: bytes) -> bytes:
    """Length-prefix one frame body for a byte stream. Raises ``ProtocolError(FRAME_TOO_LARGE)`` above 4 GiB - 1."""
    check_frame_size(len(body), 0xFFFFFFFF)
    return _HEADER.pack(len(body)) + body


class FrameBuffer:
    """Reassembles length-prefixed frames from a byte stream.

    ``feed(chunk)`` returns the frame bodies completed by that chunk (possibly none, possibly
    several). A declared length above ``max_frame_bytes`` raises ``ProtocolError(FRAME_TOO_LARGE)``
    immediately; the buffer is then unusable (further ``feed`` calls raise the same error), since
    the stream can no longer be resynchronised.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame in progress, once its header is read
        self._error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data`` (any size, any split) and return the complete frame bodies, in order."""
        self.append(data)
        frames: list[bytes] = []
        while (frame := self.pop()) is not None:
            frames.append(frame)
        return frames

    def append(self, data: bytes) -> None:
        """Buffer ``data`` without parsing it (see ``pop``)."""
        if self._error is not None:
            raise self._error
        self._buf += data

    def pop(self) -> bytes | None:
        """The next complete frame body, or None if none is complete yet. The size limit in force is
        ``max_frame_bytes`` at the moment the frame's header is read (a session lowers it during
        the handshake). Raises ``ProtocolError(FRAME_TOO_LARGE)`` on an oversized declared length."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        if self._need is None:
            if len(buf) < HEADER_BYTES:
                return None
            (size,) = _HEADER.unpack_from(buf, 0)
            try:
                check_frame_size(size, self.max_frame_bytes)
            except ProtocolError as exc:
                self._error = exc
                buf.clear()
                raise
            del buf[:HEADER_BYTES]
            self._need = size
        if len(buf) < self._need:
            return None
        frame = bytes(buf[:self._need])
        del buf[:self._need]
        self._need = None
        return frame
