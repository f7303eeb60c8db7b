"""relayinfer.protocol without sockets: messages, tensors, framing, the sans-I/O handshake core."""

from __future__ import annotations

import re

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relayinfer.protocol.errors import ErrorCode, ProtocolError, RelayInferError, RemoteError
from relayinfer.protocol.framing import FrameBuffer, pack_frame
from relayinfer.protocol.messages import (
    MAX_FRAME_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, Cancel, Done, Embeddings, Error, ExtendBudget,
    Generate, Hello, KVTransfer, Ping, Pong, PreInfer, Rank, RefinedPrompt, Scores, Stop, Tensor,
    TileBatch, Token, Welcome, bfloat16_to_float32, decode, encode,
)
from relayinfer.protocol.session import (
    ClientSession, HandshakeDone, MessageReceived, PeerError, ProtocolViolation, ServerSession, State,
)

FP = "sha256:0123456789abcdef0123456789abcdef"
T = Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))

SAMPLES = [
    Hello(protocol_version=1, model_fingerprint=FP, token="secret", client="device/0.1"),
    Welcome(protocol_version=1, model_fingerprint=FP, server="cloud/0.1", session_id="s1"),
    Generate(request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=40,
             seed=7, cloud_budget=16, refine=0.5, stop_ids=[2, 128001]),
    Token(request_id="r1", token_id=42, index=0, t_cloud_ms=12.5),
    RefinedPrompt(request_id="r1", kept_indices=[0, 2]),
    ExtendBudget(request_id="r1", cloud_budget=32),
    Stop(request_id="r1", handoff_index=9),
    Cancel(request_id="r1"),
    Done(request_id="r1", reason="stop", cloud_tokens=10, prefill_ms=33.25),
    Error(code="bad_request", message="nope", request_id="r1"),
    Ping(nonce=5, t_ms=1234.5),
    Pong(nonce=5, t_ms=1234.5),
    KVTransfer(request_id="r2", layer_start=0, kv=T, num_tokens=3),
    PreInfer(request_id="r3", user_id=11, item_ids=[4, 5], timestamps=[1700000000, 1700000100]),
    Rank(request_id="r3", user_id=11, item_ids=[4, 5], timestamps=[1, 2], candidate_ids=[7, 8, 9]),
    Scores(request_id="r3", scores=Tensor.from_numpy(np.array([0.1, 0.2, 0.3], np.float32)), prefix_source="hbm"),
    TileBatch(request_id="r4", slide_id="slide-1", coords=[[0, 0], [224, 0]],
              tiles=Tensor.from_numpy(np.zeros((2, 4, 4, 3), np.uint8))),
    Embeddings(request_id="r4", embeddings=Tensor.from_numpy(np.ones((2, 8), np.float16))),
]


# -- messages ---------------------------------------------------------------------------------------

def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())
    assert len(MESSAGE_TYPES) == 18


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decode(data) == msg
    raw = msgspec.msgpack.decode(data)
    assert raw["type"] == type(msg).__struct_config__.tag
    assert raw["type"].islower() and " " not in raw["type"]


def test_wire_format_is_a_plain_map_with_defaults_omitted():
    raw = msgspec.msgpack.decode(encode(Generate(request_id="r", prompt_ids=[5], max_new_tokens=3)))
    assert raw == {"type": "generate", "request_id": "r", "prompt_ids": [5], "max_new_tokens": 3}
    g = decode(msgspec.msgpack.encode(raw))
    assert (g.temperature, g.top_p, g.top_k, g.seed, g.cloud_budget, g.refine, g.stop_ids) == (0.0, 1.0, 0, None, None, None, [])
    assert msgspec.msgpack.decode(encode(RefinedPrompt("r", [1])))["type"] == "refined_prompt"
    assert PROTOCOL_VERSION == 1 and MAX_FRAME_BYTES == 64 * 1024 * 1024


def test_encode_rejects_non_messages():
    with pytest.raises(TypeError, match="not a protocol message"):
        encode(T)
    with pytest.raises(TypeError):
        encode({"type": "cancel", "request_id": "r"})


# -- tensors ----------------------------------------------------------------------------------------

DTYPES = ["float32", "float16", "int8", "uint8", "int32", "int64", "bool"]
SHAPES = [(), (0,), (5,), (2, 3), (2, 0, 4), (1, 2, 3, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip(dtype, shape):
    arr = (np.arange(int(np.prod(shape))) % 7 - 3).astype(dtype).reshape(shape)
    t = Tensor.from_numpy(arr)
    assert (t.dtype, t.shape, t.nbytes) == (dtype, list(shape), arr.nbytes)
    back = decode(encode(Embeddings(request_id="e", embeddings=t))).embeddings.to_numpy()
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_tensor_zero_d_value():
    t = decode(encode(Scores("s", Tensor.from_numpy(np.float32(2.5)), "none"))).scores
    assert t.shape == [] and t.data == np.float32(2.5).tobytes() and t.to_numpy()[()] == 2.5


def test_big_endian_and_strided_input_become_little_endian_c_order():
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    t = Tensor.from_numpy(be)
    assert t.data == np.arange(6, dtype="<i4").tobytes()
    assert t.data[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    np.testing.assert_array_equal(t.to_numpy(), be)
    transposed = Tensor.from_numpy(np.arange(6, dtype=">f8").astype(">f4").reshape(2, 3).T)
    assert transposed.shape == [3, 2]
    np.testing.assert_array_equal(transposed.to_numpy(), [[0, 3], [1, 4], [2, 5]])


def test_bfloat16_travels_as_raw_bits():
    bits = np.array([0x3FC0, 0xC010, 0x0000], dtype=">u2")  # 1.5, -2.25, 0.0 in bfloat16
    t = Tensor.from_numpy(bits, dtype="bfloat16")
    assert t.dtype == "bfloat16" and t.data == b"\xc0\x3f\x10\xc0\x00\x00"
    back = decode(encode(Embeddings("e", t))).embeddings.to_numpy()
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(bfloat16_to_float32(back), np.array([1.5, -2.25, 0.0], np.float32))
    with pytest.raises(ProtocolError, match="bfloat16 needs raw uint16"):
        Tensor.from_numpy(np.ones(2, np.float16), dtype="bfloat16")


def test_bfloat16_from_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = Tensor.from_numpy(np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16))
    assert t.dtype == "bfloat16"
    np.testing.assert_array_equal(bfloat16_to_float32(t.to_numpy()), [1.5, -2.25])


def test_tensor_rejects_disallowed_dtypes():
    for bad in (np.float64, np.complex64, np.uint32, np.int16):
        with pytest.raises(ProtocolError, match="cannot send numpy dtype") as exc:
            Tensor.from_numpy(np.zeros(2, bad))
        assert exc.value.code is ErrorCode.BAD_FRAME
    with pytest.raises(ProtocolError, match="does not match wire dtype"):
        Tensor.from_numpy(np.zeros(2, np.int32), dtype="float32")


def _raw_scores(tensor: dict) -> bytes:
    return msgspec.msgpack.encode({"type": "scores", "request_id": "r", "prefix_source": "dram", "scores": tensor})


@pytest.mark.parametrize("tensor, match", [
    ({"dtype": "float32", "shape": [2, 3], "data": b"\0" * 23}, r"tensor data is 23 bytes but float32 shape \[2, 3\] needs 24 bytes"),
    ({"dtype": "int64", "shape": [], "data": b""}, r"tensor data is 0 bytes but int64 shape \[\] needs 8 bytes"),
    ({"dtype": "uint8", "shape": [0], "data": b"x"}, r"1 bytes but uint8 shape \[0\] needs 0 bytes"),
    ({"dtype": "float64", "shape": [1], "data": b"\0" * 8}, r"tensor dtype 'float64' not allowed"),
    ({"dtype": "int8", "shape": [-1], "data": b""}, r"negative dimension"),
    ({"dtype": "bool", "shape": [2], "data": b"\x01\x02"}, r"bool tensor data holds bytes other than 0 and 1"),
    ({"dtype": "float32", "shape": [1], "data": "abcd"}, r"invalid 'scores' message: Expected `bytes`, got `str`"),
])
def test_bad_tensor_on_the_wire(tensor, match):
    """A bad tensor in a frame is BAD_FRAME naming what is wrong and the field that held it."""
    with pytest.raises(ProtocolError, match=match) as exc:
        decode(_raw_scores(tensor))
    assert exc.value.code is ErrorCode.BAD_FRAME
    assert "- at `$.scores" in str(exc.value) and str(exc.value).count("[bad_frame]") == 1, str(exc.value)


# -- decode errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["request_id", "slide_id"])
def test_a_string_that_is_not_utf8_is_bad_frame_naming_its_field(field):
    """A lone surrogate's CESU-8 bytes (ed a0 80) are not UTF-8: the frame is BAD_FRAME and the
    error names the field that held them."""
    body = {"type": "tile_batch", "request_id": "p", "slide_id": "s", "coords": [], "last": True}
    body[field] = "\x00MARK\x00"
    raw = msgspec.msgpack.encode(body).replace(b"\x00MARK\x00", b"\xed\xa0\x80abc")  # same length
    with pytest.raises(ProtocolError, match=rf"Invalid UTF-8 .*\(in field `{field}`\)") as exc:
        decode(raw)
    assert exc.value.code is ErrorCode.BAD_FRAME


def test_every_truncation_is_bad_frame():
    data = encode(SAMPLES[2])
    for n in range(len(data)):
        with pytest.raises(ProtocolError) as exc:
            decode(data[:n])
        assert exc.value.code is ErrorCode.BAD_FRAME, n


@pytest.mark.parametrize("data, code, match", [
    (b"", ErrorCode.BAD_FRAME, "frame of 0 bytes is not valid MessagePack"),
    (b"\xc1", ErrorCode.BAD_FRAME, "malformed"),
    (encode(Cancel("r")) + b"\x00", ErrorCode.BAD_FRAME, "trailing"),
    (msgspec.msgpack.encode([1, 2]), ErrorCode.BAD_FRAME, "not a message map"),
    (msgspec.msgpack.encode({"request_id": "r"}), ErrorCode.BAD_FRAME, "no 'type' field"),
    (msgspec.msgpack.encode({"type": 3}), ErrorCode.BAD_FRAME, "not a message map with a string 'type'"),
    (msgspec.msgpack.encode({"type": "launch_missiles"}), ErrorCode.UNKNOWN_MESSAGE, "unknown message type 'launch_missiles'"),
    (msgspec.msgpack.encode({"type": "Token"}), ErrorCode.UNKNOWN_MESSAGE, "unknown message type 'Token'"),
    (msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt_ids": [1], "max_new_tokens": "9"}),
     ErrorCode.BAD_FRAME, r"invalid 'generate' message: Expected `int`, got `str` - at `\$.max_new_tokens`"),
    (msgspec.msgpack.encode({"type": "token", "request_id": "r", "index": 0, "t_cloud_ms": 1.0}),
     ErrorCode.BAD_FRAME, "missing required field `token_id`"),
])
def test_decode_errors(data, code, match):
    with pytest.raises(ProtocolError, match=match) as exc:
        decode(data)
    assert exc.value.code is code
    assert isinstance(exc.value, RelayInferError) and str(exc.value).startswith(f"[{code.value}]")


def test_corrupted_byte_never_escapes_as_anything_but_protocol_error():
    data = bytearray(encode(SAMPLES[12]))
    outcomes = set()
    for i in range(len(data)):
        for value in (0x00, 0xC1, 0xFF):
            corrupted = bytes(data[:i]) + bytes([value]) + bytes(data[i + 1:])
            try:
                decode(corrupted)
                outcomes.add("ok")
            except ProtocolError as exc:
                outcomes.add(exc.code)
    assert ErrorCode.BAD_FRAME in outcomes and outcomes <= {"ok", ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_MESSAGE}


def test_remote_error_keeps_unknown_codes():
    e = RemoteError("fingerprint_mismatch", "m", request_id=None)
    assert e.code is ErrorCode.FINGERPRINT_MISMATCH and e.raw_code == "fingerprint_mismatch"
    e = RemoteError("from_the_future", "m", request_id="r")
    assert e.code is ErrorCode.INTERNAL and e.raw_code == "from_the_future" and e.request_id == "r"


# -- framing ----------------------------------------------------------------------------------------

BODIES = [encode(m) for m in SAMPLES[:6]] + [b""]
STREAM = b"".join(pack_frame(b) for b in BODIES)


def test_pack_frame_header():
    assert pack_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert pack_frame(b"") == b"\x00\x00\x00\x00"


def test_frame_buffer_merged_and_byte_by_byte():
    assert FrameBuffer().feed(STREAM) == BODIES
    buf, out = FrameBuffer(), []
    for i in range(len(STREAM)):
        out += buf.feed(STREAM[i:i + 1])
    assert out == BODIES and buf.pending == 0


def test_frame_buffer_every_two_way_split():
    for cut in range(len(STREAM) + 1):
        buf = FrameBuffer()
        assert buf.feed(STREAM[:cut]) + buf.feed(STREAM[cut:]) == BODIES


def test_frame_buffer_oversized_header_fails_before_body():
    buf = FrameBuffer(max_frame_bytes=100)
    assert buf.feed(pack_frame(b"x" * 100)) == [b"x" * 100]
    assert buf.feed(b"\x00\x00") == []
    with pytest.raises(ProtocolError, match="frame of 101 bytes exceeds the limit of 100 bytes") as exc:
        buf.feed(b"\x00\x65")  # only the header of a 101-byte frame: fails at once
    assert exc.value.code is ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        buf.feed(pack_frame(b"ok"))  # the stream cannot be resynchronised
    with pytest.raises(ProtocolError, match="4294967295 bytes exceeds"):
        FrameBuffer().feed(b"\xff\xff\xff\xff")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8), st.lists(st.integers(0, 400), max_size=10))
def test_frame_buffer_arbitrary_splits(bodies, cuts):
    stream = b"".join(pack_frame(b) for b in bodies)
    cuts = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    buf, out = FrameBuffer(max_frame_bytes=40), []
    for a, b in zip(cuts, cuts[1:]):
        out += buf.feed(stream[a:b])
    assert out == bodies and buf.pending == 0


# -- handshake state machine -----------------------------------------------------------------------

def hello(**kw) -> bytes:
    fields = dict(protocol_version=PROTOCOL_VERSION, model_fingerprint=FP)
    return encode(Hello(**{**fields, **kw}))


def sent_messages(session) -> list:
    """Decode what the core queued (length prefix stripped in stream mode)."""
    return [decode(f[4:] if session.stream else f) for f in session.data_to_send()]


def assert_violation(session, events, code, match):
    assert len(events) == 1 and isinstance(events[0], ProtocolViolation)
    err = events[0].error
    assert err.code == code.value and err.request_id is None
    assert re.search(match, err.message), err.message
    assert session.state is State.CLOSED and session.close_error == err
    assert sent_messages(session) == [err]
    assert session.data_to_send() == []
    assert session.receive_frame(hello()) == []  # closed: everything ignored
    with pytest.raises(ProtocolError) as exc:
        session.send(Cancel("r"))
    assert exc.value.code is ErrorCode.CONNECTION_CLOSED


def open_pair(**server_kw):
    server, client = ServerSession(FP, **server_kw), ClientSession(FP, token=server_kw.get("auth_token"))
    events = server.receive_frame(client.start())
    assert [type(e) for e in events] == [HandshakeDone]
    (welcome,) = server.data_to_send()
    assert [type(e) for e in client.receive_frame(welcome)] == [HandshakeDone]
    return server, client


def test_handshake_ok():
    server = ServerSession(FP, auth_token="s3cret", server="cloud", session_id="abc")
    client = ClientSession(FP, token="s3cret", client="phone")
    assert server.state is State.HANDSHAKE and client.state is State.HANDSHAKE
    (done,) = server.receive_frame(client.start())
    assert done.hello == Hello(protocol_version=1, model_fingerprint=FP, token="s3cret", client="phone")
    assert done.welcome == Welcome(protocol_version=1, model_fingerprint=FP, server="cloud", session_id="abc")
    (frame,) = server.data_to_send()
    (cdone,) = client.receive_frame(frame)
    assert cdone == HandshakeDone(done.hello, done.welcome)
    assert server.state is State.OPEN and client.state is State.OPEN and client.welcome.session_id == "abc"
    # messages both ways
    assert server.receive_frame(client.send(Generate("r", [1, 2], 4))) == [MessageReceived(Generate("r", [1, 2], 4))]
    assert client.receive_frame(server.send(Token("r", 9, 0, 1.5))) == [MessageReceived(Token("r", 9, 0, 1.5))]
    # per-request errors are messages, not connection failures
    assert client.receive_frame(server.send(Error("unknown_request", "no r2", "r2"))) == [
        MessageReceived(Error("unknown_request", "no r2", "r2"))]
    assert client.state is State.OPEN


def test_random_session_ids_differ():
    assert ServerSession(FP).session_id != ServerSession(FP).session_id


def test_token_ignored_when_not_required():
    server = ServerSession(FP)
    assert isinstance(server.receive_frame(hello(token="whatever"))[0], HandshakeDone)


@pytest.mark.parametrize("frame, code, match", [
    (b"\x93\x01", ErrorCode.BAD_FRAME, "not a message map"),
    (b"\x82\xa4type", ErrorCode.BAD_FRAME, "truncated"),
    (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.BAD_FRAME, "not a message map"),
    (msgspec.msgpack.encode({"type": "hola"}), ErrorCode.UNKNOWN_MESSAGE, "unknown message type 'hola'"),
    (encode(Generate("r", [1], 1)), ErrorCode.HANDSHAKE_REQUIRED, "expected 'hello' as the first frame, got 'generate'"),
    (encode(Error("x", "y", request_id="r")), ErrorCode.HANDSHAKE_REQUIRED, "got 'error'"),
    (hello(protocol_version=2), ErrorCode.VERSION_MISMATCH, "protocol version mismatch: server speaks 1, client sent 2"),
    (hello(model_fingerprint="sha256:ffffffffffffffffffff"), ErrorCode.FINGERPRINT_MISMATCH,
     "model fingerprint mismatch: server has sha256:012345678…, client sent sha256:fffffffff…"),
    (hello(model_fingerprint="cd34"), ErrorCode.FINGERPRINT_MISMATCH, "server has sha256:012345678…, client sent cd34$"),
    (b"\x00" * 1025, ErrorCode.FRAME_TOO_LARGE, "frame of 1025 bytes exceeds the limit of 1024 bytes"),
])
def test_server_handshake_errors(frame, code, match):
    server = ServerSession(FP, max_frame_bytes=1024)
    assert_violation(server, server.receive_frame(frame), code, match)


@pytest.mark.parametrize("token, match", [
    (None, "requires an auth token; the client sent none"),
    ("wrong", "^auth token rejected$"),
    ("s3cret-but-longer", "^auth token rejected$"),
    ("ünïcode", "^auth token rejected$"),
])
def test_unauthorized(token, match):
    server = ServerSession(FP, auth_token="s3cret")
    assert_violation(server, server.receive_frame(hello(token=token)), ErrorCode.UNAUTHORIZED, match)


def test_token_checked_before_fingerprint():
    server = ServerSession(FP, auth_token="s3cret")
    events = server.receive_frame(hello(token="bad", model_fingerprint="other"))
    assert events[0].error.code == "unauthorized" and FP not in events[0].error.message


def test_errors_after_handshake():
    server, client = open_pair()
    assert_violation(server, server.receive_frame(b"\xc1"), ErrorCode.BAD_FRAME, "malformed")
    server, client = open_pair()
    assert_violation(server, server.receive_frame(client.send(Cancel("r")) + b"!"),
                     ErrorCode.BAD_FRAME, "trailing")
    server, client = open_pair()
    assert_violation(server, server.receive_frame(hello()), ErrorCode.BAD_REQUEST, "unexpected 'hello' after the handshake")
    server, client = open_pair()
    assert_violation(server, server.receive_frame(msgspec.msgpack.encode({"type": "nope"})),
                     ErrorCode.UNKNOWN_MESSAGE, "'nope'")


def test_ping_is_answered_by_the_core():
    server, client = open_pair()
    assert server.receive_frame(client.send(Ping(nonce=3, t_ms=99.5))) == []
    (pong,) = server.data_to_send()
    assert client.receive_frame(pong) == [MessageReceived(Pong(nonce=3, t_ms=99.5))]


def test_peer_error_closes_without_answer():
    server, client = open_pair()
    frame = server.fail(ErrorCode.OVERLOADED, "try later")
    assert server.state is State.CLOSED and server.close_error.code == "overloaded"
    (event,) = client.receive_frame(frame)
    assert event == PeerError(Error("overloaded", "try later"))
    assert client.state is State.CLOSED and client.data_to_send() == []
    with pytest.raises(ProtocolError):
        server.fail(ErrorCode.INTERNAL, "again")


def test_client_handshake_errors():
    client = ClientSession(FP)
    assert_violation(client, client.receive_frame(encode(Welcome(1, FP))), ErrorCode.HANDSHAKE_REQUIRED, "got 'welcome'")
    for welcome, code, match in [
        (Welcome(protocol_version=7, model_fingerprint=FP), ErrorCode.VERSION_MISMATCH, "client speaks 1, server sent 7"),
        (Welcome(protocol_version=1, model_fingerprint="xyz"), ErrorCode.FINGERPRINT_MISMATCH,
         "client has sha256:012345678…, server sent xyz"),
        (Token("r", 1, 0, 0.0), ErrorCode.HANDSHAKE_REQUIRED, "expected 'welcome' in answer to 'hello', got 'token'"),
    ]:
        client = ClientSession(FP)
        client.start()
        assert_violation(client, client.receive_frame(encode(welcome)), code, match)
    client = ClientSession(FP)
    client.start()
    (event,) = client.receive_frame(encode(Error("fingerprint_mismatch", "model fingerprint mismatch: ...")))
    assert isinstance(event, PeerError) and event.error.code == "fingerprint_mismatch" and client.closed
    with pytest.raises(ProtocolError, match="already started"):
        client.start()


def test_local_misuse():
    server = ServerSession(FP, max_frame_bytes=200)
    with pytest.raises(ProtocolError) as exc:
        server.send(Token("r", 1, 0, 0.0))
    assert exc.value.code is ErrorCode.HANDSHAKE_REQUIRED
    server.receive_frame(hello())
    with pytest.raises(ProtocolError) as exc:
        server.send(Welcome(1, FP))
    assert exc.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError, match=r"frame of \d+ bytes exceeds the limit of 200 bytes") as exc:
        server.send(RefinedPrompt("r", list(range(300))))
    assert exc.value.code is ErrorCode.FRAME_TOO_LARGE and server.state is State.OPEN
    with pytest.raises(RuntimeError, match="stream=True"):
        server.receive_data(b"")
    server.close()
    assert server.closed and server.receive_frame(b"junk") == []


def test_stream_mode_end_to_end_in_odd_chunks():
    server, client = ServerSession(FP, stream=True), ClientSession(FP, stream=True)
    hello_bytes = client.start()
    assert hello_bytes[:4] == len(hello_bytes[4:]).to_bytes(4, "big")
    events = []
    for i in range(0, len(hello_bytes), 3):
        events += server.receive_data(hello_bytes[i:i + 3])
    assert [type(e) for e in events] == [HandshakeDone]
    assert [type(e) for e in client.receive_data(b"".join(server.data_to_send()))] == [HandshakeDone]
    burst = client.send(Generate("a", [1], 2)) + client.send(Ping(1, 2.0)) + client.send(Cancel("a"))
    assert server.receive_data(burst) == [MessageReceived(Generate("a", [1], 2)), MessageReceived(Cancel("a"))]
    assert client.receive_data(b"".join(server.data_to_send())) == [MessageReceived(Pong(1, 2.0))]
    small = ServerSession(FP, max_frame_bytes=64, stream=True)
    assert_violation(small, small.receive_data(b"\x00\x00\x01\x00"), ErrorCode.FRAME_TOO_LARGE, "256 bytes exceeds the limit of 64")


# -- properties -------------------------------------------------------------------------------------

I64 = st.integers(-(2**63), 2**63 - 1)
IDS = st.lists(st.integers(0, 2**32), max_size=50)
FLOATS = st.floats(allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(st.one_of(
    st.builds(Generate, request_id=st.text(max_size=20), prompt_ids=IDS, max_new_tokens=I64, temperature=FLOATS,
              top_p=FLOATS, top_k=I64, seed=st.none() | I64, cloud_budget=st.none() | I64,
              refine=st.none() | FLOATS, stop_ids=IDS),
    st.builds(Token, request_id=st.text(max_size=20), token_id=I64, index=I64, t_cloud_ms=FLOATS),
))
def test_messages_round_trip_exactly(msg):
    assert decode(encode(msg)) == msg


ARRAYS = hnp.arrays(
    dtype=st.sampled_from([np.dtype(d) for d in ("<f4", ">f4", "<f2", "i1", "u1", ">i4", "<i8", "?")]),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ARRAYS)
def test_tensors_round_trip_exactly(arr):
    t = decode(encode(KVTransfer(request_id="k", layer_start=0, kv=Tensor.from_numpy(arr), num_tokens=1))).kv
    back = t.to_numpy()
    assert back.shape == arr.shape and back.dtype == arr.dtype.newbyteorder("<")
    assert back.tobytes() == arr.astype(arr.dtype.newbyteorder("<")).tobytes()  # bit-exact, NaNs included


def _check_core_events(session, events):
    assert all(isinstance(e, (HandshakeDone, MessageReceived, ProtocolViolation, PeerError)) for e in events)
    if any(isinstance(e, ProtocolViolation) for e in events):
        assert session.closed
        assert isinstance(sent_messages(session)[-1], Error)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64) | st.sampled_from([hello(), encode(Cancel("r")), b"\x80", b"\x81\xa4type"]),
                min_size=1, max_size=4))
def test_arbitrary_bytes_into_the_server_core_never_raise(frames):
    for session in (ServerSession(FP, max_frame_bytes=48), open_pair()[0]):
        for frame in frames:
            _check_core_events(session, session.receive_frame(frame))
        stream = ServerSession(FP, max_frame_bytes=48, stream=True)
        _check_core_events(stream, stream.receive_data(b"".join(frames)))
