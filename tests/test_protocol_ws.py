"""relayinfer.protocol.transport.ws against real websockets servers on 127.0.0.1 (free port, started per test)."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed

from relayinfer.protocol.transport import ws
from relayinfer.protocol.errors import ChannelClosed, ErrorCode, ProtocolError, RelayInferError, RemoteError
from relayinfer.protocol.messages import (
    Cancel, Done, Embeddings, Error, Generate, Ping, Pong, Stop, Tensor, Token, decode, encode,
)
from relayinfer.protocol.session import ServerSession

FP = "sha256:feedfacecafebeef0000"
LIMIT = 4096  # protocol max frame size used by these servers, bytes


def run(coro, timeout: float = 10.0):
    """Run one test coroutine with a hard timeout (a hang fails the test instead of the suite)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def echo_server(token: str | None = None, outcomes: asyncio.Queue | None = None):
    """Echo server built from websockets' serve + ws.accept; yields its ws:// URL.

    Each connection's end ("closed" or the error code that ended it) goes to ``outcomes``."""

    async def handler(conn):
        session = ServerSession(FP, auth_token=token, max_frame_bytes=LIMIT, server="echo")
        try:
            channel = await ws.accept(conn, session)
            async for msg in channel:
                await channel.send(msg)
            result = "closed"
        except (ProtocolError, RemoteError) as exc:
            result = exc.code
        if outcomes is not None:
            outcomes.put_nowait(result)

    async with ws_serve(handler, "127.0.0.1", 0, max_size=ws.ws_max_size(LIMIT)) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_ws_max_size_margin():
    assert ws.ws_max_size(LIMIT) == LIMIT + 65536
    assert ws.ws_max_size(64 << 20) == (64 << 20) + (16 << 20)


def test_handshake_and_echo():
    async def main():
        async with echo_server(token="tok") as url:
            async with await ws.open_channel(url, FP, token="tok", client="test", max_frame_bytes=LIMIT) as ch:
                assert ch.welcome.model_fingerprint == FP and ch.welcome.server == "echo"
                assert len(ch.welcome.session_id) == 16
                sent = [
                    Generate(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=8, cloud_budget=4),
                    Token(request_id="r", token_id=17, index=0, t_cloud_ms=3.5),
                    Embeddings(request_id="e", embeddings=Tensor.from_numpy(np.arange(12, dtype=np.float16).reshape(3, 4))),
                    Error(code="unknown_request", message="no such request", request_id="zz"),
                ]
                for msg in sent:
                    await ch.send(msg)
                got = [await ch.recv() for _ in sent]
                assert got == sent
                np.testing.assert_array_equal(got[2].embeddings.to_numpy(), np.arange(12, dtype=np.float16).reshape(3, 4))
    run(main())


def test_ping_answered_by_the_server_core():
    async def main():
        async with echo_server() as url:
            async with await ws.open_channel(url, FP, max_frame_bytes=LIMIT) as ch:
                await ch.send(Ping(nonce=41, t_ms=1000.25))
                await ch.send(Cancel("after-ping"))
                assert await ch.recv() == Pong(nonce=41, t_ms=1000.25)
                assert await ch.recv() == Cancel("after-ping")
    run(main())


@pytest.mark.parametrize("fingerprint, token, code, match", [
    ("sha256:0000000000000000", "tok", ErrorCode.FINGERPRINT_MISMATCH,
     r"model fingerprint mismatch: server has sha256:feedfacec…, client sent sha256:000000000…"),
    (FP, "wrong", ErrorCode.UNAUTHORIZED, "auth token rejected"),
    (FP, None, ErrorCode.UNAUTHORIZED, "requires an auth token"),
])
def test_rejected_handshake_raises_remote_error(fingerprint, token, code, match):
    async def main():
        outcomes = asyncio.Queue()
        async with echo_server(token="tok", outcomes=outcomes) as url:
            with pytest.raises(RemoteError, match=match) as exc:
                await ws.open_channel(url, fingerprint, token=token)
            assert exc.value.code is code and exc.value.request_id is None
            assert await outcomes.get() is code  # the server side saw the same failure
    run(main())


def test_garbage_closes_only_that_connection():
    async def main():
        outcomes = asyncio.Queue()
        async with echo_server(outcomes=outcomes) as url:
            good = await ws.open_channel(url, FP, max_frame_bytes=LIMIT)
            await good.send(Token("g", 1, 0, 0.0))
            assert await good.recv() == Token("g", 1, 0, 0.0)

            async with connect(url) as raw:  # raw websockets client: no handshake, just garbage
                await raw.send(b"\xc1\x00garbage")
                error = decode(await raw.recv())
                assert isinstance(error, Error) and error.code == "bad_frame" and error.request_id is None
                assert "not valid MessagePack" in error.message
                with pytest.raises(ConnectionClosed) as closed:
                    await raw.recv()
                assert closed.value.rcvd.code == 1002 and closed.value.rcvd.reason == "bad_frame"
            assert await outcomes.get() is ErrorCode.BAD_FRAME

            for i in range(3):  # the concurrent well-behaved client is untouched
                await good.send(Token("g", 10 + i, i, 1.0))
            assert [(await good.recv()).token_id for _ in range(3)] == [10, 11, 12]
            await good.close()
            assert await outcomes.get() == "closed"
    run(main())


def test_garbage_after_handshake_and_text_frames():
    async def main():
        outcomes = asyncio.Queue()
        async with echo_server(outcomes=outcomes) as url:
            ch = await ws.open_channel(url, FP, max_frame_bytes=LIMIT)
            await ch.ws.send(msgspec.msgpack.encode({"type": "teleport", "request_id": "r"}))
            with pytest.raises(RemoteError, match="unknown message type 'teleport'") as exc:
                await ch.recv()
            assert exc.value.code is ErrorCode.UNKNOWN_MESSAGE
            assert await outcomes.get() is ErrorCode.UNKNOWN_MESSAGE

            async with connect(url) as raw:
                await raw.send("hello as text")
                error = decode(await raw.recv())
                assert (error.code, error.message) == ("bad_frame", "text websocket message; frames must be binary")
            assert await outcomes.get() is ErrorCode.BAD_FRAME
    run(main())


def test_oversized_frames():
    async def main():
        outcomes = asyncio.Queue()
        async with echo_server(outcomes=outcomes) as url:
            # refused locally before sending; the channel stays usable
            ch = await ws.open_channel(url, FP, max_frame_bytes=LIMIT)
            with pytest.raises(ProtocolError, match=f"exceeds the limit of {LIMIT} bytes") as exc:
                await ch.send(Cancel("x" * LIMIT))
            assert exc.value.code is ErrorCode.FRAME_TOO_LARGE
            await ch.send(Cancel("small"))
            assert await ch.recv() == Cancel("small")

            # a client with a larger limit: just above the server's limit -> Error frame from the core
            big = await ws.open_channel(url, FP, max_frame_bytes=1 << 20)
            await big.send(Cancel("x" * LIMIT))
            with pytest.raises(RemoteError, match=rf"frame of {len(encode(Cancel('x' * LIMIT)))} bytes exceeds the limit of {LIMIT} bytes") as exc:
                await big.recv()
            assert exc.value.code is ErrorCode.FRAME_TOO_LARGE
            assert await outcomes.get() is ErrorCode.FRAME_TOO_LARGE

            # far above: websockets closes with 1009 before reading it; mapped to the same error
            big = await ws.open_channel(url, FP, max_frame_bytes=1 << 20)
            await big.send(Cancel("x" * 200_000))
            with pytest.raises(RemoteError, match="peer closed the connection: message too big") as exc:
                await big.recv()
            assert exc.value.code is ErrorCode.FRAME_TOO_LARGE

            await ch.send(Cancel("still-here"))
            assert await ch.recv() == Cancel("still-here")
            await ch.close()
    run(main())


def test_client_refuses_oversized_frames_from_the_server():
    async def handler(channel):
        size = (await channel.recv()).handoff_index
        await channel.send(Cancel("x" * size))

    async def main():
        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            for size, match in [(LIMIT, f"exceeds the limit of {LIMIT} bytes"),
                                (200_000, f"peer sent a websocket message above {ws.ws_max_size(LIMIT)} bytes")]:
                ch = await ws.open_channel(url, FP, max_frame_bytes=LIMIT)
                await ch.send(Stop("r", size))
                with pytest.raises(ProtocolError, match=match) as exc:
                    await ch.recv()
                assert exc.value.code is ErrorCode.FRAME_TOO_LARGE
    run(main())


def test_serve_wrapper_stream_and_clean_end():
    async def handler(channel: ws.ServerChannel):
        gen = await channel.recv()
        for i in range(gen.max_new_tokens):
            await channel.send(Token(gen.request_id, 100 + i, i, float(i)))
        await channel.send(Done(gen.request_id, "length", gen.max_new_tokens, 1.5))

    async def main():
        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP, max_frame_bytes=LIMIT) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with await ws.open_channel(url, FP, max_frame_bytes=LIMIT) as ch:
                await ch.send(Generate("r", [1, 2], 3))
                got = [msg async for msg in ch]  # ends when the handler returns (close 1000)
            assert got == [Token("r", 100, 0, 0.0), Token("r", 101, 1, 1.0), Token("r", 102, 2, 2.0),
                           Done("r", "length", 3, 1.5)]
            with pytest.raises(RemoteError) as exc:
                await ws.open_channel(url, "other")
            assert exc.value.code is ErrorCode.FINGERPRINT_MISMATCH
    run(main())


def test_handler_errors_reach_the_client():
    class PromptTooLong(RelayInferError):  # the kind of class other components append to errors.py
        code = ErrorCode.PROMPT_TOO_LONG

    async def handler(channel):
        gen = await channel.recv()
        if gen.request_id == "long":
            raise PromptTooLong("prompt of 9000 tokens exceeds the context of 4096")
        raise RuntimeError("boom")

    async def main():
        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ch = await ws.open_channel(url, FP)
            await ch.send(Generate("bug", [1], 1))
            with pytest.raises(RemoteError, match="internal server error") as exc:
                await ch.recv()
            assert exc.value.code is ErrorCode.INTERNAL
            ch = await ws.open_channel(url, FP)
            await ch.send(Generate("long", [1], 1))
            with pytest.raises(RemoteError, match="prompt of 9000 tokens exceeds the context of 4096") as exc:
                await ch.recv()
            assert exc.value.code is ErrorCode.PROMPT_TOO_LONG
    run(main())


def test_handshake_timeout_and_closed_channel():
    async def main():
        async with ws.serve(lambda ch: ch.recv(), "127.0.0.1", 0, expected_fingerprint=FP,
                            handshake_timeout=0.2) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with connect(url) as raw:  # says nothing: the server gives up after 0.2 s
                error = decode(await raw.recv())
                assert (error.code, error.message) == ("handshake_required", "no hello within 0.2 s")
            ch = await ws.open_channel(url, FP)
            await ch.close()
            with pytest.raises(ProtocolError) as exc:
                await ch.send(Cancel("r"))
            assert exc.value.code is ErrorCode.CONNECTION_CLOSED
    run(main())


def test_unreachable_server_raises_oserror():
    async def main():
        async with ws_serve(lambda c: None, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
        with pytest.raises(OSError):  # the port is closed again
            await ws.open_channel(f"ws://127.0.0.1:{port}", FP, open_timeout=5)
    run(main())


def test_connection_lost_is_channel_closed():
    async def main():
        release = asyncio.Event()

        async def handler(channel):
            await channel.recv()
            channel.ws.transport.abort()  # drop the TCP connection without a closing handshake
            release.set()

        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ch = await ws.open_channel(url, FP)
            await ch.send(Cancel("r"))
            with pytest.raises(ChannelClosed) as exc:
                async for _ in ch:
                    pass
            assert exc.value.clean is False and exc.value.code is ErrorCode.CONNECTION_CLOSED
            await release.wait()
    run(main())


def test_full_frame_limit_holds_from_the_welcome_on(monkeypatch):
    """The handshake's small frame limit is lifted before the Welcome leaves: a client may send a
    frame up to the session's limit the moment it reads the Welcome (with the limit lifted after
    it, such a frame could meet the handshake limit and be closed with 1009)."""
    big = 1 << 20
    limits_at_send = []
    send = ws._send_quietly

    async def recording_send(conn, frame):
        if decode(frame).__class__.__name__ == "Welcome" and hasattr(conn, "protocol"):
            limits_at_send.append(conn.protocol.max_message_size)
        await send(conn, frame)

    monkeypatch.setattr(ws, "_send_quietly", recording_send)

    async def handler(channel):
        msg = await channel.recv()
        await channel.send(Stop("ok", len(msg.request_id)))

    async def main():
        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP, max_frame_bytes=big) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ch = await ws.open_channel(url, FP, max_frame_bytes=big)
            await ch.send(Cancel("x" * 300_000))
            assert await ch.recv() == Stop("ok", 300_000)
            await ch.close()
    run(main(), timeout=30.0)
    assert limits_at_send == [ws.ws_max_size(big)]


def test_no_permessage_deflate_either_way():
    """Neither side negotiates compression: the server declines a client that offers deflate (as
    websockets' and browsers' clients do), and `open_channel` offers none, so a KV piece costs no
    zlib time on a busy cloud core."""
    async def handler(channel: ws.ServerChannel):
        await channel.recv()
        await channel.send(Done("r", "length", 0, 0.0))

    async def main():
        async with ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP, max_frame_bytes=LIMIT) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with connect(url) as raw:  # websockets' client offers permessage-deflate by default
                assert raw.response.headers.get("Sec-WebSocket-Extensions") is None
            async with await ws.open_channel(url, FP, max_frame_bytes=LIMIT) as ch:
                assert ch.ws.protocol.extensions == [] and "Sec-WebSocket-Extensions" not in ch.ws.request.headers
    run(main())


@pytest.mark.parametrize("ending", ["bad_frame", "handler_returns", "channel_close"])
def test_close_is_prompt_while_the_peer_still_sends(ending):
    """A server whose incoming queue is full (`max_queue=1`, as the slide service's) closes a
    connection in well under websockets' 10 s close timeout: after a bad frame, when its handler
    returns, and on `ServerChannel.close()`, while the client has sent frames the server will never
    read. (Reading pauses when the queue is full, so the peer's close frame would not be read and
    the close would wait the 10 s out.)"""
    import time

    async def handler(channel):
        if ending == "bad_frame":
            async for _ in channel:
                pass
        elif ending == "handler_returns":
            await channel.recv()  # reads one message, then returns with the rest unread
        else:
            await channel.recv()
            await channel.close()

    async def main():
        server = await ws.serve(handler, "127.0.0.1", 0, expected_fingerprint=FP, max_frame_bytes=LIMIT, max_queue=1)
        try:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ch = await ws.open_channel(url, FP, max_frame_bytes=LIMIT)
            t0 = time.monotonic()
            if ending == "bad_frame":
                await ch.ws.send(b"\xc1 not msgpack")
            for i in range(8):  # messages for the handler, more than the server's queue holds
                with contextlib.suppress(ConnectionClosed):
                    await ch.ws.send(encode(Cancel(request_id=f"r{i}")))
            with pytest.raises(RelayInferError):
                while True:
                    await ch.recv()
            await ch.ws.wait_closed()
            return time.monotonic() - t0, ch.ws.close_code
        finally:
            server.close()
            await server.wait_closed()

    elapsed, code = run(main(), timeout=30.0)
    assert elapsed < 3.0, f"the close took {elapsed:.1f} s"
    assert code == (1002 if ending == "bad_frame" else 1000)
