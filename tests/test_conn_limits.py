"""Connection limits on every port (protocol/transport/limits.py): request-head timeout (slowloris), caps on
open connections in all and per client address at accept (503 + Retry-After), sessions counted at
the websocket upgrade (not at Hello), and accept() errors logged once per interval."""
from __future__ import annotations

import asyncio
import logging
import types

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.transport.limits import ConnectionGate, ConnectionLimits, is_loopback, quiet_accept_errors
from relayinfer.protocol.messages import Error, decode

FP = "f" * 64


def fake_engine():
    """What CloudService reads of an engine without serving a Generate (connection tests only)."""
    return types.SimpleNamespace(context_length=2048, cfg=types.SimpleNamespace(vocab_size=49152, kv_bytes_per_token=46080),
                                 warmup=lambda: None)


def run(coro, timeout=90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def started(**kw):
    from relayinfer.cloud.serve.service import CloudService

    svc = CloudService(fake_engine(), FP, **kw)
    await svc.start("127.0.0.1", 0, 0)
    return svc


async def http_get(port: int, path: str = "/healthz") -> tuple[int, dict, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(r.read(), 20)
    w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


async def gate_drained(gate, polls: int = 200) -> None:
    """Wait (bounded: `polls` x 20 ms) until the gate counts no open connection."""
    for _ in range(polls):
        if gate.open == 0:
            return
        await asyncio.sleep(0.02)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """The bytes the server sent before closing, or None if still open after `seconds` (a close
    that reaches the client as a reset, the server having left our unread bytes, is a close too)."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except asyncio.TimeoutError:
        return None
    except ConnectionResetError:
        return b""


def test_slowloris_closed_after_header_timeout_while_healthz_answers():
    async def main():
        svc = await started(limits=ConnectionLimits(header_timeout_s=1.0))
        try:
            conns = [await asyncio.open_connection("127.0.0.1", svc.http_port) for _ in range(30)]
            head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200
            closed = [False] * len(conns)
            for i in range(40):  # one header byte per socket every 0.1 s: 4 s, four header timeouts
                for k, (r, w) in enumerate(conns):
                    if not closed[k]:
                        try:
                            w.write(head[i:i + 1])
                        except Exception:
                            closed[k] = True
                await asyncio.sleep(0.1)
                if i == 5:  # meanwhile a real client is served
                    status, _, body = await http_get(svc.http_port)
                    assert status == 200 and b'"ok"' in body
                for k, (r, w) in enumerate(conns):
                    closed[k] = closed[k] or r.at_eof()
            got = await asyncio.gather(*(closed_within(r, 5) for r, _ in conns))
            assert all(g is not None for g in got), "a slow request head was still open"
            assert svc.gate.timed_out == 30 and svc.gate.open == 0
            status, _, _ = await http_get(svc.http_port)
            assert status == 200
            for _, w in conns:
                w.close()
        finally:
            await svc.stop()
    run(main())


def test_connection_caps_total_and_per_client_answer_503_with_retry_after():
    async def main():
        svc = await started(limits=ConnectionLimits(max_connections=6, max_connections_per_client=4,
                                                    header_timeout_s=30, retry_after_s=7))
        try:
            held = [await asyncio.open_connection("127.0.0.1", svc.http_port) for _ in range(4)]
            for _ in range(100):
                if svc.gate.open == 4:
                    break
                await asyncio.sleep(0.02)
            assert svc.gate.per_client == {"127.0.0.1": 4}
            status, headers, body = await http_get(svc.http_port)  # the 5th from 127.0.0.1: HTTP port
            assert status == 503 and headers["Retry-After"] == "7" and b"per client" in body
            with pytest.raises(InvalidStatus) as e:  # the websocket port shares the gate
                await connect(f"ws://127.0.0.1:{svc.ws_port}", open_timeout=10)
            assert e.value.response.status_code == 503
            # another client address (127.0.0.2 is loopback too) fits until the total cap of 6
            others = [await asyncio.open_connection("127.0.0.1", svc.http_port, local_addr=("127.0.0.2", 0))
                      for _ in range(2)]
            for _ in range(100):
                if svc.gate.open == 6:
                    break
                await asyncio.sleep(0.02)
            r, w = await asyncio.open_connection("127.0.0.1", svc.http_port, local_addr=("127.0.0.3", 0))
            reply = await closed_within(r, 10)
            assert reply.startswith(b"HTTP/1.1 503") and b"limit of 6 open connections" in reply
            w.close()
            for _, w in held:
                w.close()
            for _, o in others:
                o.close()
            await gate_drained(svc.gate)
            assert svc.gate.open == 0 and svc.gate.per_client == {} and svc.gate.refused == 3
            status, _, _ = await http_get(svc.http_port)
            assert status == 200
        finally:
            await svc.stop()
    run(main())


def test_sessions_counted_at_the_upgrade_not_at_hello():
    async def main():
        svc = await started(max_sessions=4, retry_after_ms=2500.0, limits=ConnectionLimits(header_timeout_s=30))
        try:
            silent = [await connect(svc.url, open_timeout=10) for _ in range(4)]  # upgraded, no Hello
            for _ in range(100):
                if svc.num_sessions == 4:
                    break
                await asyncio.sleep(0.02)
            assert svc.num_sessions == 4
            with pytest.raises(RemoteError) as e:  # the 5th is refused even though none said Hello
                await proto_ws.open_channel(svc.url, FP)
            assert e.value.code is ErrorCode.OVERLOADED and e.value.retry_after_ms == 2500.0
            extra = await connect(svc.url, open_timeout=10)  # a raw 5th websocket gets the Error frame at once
            err = decode(await asyncio.wait_for(extra.recv(), 10))
            assert isinstance(err, Error) and err.code == "overloaded"
            await extra.close()
            for ws in silent:
                await ws.close()
            for _ in range(200):
                if svc.num_sessions == 0:
                    break
                await asyncio.sleep(0.02)
            assert svc.num_sessions == 0
            ch = await proto_ws.open_channel(svc.url, FP)  # room again
            await ch.close()
        finally:
            await svc.stop()
    run(main())


def test_silent_websocket_is_dropped_after_the_hello_bound():
    async def main():
        svc = await started(limits=ConnectionLimits(header_timeout_s=1.0))
        try:
            r, w = await asyncio.open_connection("127.0.0.1", svc.ws_port)  # never finishes the upgrade
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            assert await closed_within(r, 10) is not None
            ws = await connect(svc.url, open_timeout=10)  # upgraded, never says Hello
            err = decode(await asyncio.wait_for(ws.recv(), 10))
            assert err.code == "handshake_required" and "1.0 s" in err.message
            w.close()
            for _ in range(200):
                if svc.num_sessions == 0 and svc.gate.open == 0:
                    break
                await asyncio.sleep(0.02)
            assert svc.num_sessions == 0 and svc.gate.open == 0
        finally:
            await svc.stop()
    run(main())


def test_accept_errors_logged_once_per_interval(caplog):
    async def main():
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop, interval_s=3600)
        with caplog.at_level(logging.WARNING, logger="relayinfer.limits"):
            for _ in range(500):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
        return [r for r in caplog.records if r.name == "relayinfer.limits"]
    records = run(main())
    assert len(records) == 1 and "Too many open files" in records[0].getMessage()


def test_limits_validated_and_loopback():
    with pytest.raises(ValueError, match="max_connections_per_client must be >= 1"):
        ConnectionLimits(max_connections_per_client=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(header_timeout_s=0)
    assert ConnectionGate().limits == ConnectionLimits()
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.5", "::1", "localhost", "0.0.0.0", "::", "", "10.0.0.1",
                                     "example.com")] == [True, True, True, True, False, False, False, False, False]


def test_tls_handshakes_are_counted_at_accept_and_bounded():
    """A TLS handshake that never finishes holds a gate slot from the accept on (the cap refuses
    the ones beyond it) and is closed after the header timeout; real TLS clients are then served on
    both ports."""
    import ssl

    trustme = pytest.importorskip("trustme")
    from relayinfer.protocol.transport.security import server_context

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    client = ssl.create_default_context()
    ca.configure_trust(client)

    async def main():
        from relayinfer.cloud.serve.service import CloudService

        svc = CloudService(fake_engine(), FP, limits=ConnectionLimits(max_connections_per_client=3,
                                                                      header_timeout_s=2.0))
        with leaf.cert_chain_pems[0].tempfile() as cert, leaf.private_key_pem.tempfile() as key:
            await svc.start("127.0.0.1", 0, 0, ssl=server_context(cert, key))
        try:
            for port in (svc.http_port, svc.ws_port):
                silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]  # no ClientHello
                for _ in range(200):
                    if svc.gate.open == 3:
                        break
                    await asyncio.sleep(0.02)
                assert svc.gate.open == 3 and svc.gate.per_client == {"127.0.0.1": 3}
                r, w = await asyncio.open_connection("127.0.0.1", port)  # the 4th: closed at accept
                assert await closed_within(r, 10) == b""
                w.close()
                got = await asyncio.gather(*(closed_within(r, 20) for r, _ in silent))
                assert all(g == b"" for g in got), "an unfinished TLS handshake was still open"
                for _, w in silent:
                    w.close()
                await gate_drained(svc.gate)
                assert svc.gate.open == 0 and not svc.gate.handshakes
            assert svc.gate.refused == 2 and svc.gate.tls_failed == 6
            r, w = await asyncio.open_connection("127.0.0.1", svc.http_port, ssl=client)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = await asyncio.wait_for(r.read(), 20)
            assert reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply
            w.close()
            ch = await proto_ws.open_channel(svc.url, FP, ssl=client)
            assert svc.num_sessions == 1
            await ch.close()
            r, w = await asyncio.open_connection("127.0.0.1", svc.ws_port)  # a handshake under way at the stop
            for _ in range(200):
                if svc.gate.handshakes:
                    break
                await asyncio.sleep(0.02)
            assert len(svc.gate.handshakes) == 1
        finally:
            await svc.stop()
        assert await closed_within(r, 10) == b"" and not svc.gate.handshakes and svc.gate.open == 0
        w.close()
    run(main())


def test_keepalive_connection_idling_between_requests_is_closed():
    async def main():
        svc = await started(limits=ConnectionLimits(idle_timeout_s=1.0, header_timeout_s=30))
        try:
            r, w = await asyncio.open_connection("127.0.0.1", svc.http_port)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive (HTTP/1.1's default)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)
            assert head.startswith(b"HTTP/1.1 200")
            n = int(next(h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")).split(":")[1])
            await asyncio.wait_for(r.readexactly(n), 20)
            w.write(b"GET /heal")  # half a second head, then nothing: the idle bound closes it too
            assert await closed_within(r, 20) == b""
            w.close()
            await gate_drained(svc.gate)
            assert svc.gate.open == 0
        finally:
            await svc.stop()
    run(main())


def test_stalled_request_body_gets_408_and_the_connection_closes(torch_engine):
    """A POST whose head arrived but whose body stops half-way is answered 408 once the body bound
    (idle_timeout_s) passed, and its connection is closed; the slot is free again."""
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.serve.service import CloudService

    async def main():
        llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=8 << 20))
        svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm,
                           limits=ConnectionLimits(idle_timeout_s=1.5, header_timeout_s=30))
        await svc.start("127.0.0.1", 0, 0)
        try:
            body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
            r, w = await asyncio.open_connection("127.0.0.1", svc.http_port)
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body) + 100, body))  # 100 bytes never come
            reply = await closed_within(r, 30)
            assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
            assert b"did not arrive within 1.5 s" in reply
            w.close()
            await gate_drained(svc.gate)
            assert svc.gate.open == 0
        finally:
            await svc.stop()
    run(main(), timeout=180)
