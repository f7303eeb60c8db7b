"""A hypothesis stateful model of a ServerSession + ClientSession pair joined by two in-memory wires.

Rules send real traffic (handshake, client and server messages, pings, garbage frames, oversized
frames, connection-level errors, local close) into per-direction queues; delivery rules feed a queue
to the receiving session (in stream mode, the bytes cut into chunks hypothesis picks) and compare
what comes out with a small model: the state of each end (HANDSHAKE / OPEN / CLOSED), the messages
each end received in order, the frames each core queued (Welcome, Pong, Error), and that a closed end
delivers nothing. tests/test_protocol.py covers single exchanges; this covers their interleavings.
"""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.framing import FrameBuffer, pack_frame
from relayinfer.protocol.messages import (
    Cancel, Done, Error, ExtendBudget, Generate, Ping, Pong, RefinedPrompt, Scores, Stop, Tensor, TileBatch,
    Token, Welcome, decode,
)
from relayinfer.protocol.session import (
    ClientSession, HandshakeDone, MessageReceived, PeerError, ProtocolViolation, ServerSession, State,
)

FP = "sha256:stateful"
LIMIT = 512  # max_frame_bytes of both ends (bytes)
# Older sessions parse a whole chunk before handling any frame and lose the frames completed in the same
# chunk as an oversized header; sessions whose FrameBuffer pops one frame at a time deliver them.
POPS_ONE_AT_A_TIME = hasattr(FrameBuffer, "pop")

RID = st.text(alphabet="abcdefgh0123456789", min_size=1, max_size=6)
SMALL = st.integers(0, 2**31)
MS = st.floats(0, 1e6, allow_nan=False)
TENSOR = st.builds(lambda n: Tensor.from_numpy(np.arange(n, dtype=np.float32)), st.integers(0, 8))
CLIENT_MSGS = st.one_of(
    st.builds(Generate, request_id=RID, prompt_ids=st.lists(SMALL, max_size=8), max_new_tokens=SMALL),
    st.builds(ExtendBudget, request_id=RID, cloud_budget=SMALL),
    st.builds(Stop, request_id=RID, handoff_index=SMALL),
    st.builds(Cancel, request_id=RID),
    st.builds(Error, code=st.sampled_from(["internal", "bad_request"]), message=st.text(max_size=20), request_id=RID),
    st.builds(TileBatch, request_id=RID, slide_id=RID, coords=st.lists(st.lists(SMALL, min_size=2, max_size=2),
                                                                       max_size=3),
              tiles=st.builds(lambda n: Tensor.from_numpy(np.zeros((n, 2, 2, 1), np.uint8)), st.integers(0, 3))),
)
SERVER_MSGS = st.one_of(
    st.builds(Token, request_id=RID, token_id=SMALL, index=SMALL, t_cloud_ms=MS),
    st.builds(RefinedPrompt, request_id=RID, kept_indices=st.lists(SMALL, max_size=8)),
    st.builds(Done, request_id=RID, reason=st.sampled_from(["eos", "length", "stop"]), cloud_tokens=SMALL,
              prefill_ms=MS),
    st.builds(Error, code=st.just("unknown_request"), message=st.text(max_size=20), request_id=RID),
    st.builds(Scores, request_id=RID, scores=TENSOR, prefix_source=st.sampled_from(["hbm", "none"])),
)
# Frames that can never decode, with the code decode refuses them with: 0xc1 is not a MessagePack
# byte; a map with an unknown "type" tag; an array instead of a map.
GARBAGE = st.one_of(
    st.binary(max_size=30).map(lambda b: (b"\xc1" + b, ErrorCode.BAD_FRAME)),
    st.text(alphabet="xyz_", min_size=1, max_size=10).map(
        lambda t: (msgspec.msgpack.encode({"type": "zz" + t}), ErrorCode.UNKNOWN_MESSAGE)),
    st.lists(st.integers(0, 9), max_size=5).map(lambda v: (msgspec.msgpack.encode(v), ErrorCode.BAD_FRAME)),
)
CONN_CODES = st.sampled_from([ErrorCode.OVERLOADED, ErrorCode.INTERNAL, ErrorCode.BAD_REQUEST])


class SessionPair(RuleBasedStateMachine):
    """Model: ``state[side]``, ``expect_rx[side]`` (messages the side must have received, in order),
    ``wire[side]`` (frames in flight *to* that side, each with a tag saying what it is)."""

    @initialize(stream=st.booleans(), handshake_first=st.booleans(), calm_steps=st.integers(0, 30))
    def setup(self, stream, handshake_first, calm_steps):
        """``handshake_first``: run the Hello/Welcome exchange before any rule; ``calm_steps``: rules
        run before garbage, oversized frames, connection errors and closes are enabled (otherwise
        nearly every run dies in its first steps and the OPEN state is rarely exercised)."""
        self.stream = stream
        self.calm_steps = calm_steps
        self.steps = 0
        self.sessions = {"server": ServerSession(FP, max_frame_bytes=LIMIT, stream=stream, session_id="sid"),
                         "client": ClientSession(FP, max_frame_bytes=LIMIT, stream=stream)}
        self.state = {"server": State.HANDSHAKE, "client": State.HANDSHAKE}
        self.wire = {"server": deque(), "client": deque()}  # frames in flight to that side: (bytes, tag)
        self.expect_rx = {"server": [], "client": []}
        self.rx = {"server": [], "client": []}
        self.started = False
        self.delivered_to_closed = 0
        if handshake_first:
            self.client_hello()
            self.deliver_all("server")
            self.deliver_all("client")
            assert self.state == {"server": State.OPEN, "client": State.OPEN}

    @staticmethod
    def other(side: str) -> str:
        return "client" if side == "server" else "server"

    def _wrap(self, body: bytes) -> bytes:
        return pack_frame(body) if self.stream else body

    # -- sending ------------------------------------------------------------------------------------

    def chaos(self) -> bool:
        """True once destructive rules are enabled (counts the call as a step)."""
        return self.steps >= self.calm_steps

    @precondition(lambda self: not self.started)
    @rule()
    def client_hello(self):
        self.started = True
        if self.state["client"] is State.HANDSHAKE:
            self.wire["server"].append((self.sessions["client"].start(), ("hello",)))
            return
        try:  # closed before it said hello
            self.sessions["client"].start()
        except ProtocolError as exc:
            assert exc.code is ErrorCode.BAD_REQUEST
        else:
            raise AssertionError("a closed client started a handshake")

    def _send(self, side: str, msg) -> None:
        session = self.sessions[side]
        # send() lets any Error out before the handshake (meant for refusing a peer; a per-request Error
        # then reaches a peer still in HANDSHAKE, which refuses it with HANDSHAKE_REQUIRED)
        if self.state[side] is State.OPEN or (self.state[side] is State.HANDSHAKE and isinstance(msg, Error)):
            self.wire[self.other(side)].append((session.send(msg), ("msg", msg)))
            return
        try:
            session.send(msg)
        except ProtocolError as exc:
            want = ErrorCode.CONNECTION_CLOSED if self.state[side] is State.CLOSED else ErrorCode.HANDSHAKE_REQUIRED
            assert exc.code is want, exc
        else:
            raise AssertionError(f"{side} in {self.state[side]} sent {msg!r}")

    @rule(msg=CLIENT_MSGS)
    def client_sends(self, msg):
        self._send("client", msg)

    @rule(msg=SERVER_MSGS)
    def server_sends(self, msg):
        self._send("server", msg)

    @rule(side=st.sampled_from(["server", "client"]), nonce=SMALL, t_ms=MS)
    def ping(self, side, nonce, t_ms):
        if self.state[side] is State.OPEN:
            self.wire[self.other(side)].append((self.sessions[side].send(Ping(nonce, t_ms)), ("ping", nonce, t_ms)))

    @precondition(chaos)
    @rule(side=st.sampled_from(["server", "client"]), garbage=GARBAGE, roll=st.integers(0, 3))
    def garbage(self, side, garbage, roll):
        if roll != 3:
            return
        body, code = garbage
        self.wire[side].append((self._wrap(body), ("garbage", code)))

    @precondition(chaos)
    @rule(side=st.sampled_from(["server", "client"]), roll=st.integers(0, 3))
    def oversized(self, side, roll):
        if roll != 3:
            return
        frame = pack_frame(b"\x00" * (LIMIT + 1)) if self.stream else b"\x00" * (LIMIT + 1)
        self.wire[side].append((frame, ("oversized",)))

    @precondition(chaos)
    @rule(side=st.sampled_from(["server", "client"]), code=CONN_CODES, roll=st.integers(0, 3))
    def connection_error(self, side, code, roll):
        if roll != 3:  # one try in four: closing rules would otherwise end most runs early
            return
        session = self.sessions[side]
        if self.state[side] is State.CLOSED:
            try:
                session.fail(code, "going away")
            except ProtocolError as exc:
                assert exc.code is ErrorCode.CONNECTION_CLOSED
            else:
                raise AssertionError("fail() on a closed session returned a frame")
            return
        frame = session.fail(code, "going away")
        self.state[side] = State.CLOSED
        self.wire[self.other(side)].append((frame, ("conn_error", Error(code.value, "going away"))))

    @precondition(chaos)
    @rule(side=st.sampled_from(["server", "client"]), roll=st.integers(0, 3))
    def close(self, side, roll):
        if roll != 3:
            return
        self.sessions[side].close()
        self.state[side] = State.CLOSED

    # -- delivering ---------------------------------------------------------------------------------

    @rule(side=st.sampled_from(["server", "client"]), data=st.data())
    def deliver(self, side, data):
        """Deliver everything in flight to ``side`` (stream bytes cut where hypothesis picks)."""
        self.deliver_all(side, data)

    def deliver_all(self, side, data=None):
        """Deliver everything in flight to ``side``; compare events and core output with the model."""
        items = list(self.wire[side])
        self.wire[side].clear()
        if not items:
            return
        session = self.sessions[side]
        was_closed = self.state[side] is State.CLOSED
        expected_events, expected_out = [], []
        for _, tag in items:
            self._model_receive(side, tag, expected_events, expected_out)
        if self.stream:
            stream = b"".join(b for b, _ in items)
            drawn = data.draw(st.lists(st.integers(0, len(stream)), max_size=6), label="cuts") if data else []
            if not POPS_ONE_AT_A_TIME:  # start a chunk at each oversized frame (see POPS_ONE_AT_A_TIME)
                offsets = [0]
                for frame, _ in items:
                    offsets.append(offsets[-1] + len(frame))
                drawn += [off for off, (_, tag) in zip(offsets, items) if tag[0] == "oversized"]
            cuts = sorted(set(drawn) | {0, len(stream)})
            events = []
            for a, b in zip(cuts, cuts[1:]):
                events += session.receive_data(stream[a:b])
        else:
            events = []
            for frame, _ in items:
                events += session.receive_frame(frame)
        if was_closed:
            self.delivered_to_closed += len(events)
            assert events == [], f"closed {side} produced {events!r}"
        got = []
        for e in events:
            if isinstance(e, MessageReceived):
                self.rx[side].append(e.message)
                got.append(("msg", e.message))
            elif isinstance(e, HandshakeDone):
                got.append(("done",))
            elif isinstance(e, ProtocolViolation):
                got.append(("violation", e.error.code))
            elif isinstance(e, PeerError):
                got.append(("peer", e.error.code))
        assert got == expected_events, f"{side}: events {got!r} != model {expected_events!r}"
        out = session.data_to_send()
        bodies = [decode(f[4:] if self.stream else f) for f in out]
        got_out = [("welcome",) if isinstance(m, Welcome) else ("pong", m.nonce, m.t_ms) if isinstance(m, Pong)
                   else ("error", m.code) if isinstance(m, Error) else ("other", m) for m in bodies]
        assert got_out == expected_out, f"{side}: queued {got_out!r} != model {expected_out!r}"
        for frame, tag in zip(out, got_out):
            if tag[0] == "error":
                tag = ("conn_error", Error(tag[1], decode(frame[4:] if self.stream else frame).message))
            self.wire[self.other(side)].append((frame, tag))

    def _model_receive(self, side, tag, events, out) -> None:
        """What ``side`` does with one frame in the model, appending expected events and output."""
        st_ = self.state[side]
        if st_ is State.CLOSED:
            return
        kind = tag[0]

        def violate(code: ErrorCode):
            events.append(("violation", code.value))
            out.append(("error", code.value))
            self.state[side] = State.CLOSED

        if kind == "garbage":
            return violate(tag[1])
        if kind == "oversized":
            return violate(ErrorCode.FRAME_TOO_LARGE)
        if kind == "conn_error":
            events.append(("peer", tag[1].code))
            self.state[side] = State.CLOSED
            return
        if st_ is State.HANDSHAKE:
            if side == "server" and kind == "hello":
                events.append(("done",))
                out.append(("welcome",))
                self.state[side] = State.OPEN
            elif side == "client" and kind == "welcome":
                events.append(("done",))
                self.state[side] = State.OPEN
            else:
                violate(ErrorCode.HANDSHAKE_REQUIRED)
            return
        if kind in ("hello", "welcome"):
            return violate(ErrorCode.BAD_REQUEST)
        if kind == "ping":
            out.append(("pong", tag[1], tag[2]))
            return
        if kind == "pong":
            msg = Pong(tag[1], tag[2])
        else:
            msg = tag[1]
        events.append(("msg", msg))
        self.expect_rx[side].append(msg)

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def states_match_the_model(self):
        self.steps += 1
        for side, session in self.sessions.items():
            assert session.state is self.state[side], f"{side}: {session.state} != model {self.state[side]}"
            assert session.closed == (self.state[side] is State.CLOSED)

    @invariant()
    def each_side_received_what_was_sent_in_order(self):
        for side in self.sessions:
            assert self.rx[side] == self.expect_rx[side]

    @invariant()
    def nothing_delivered_after_close(self):
        assert self.delivered_to_closed == 0

    @invariant()
    def core_output_is_always_drained(self):
        for session in self.sessions.values():
            assert session.data_to_send() == []

    def teardown(self):
        # a clean shutdown of whatever is left: both ends can always be closed, then ignore everything
        for side, session in self.sessions.items():
            session.close()
            assert session.receive_frame(b"\xc1") == [] and session.closed


SessionPair.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestSessionPair = SessionPair.TestCase
