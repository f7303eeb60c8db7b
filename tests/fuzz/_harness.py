"""Shared checks for the atheris harnesses: decode properties, input layout, a reference session model.

Every harness turns one fuzz input (bytes) into calls on the protocol layer and checks properties,
not just "no crash". A property failure raises ``AssertionError`` (libFuzzer reports it as a crash and
writes the input as a reproducer). Nothing here imports atheris, so pytest can use it directly.

Input layout shared by the session harnesses: ``data[0]`` is a mode byte, ``data[1:]`` a byte stream
of 4-byte big-endian length-prefixed frames (the stream framing of ``protocol/framing.py``). In
stream mode the stream is fed to ``receive_data`` in chunks cut at offsets derived from a CRC of the
input; in frame mode it is split leniently into frame bodies (a truncated last frame keeps what is
there) that go to ``receive_frame`` one by one. The same seed therefore exercises both modes.
"""

from __future__ import annotations

import inspect
import math
import random
import struct
import time
import zlib
from contextlib import contextmanager
from typing import Iterator

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.framing import FrameBuffer
from relayinfer.protocol.messages import (
    MESSAGE_TYPES, PROTOCOL_VERSION, Error, Hello, Ping, Pong, Tensor, Welcome, decode, encode,
)
from relayinfer.protocol.session import (
    ClientSession, HandshakeDone, MessageReceived, PeerError, ProtocolViolation, ServerSession, State,
)

FP = "sha256:fuzz0123456789abcdef"
"""Model fingerprint both fuzzed ends expect."""
TOKEN = "fuzz-token"
"""Auth token the server requires in auth mode."""
LIMIT = 1024
"""``max_frame_bytes`` of the fuzzed sessions (bytes): small, so FRAME_TOO_LARGE is reachable with
inputs of libFuzzer's default ``-max_len`` (4096)."""
MAX_SECONDS = 1.0
"""Per-input wall-time bound (seconds) checked inside the harness."""
ERROR_SLACK = 1024
"""An error message may be at most this many characters longer than the input that caused it."""

DECODE_CODES = {ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_MESSAGE}
_U32 = struct.Struct(">I")


@contextmanager
def time_bound(what: str, data: bytes) -> Iterator[None]:
    """Fail with ``AssertionError`` if the body takes longer than ``MAX_SECONDS`` (wall clock)."""
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    assert elapsed < MAX_SECONDS, f"{what}: {len(data)}-byte input took {elapsed:.3f} s (bound {MAX_SECONDS} s)"


# -- input layout --------------------------------------------------------------------------------

def split_frames(stream: bytes) -> list[bytes]:
    """Split ``stream`` leniently into frame bodies: each u32 BE length takes up to that many bytes;
    a tail shorter than a header becomes one last (short) frame."""
    frames, pos = [], 0
    while pos < len(stream):
        if len(stream) - pos < 4:
            frames.append(stream[pos:])
            break
        (size,) = _U32.unpack_from(stream, pos)
        frames.append(stream[pos + 4:pos + 4 + size])
        pos += 4 + size
    return frames


def chunk_cuts(data: bytes, length: int) -> list[int]:
    """Deterministic cut offsets ``[0, ..., length]`` for feeding ``length`` stream bytes in chunks.

    Derived from a CRC of the whole input so a reproducer replays the same chunking; chunk sizes
    range from 1 byte to the whole stream."""
    rng = random.Random(zlib.crc32(data))
    style = rng.randrange(4)
    if style == 0 or length == 0:
        return [0, length]  # one chunk
    if style == 1:
        return list(range(length)) + [length]  # byte by byte
    cuts = {0, length}
    for _ in range(rng.randrange(1, 9) if style == 2 else min(length, 64)):
        cuts.add(rng.randrange(0, length + 1))
    return sorted(cuts)


# -- decoding --------------------------------------------------------------------------------------

def _tensors(msg) -> list[Tensor]:
    return [v for v in (getattr(msg, f) for f in msg.__struct_fields__) if isinstance(v, Tensor)]


def _has_nan(msg) -> bool:
    return any(isinstance(v, float) and math.isnan(v) for v in (getattr(msg, f) for f in msg.__struct_fields__))


def check_decode(body: bytes):
    """Decode ``body`` and check the decoder's contract; return the message or None if refused.

    Properties: only ``ProtocolError`` with BAD_FRAME / UNKNOWN_MESSAGE escapes, its message is not
    much longer than the input; a decoded message is one of the 18 types, re-encodes to bytes that
    decode to an equal message (byte-identical on a second round; field-equal unless a float is
    NaN), and every Tensor in it converts with ``to_numpy`` to its declared shape and byte size.
    """
    try:
        msg = decode(body)
    except ProtocolError as exc:
        assert exc.code in DECODE_CODES, f"decode raised {exc.code}: {exc}"
        assert len(exc.message) <= len(body) + ERROR_SLACK, f"{len(exc.message)}-char error for {len(body)} bytes"
        return None
    assert type(msg) in MESSAGE_TYPES.values(), type(msg)
    wire = encode(msg)
    again = decode(wire)
    assert type(again) is type(msg)
    assert encode(again) == wire, "re-encoding is not stable"
    if not _has_nan(msg):
        assert again == msg, f"round trip changed the message: {msg!r} -> {again!r}"
    for t in _tensors(msg):
        arr = t.to_numpy()
        assert arr.shape == tuple(t.shape) and arr.nbytes == len(t.data), (t.dtype, t.shape, len(t.data))
    return msg


def reference_split(stream: bytes, limit: int) -> tuple[list[tuple[bytes, int]], int | None]:
    """Reference parse of a length-prefixed stream: ``([(body, end_offset)], oversize_header_end)``.

    ``oversize_header_end`` is the offset just past the first header declaring more than ``limit``
    bytes (None if none); parsing stops there. An incomplete last frame is not returned."""
    frames, pos = [], 0
    while len(stream) - pos >= 4:
        (size,) = _U32.unpack_from(stream, pos)
        if size > limit:
            return frames, pos + 4
        if len(stream) - pos - 4 < size:
            break
        frames.append((stream[pos + 4:pos + 4 + size], pos + 4 + size))
        pos += 4 + size
    return frames, None


def check_frame_buffer(stream: bytes, limit: int, cuts: list[int]) -> list[bytes]:
    """Feed ``stream`` to a ``FrameBuffer(limit)`` in the chunks given by ``cuts`` and compare with
    :func:`reference_split`: same bodies in order, FRAME_TOO_LARGE raised in exactly the chunk that
    completes the oversized header (and on every later feed), the right ``pending`` count. Returns
    the bodies delivered."""
    want, bad_at = reference_split(stream, limit)
    buf, got = FrameBuffer(max_frame_bytes=limit), []
    for a, b in zip(cuts, cuts[1:]):
        try:
            out = buf.feed(stream[a:b])
        except ProtocolError as exc:
            assert exc.code is ErrorCode.FRAME_TOO_LARGE, exc
            assert bad_at is not None and a < bad_at <= b, f"FRAME_TOO_LARGE in chunk [{a}, {b}), expected at {bad_at}"
            # frames completed in this same chunk are dropped with the error (FrameBuffer's current contract)
            assert got == [body for body, end in want if end <= a]
            try:
                buf.feed(b"\x00\x00\x00\x00")
            except ProtocolError as again:
                assert again.code is ErrorCode.FRAME_TOO_LARGE
            else:
                raise AssertionError("a failed FrameBuffer accepted more data")
            return got
        assert bad_at is None or b < bad_at, f"header ending at {bad_at} not refused in chunk [{a}, {b})"
        got += out
    assert bad_at is None, "oversized header never refused"
    assert got == [body for body, _ in want]
    rest = len(stream) - (want[-1][1] if want else 0)
    expected_pending = rest - 4 if rest >= 4 else rest  # a header already read is no longer buffered
    assert buf.pending == expected_pending, (buf.pending, len(stream), rest)
    return got


# -- reference model of a session -------------------------------------------------------------------

HS_LIMIT = 256
"""``handshake_max_bytes`` of the fuzzed sessions (bytes), where the session has that limit."""
_HAS_HS_LIMIT = "handshake_max_bytes" in inspect.signature(ServerSession).parameters
_POPS_ONE_AT_A_TIME = hasattr(FrameBuffer, "pop")
"""True where ``receive_data`` takes frames one at a time under the limit of the current state (so
frames before an oversized header are delivered); False for the older ``feed``-based session, which
drops the frames completed in the same chunk as an oversized header."""


class SessionModel:
    """What a ServerSession / ClientSession should do with each frame, written out plainly.

    ``step(body)`` returns ``(event, outputs)``: the expected event as a tuple — ``("done",)``,
    ``("msg", wire)``, ``("violation", code)``, ``("peer", wire)`` — or None (a Ping: no event) or
    ``"ignored"`` (the session is closed); and the expected core output (wire bytes of Welcome or
    Pong, or ``("error", code)``).
    """

    def __init__(self, role: str, session, *, auth_token: str | None = None) -> None:
        self.role, self.session, self.auth_token = role, session, auth_token
        self.state = session.state

    def limit(self) -> int:
        """Frame limit (bytes) in the model's current state."""
        if self.state is State.HANDSHAKE and _HAS_HS_LIMIT:
            return self.session.handshake_max_bytes
        return self.session.max_frame_bytes

    def _violate(self, code: ErrorCode):
        self.state = State.CLOSED
        return ("violation", code.value), [("error", code.value)]

    def oversized(self):
        """The step for a frame (or stream header) above the current limit."""
        if self.state is State.CLOSED:
            return "ignored", []
        return self._violate(ErrorCode.FRAME_TOO_LARGE)

    def step(self, body: bytes):
        if self.state is State.CLOSED:
            return "ignored", []
        if len(body) > self.limit():
            return self._violate(ErrorCode.FRAME_TOO_LARGE)
        try:
            msg = decode(body)
        except ProtocolError as exc:
            return self._violate(exc.code)
        if isinstance(msg, Error) and msg.request_id is None:
            self.state = State.CLOSED
            return ("peer", encode(msg)), []
        if self.state is State.HANDSHAKE:
            return self._handshake(msg)
        if isinstance(msg, (Hello, Welcome)):
            return self._violate(ErrorCode.BAD_REQUEST)
        if isinstance(msg, Ping):
            return None, [encode(Pong(nonce=msg.nonce, t_ms=msg.t_ms))]
        return ("msg", encode(msg)), []

    def _handshake(self, msg):
        out = []
        if self.role == "server":
            if not isinstance(msg, Hello):
                return self._violate(ErrorCode.HANDSHAKE_REQUIRED)
            if msg.protocol_version != PROTOCOL_VERSION:
                return self._violate(ErrorCode.VERSION_MISMATCH)
            if self.auth_token is not None and msg.token != self.auth_token:
                return self._violate(ErrorCode.UNAUTHORIZED)
            if msg.model_fingerprint != FP:
                return self._violate(ErrorCode.FINGERPRINT_MISMATCH)
            s = self.session
            out.append(encode(Welcome(protocol_version=PROTOCOL_VERSION, model_fingerprint=FP,
                                      server=s.server, session_id=s.session_id)))
        else:
            if not isinstance(msg, Welcome):
                return self._violate(ErrorCode.HANDSHAKE_REQUIRED)
            if msg.protocol_version != PROTOCOL_VERSION:
                return self._violate(ErrorCode.VERSION_MISMATCH)
            if msg.model_fingerprint != FP:
                return self._violate(ErrorCode.FINGERPRINT_MISMATCH)
        self.state = State.OPEN
        return ("done",), out


def _event_tuple(event):
    if isinstance(event, HandshakeDone):
        return ("done",)
    if isinstance(event, MessageReceived):
        return ("msg", encode(event.message))
    if isinstance(event, ProtocolViolation):
        return ("violation", event.error.code)
    if isinstance(event, PeerError):
        return ("peer", encode(event.error))
    raise AssertionError(f"unknown event {event!r}")


def check_call(session, events: list, steps: list, state: State) -> None:
    """Compare one ``receive_*`` call with the model: ``events`` against the steps' events, the
    session state against ``state``, ``data_to_send()`` against the steps' outputs; check that the
    closing event is last and matches ``close_error``, and that a ProtocolViolation leaves exactly
    one Error frame, last, decoding to the violation's error."""
    got = [_event_tuple(e) for e in events]
    want = [e for e, _ in steps if e not in (None, "ignored")]
    assert got == want, f"events {got!r} != model {want!r}"
    assert session.state is state, f"state {session.state} != model {state}"
    for e in events:
        if isinstance(e, (ProtocolViolation, PeerError)):
            assert e is events[-1], "an event followed the one that closed the session"
            assert session.close_error == e.error
    frames = session.data_to_send()
    assert session.data_to_send() == [], "data_to_send did not drain"
    bodies = []
    for f in frames:
        if session.stream:
            assert len(f) >= 4 and _U32.unpack_from(f)[0] == len(f) - 4, "bad length prefix on an output frame"
            f = f[4:]
        bodies.append(f)
    decoded = [decode(b) for b in bodies]
    violations = [e for e in events if isinstance(e, ProtocolViolation)]
    errors = [m for m in decoded if isinstance(m, Error)]
    assert len(errors) == len(violations) <= 1, f"{len(errors)} Error frames for {len(violations)} violations"
    if violations:
        assert errors[0] == violations[0].error and decoded[-1] is errors[0], "the Error frame is not the violation's"
        assert errors[0].request_id is None and ErrorCode(errors[0].code)
    got_out = [("error", m.code) if isinstance(m, Error) else encode(m) for m in decoded]
    want_out = [o for _, outs in steps for o in outs]
    assert got_out == want_out, f"core output {got_out!r} != model {want_out!r}"


def run_frames(session, model: SessionModel, frames: list[bytes]) -> None:
    """Frame mode: ``receive_frame`` each body; compare each call with the model."""
    for body in frames:
        step = model.step(body)
        events = session.receive_frame(body)  # must not raise
        check_call(session, events, [step], model.state)


def reference_stream_steps(model: SessionModel, stream: bytes, cuts: list[int]) -> list[tuple[int, tuple, State]]:
    """Model steps of a whole stream as ``[(offset, step, state after it)]``: the offset is where the
    step happens (end of the frame, or end of an oversized header). Runs the model to the end."""
    if not _POPS_ONE_AT_A_TIME:  # older session: one fixed limit, a whole chunk parsed before any frame is handled
        frames, bad_at = reference_split(stream, model.session.max_frame_bytes)
        if bad_at is not None:
            k = max(c for c in cuts if c < bad_at)  # start of the chunk that carries the bad header
            frames = [(body, end) for body, end in frames if end <= k]
        steps = [(end, model.step(body), model.state) for body, end in frames]
        return steps + ([(bad_at, model.oversized(), model.state)] if bad_at is not None else [])
    steps, pos = [], 0
    while model.state is not State.CLOSED and len(stream) - pos >= 4:
        (size,) = _U32.unpack_from(stream, pos)
        if size > model.limit():  # the limit of the state the header is read in
            steps.append((pos + 4, model.oversized(), model.state))
            break
        if len(stream) - pos - 4 < size:
            break
        steps.append((pos + 4 + size, model.step(stream[pos + 4:pos + 4 + size]), model.state))
        pos += 4 + size
    return steps


def run_stream(session, model: SessionModel, stream: bytes, cuts: list[int]) -> None:
    """Stream mode: ``receive_data`` each chunk; compare each call with the model steps whose
    offsets fall in that chunk."""
    state = model.state
    steps = reference_stream_steps(model, stream, cuts)
    for a, b in zip(cuts, cuts[1:]):
        events = session.receive_data(stream[a:b])  # must not raise
        in_chunk = [(step, after) for off, step, after in steps if a < off <= b]
        if in_chunk:
            state = in_chunk[-1][1]
        check_call(session, events, [step for step, _ in in_chunk], state)


def hello_body(token: str | None = None) -> bytes:
    """A valid Hello frame body for the fuzzed server."""
    return encode(Hello(protocol_version=PROTOCOL_VERSION, model_fingerprint=FP, token=token, client="fuzz"))


def _hs_kw() -> dict:
    return {"handshake_max_bytes": HS_LIMIT} if _HAS_HS_LIMIT else {}


def new_server(stream: bool, auth: bool) -> ServerSession:
    """A ServerSession as the harness fuzzes it (fixed session id so outputs are reproducible)."""
    return ServerSession(FP, auth_token=TOKEN if auth else None, max_frame_bytes=LIMIT, stream=stream,
                         server="fuzz-server", session_id="fuzz-session", **_hs_kw())


def new_client(stream: bool) -> ClientSession:
    """A ClientSession as the harness fuzzes it."""
    return ClientSession(FP, token=TOKEN, max_frame_bytes=LIMIT, stream=stream, client="fuzz", **_hs_kw())
