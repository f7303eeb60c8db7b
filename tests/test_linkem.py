"""The link-emulating proxy (`sdk.linkem`) on plain TCP: delay, bandwidth cap, loss stalls, cut,
black-hole, counters. Fast, no model. Servers on 127.0.0.1, stopped by each test."""
from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from relayinfer.sdk.linkem import PROFILES, LinkProfile, LinkProxy, LinkProxyProcess, LinkProxyThread, get_profile

T = 20.0  # bound (s) on every async test body


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, T))


async def echo_server():
    """An asyncio echo server on 127.0.0.1; returns (server, port, stats)."""
    stats = {"connections": 0, "eof": 0, "bytes": 0}

    async def handle(r, w):
        stats["connections"] += 1
        try:
            while data := await r.read(65536):
                stats["bytes"] += len(data)
                w.write(data)
                await w.drain()
            stats["eof"] += 1
        except ConnectionError:
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], stats


async def source_server(payload: bytes):
    """Sends `payload` to each client, then closes; returns (server, port, received) where received
    collects what clients send up (per connection, bytes) once they close."""
    received: list[bytes] = []

    async def handle(r, w):
        w.write(payload)
        await w.drain()
        got = bytearray()
        while data := await r.read(65536):
            got += data
        received.append(bytes(got))
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], received


async def read_all(r: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while data := await r.read(65536):
        out += data
    return bytes(out)


async def ping(r, w, msg: bytes) -> float:
    """Round trip (ms) of `msg` through an echo."""
    t = time.perf_counter()
    w.write(msg)
    await w.drain()
    assert await r.readexactly(len(msg)) == msg
    return (time.perf_counter() - t) * 1e3


def test_profiles_are_sourced_and_valid():
    assert set(PROFILES) == {"loopback", "wifi", "lte", "lossy"}
    lte, lossy, wifi = PROFILES["lte"], PROFILES["lossy"], PROFILES["wifi"]
    assert 50 <= 2 * lte.delay_ms + lte.jitter_ms <= 90 and lte.down_bytes_per_s > lte.up_bytes_per_s
    assert 10 <= 2 * wifi.delay_ms + wifi.jitter_ms <= 30 and wifi.down_bytes_per_s > lte.down_bytes_per_s
    assert lossy.loss == 0.02 and lossy.delay_ms == lte.delay_ms and lossy.rto_ms >= 200
    assert get_profile("lte") is lte
    assert not PROFILES["loopback"].shapes and all(PROFILES[n].shapes for n in ("wifi", "lte", "lossy"))
    assert LinkProfile(jitter_ms=1.0).shapes and LinkProfile(up_bytes_per_s=1e6).shapes
    with pytest.raises(ValueError, match="unknown link profile"):
        get_profile("5g")
    with pytest.raises(ValueError):
        LinkProfile(loss=1.5)
    with pytest.raises(ValueError):
        LinkProfile(down_bytes_per_s=0)
    with pytest.raises(ValueError):
        LinkProxy("ws://127.0.0.1", "lte")  # no port


def test_delay_and_jitter_add_to_the_round_trip():
    async def main():
        srv, port, _ = await echo_server()
        prof = LinkProfile(delay_ms=40.0, jitter_ms=20.0)
        proxy = LinkProxy(("127.0.0.1", port), prof, seed=1)
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            direct = [await ping(r, w, b"x" * 32) for _ in range(5)]
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            via = [await ping(r, w, b"y" * 32) for _ in range(10)]
            w.close()
        finally:
            await proxy.close()
            srv.close()
        return direct, via

    direct, via = run(main())
    # each way 40 ms + U[0, 20] ms: 80..120 ms per round trip, plus scheduling slack; a loaded machine
    # only adds to a round trip, so the lower bound is exact and the upper ones are for the median
    assert min(via) >= 80.0, via
    assert sorted(via)[len(via) // 2] <= 120.0 + 150.0 + sorted(direct)[len(direct) // 2], (via, direct)
    assert max(via) - min(via) > 2.0  # jitter draws differ


def test_bandwidth_cap_bounds_throughput_each_way():
    rate, n = 400_000.0, 600_000  # bytes/s, bytes: 1.5 s at the cap

    async def main():
        payload = bytes(range(256)) * (n // 256)
        srv, port, received = await source_server(payload)
        prof = LinkProfile(down_bytes_per_s=rate, up_bytes_per_s=rate / 2, burst_bytes=16384)
        proxy = LinkProxy(("127.0.0.1", port), prof)
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            t = time.perf_counter()
            got = await r.readexactly(len(payload))
            down_s = time.perf_counter() - t
            up = b"u" * (n // 2)
            t = time.perf_counter()
            w.write(up)
            await w.drain()
            w.write_eof()
            rest = await read_all(r)  # the server closes after it has read everything we sent
            up_s = time.perf_counter() - t
            w.close()
        finally:
            await proxy.close()
            srv.close()
        return payload, got, down_s, up, up_s, received, rest, proxy.counters()

    payload, got, down_s, up, up_s, received, rest, c = run(main())
    assert got == payload and rest == b"" and received == [up]
    lower = (len(payload) - 16384) / rate  # the bucket's burst goes at once
    # the cap is a lower bound on the time; the upper bounds only catch a cap several times too strict
    # (a loaded machine makes the transfer slower, never faster)
    assert down_s >= 0.95 * lower, down_s
    assert down_s <= 3.0 * lower + 5.0, down_s
    lower_up = (len(up) - 16384) / (rate / 2)
    assert up_s >= 0.95 * lower_up, up_s
    assert up_s <= 3.0 * lower_up + 5.0, up_s
    assert c["bytes_down"] == len(payload) and c["bytes_up"] == len(up) and c["connections"] == 1


def test_cut_after_n_bytes_delivers_exactly_n_then_eof():
    async def main():
        payload = bytes(range(256)) * 400  # 102,400 bytes
        srv, port, _ = await source_server(payload)
        proxy = LinkProxy(("127.0.0.1", port), "loopback", cut_after_bytes=12_345, cut_direction="down")
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            got = await read_all(r)  # ends at EOF
            w.close()
            for _ in range(100):  # the proxy forgets the connection (bounded wait)
                if proxy.active == 0:
                    break
                await asyncio.sleep(0.02)
        finally:
            await proxy.close()
            srv.close()
        return payload, got, proxy.counters()

    payload, got, c = run(main())
    assert got == payload[:12_345]
    assert c["bytes_down"] == 12_345 and c["cuts"] == 1 and c["active"] == 0 and c["connections"] == 1


def test_cut_after_n_bytes_up():
    async def main():
        srv, port, received = await source_server(b"")
        proxy = LinkProxy(("127.0.0.1", port), None, cut_after_bytes=1000, cut_direction="up")
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            w.write(b"z" * 5000)
            await w.drain()
            assert await read_all(r) == b""  # the cut closes our side too
            w.close()
            for _ in range(100):
                if received:
                    break
                await asyncio.sleep(0.02)
        finally:
            await proxy.close()
            srv.close()
        return received, proxy.counters()

    received, c = run(main())
    assert received == [b"z" * 1000] and c["bytes_up"] == 1000 and c["cuts"] == 1


def test_loss_stalls_with_the_configured_probability():
    p, rto, n = 0.1, 60.0, 100

    async def main():
        srv, port, _ = await echo_server()
        proxy = LinkProxy(("127.0.0.1", port), LinkProfile(loss=p, rto_ms=rto), seed=7)
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            rtts = [await ping(r, w, b"%03d" % i * 16) for i in range(n)]  # one 48-byte segment each way
            w.close()
        finally:
            await proxy.close()
            srv.close()
        return rtts, proxy.counters()

    rtts, c = run(main())
    stalls = c["loss_stalls_up"] + c["loss_stalls_down"]
    # 2n = 200 segments at p = 0.1: 20 expected; binomial 99.9 % range ~7..36
    assert 7 <= stalls <= 36, c
    assert c["loss_stalls_up"] > 0 and c["loss_stalls_down"] > 0
    slow = sum(1 for x in rtts if x >= 0.95 * rto)
    # every stall makes its round trip slow (a round trip can hold two)
    assert stalls / 2 <= slow <= stalls, (slow, c)
    assert sorted(rtts)[n // 2] < rto / 2  # the median round trip has no stall
    assert c["bytes_up"] == c["bytes_down"] == 48 * n


class _EchoThread:
    """A blocking echo server in a thread (for the sync LinkProxyThread test)."""

    def __init__(self):
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.conn_closed_by_peer = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(15)
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
                self.conn_closed_by_peer = True
            except OSError:
                self.conn_closed_by_peer = True

    def close(self):
        self.sock.close()
        self.thread.join(20)


def test_blackhole_times_out_reads_keeps_sockets_open_and_close_frees_them():
    echo = _EchoThread()
    try:
        with LinkProxyThread(("127.0.0.1", echo.port), PROFILES["wifi"]) as proxy:
            c = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            c.settimeout(2)
            c.sendall(b"hello")
            assert c.recv(100) == b"hello"
            proxy.blackhole()  # from this (non-loop) thread
            assert proxy.blackholed
            c.sendall(b"into the void")
            c.settimeout(0.7)
            with pytest.raises(socket.timeout):
                c.recv(100)
            # sockets stay open: the proxy holds the connection, the server has not seen EOF
            assert proxy.active == 1 and echo.conn_closed_by_peer is None
            proxy.blackhole(False)  # the held bytes go through
            c.settimeout(3)
            assert c.recv(100) == b"into the void"
            proxy.blackhole()
        # leaving the context closes every connection it holds, even a black-holed one
        c.settimeout(60)  # a bound, not a speed: the close reaches the client (EOF or reset), nothing hangs
        try:
            assert c.recv(100) == b""
        except ConnectionResetError:
            pass
        c.close()
        echo.thread.join(5)
        assert echo.conn_closed_by_peer is True
        assert proxy.counters()["bytes_up"] == proxy.counters()["bytes_down"] == len(b"hello" + b"into the void")
    finally:
        echo.close()


def test_cut_now_closes_open_connections_and_counts():
    async def main():
        srv, port, stats = await echo_server()
        proxy = LinkProxy(("127.0.0.1", port), None)
        await proxy.start()
        try:
            conns = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(3)]
            for r, w in conns:
                await ping(r, w, b"ok")
            assert proxy.active == 3
            assert proxy.cut() == 3
            eofs = [await asyncio.wait_for(r.read(10), 2) for r, _ in conns]
            for _, w in conns:
                w.close()
            for _ in range(100):
                if stats["eof"] == 3:
                    break
                await asyncio.sleep(0.02)
        finally:
            await proxy.close()
            srv.close()
        return eofs, proxy.counters(), stats

    eofs, c, stats = run(main())
    assert eofs == [b""] * 3 and stats["eof"] == 3
    assert c["connections"] == 3 and c["cuts"] == 3 and c["active"] == 0 and c["bytes_up"] == c["bytes_down"] == 6


def test_unreachable_upstream_closes_the_client():
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        proxy = LinkProxy(("127.0.0.1", port), None, connect_timeout_s=1.0)
        await proxy.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            got = await asyncio.wait_for(r.read(10), 3)
            w.close()
        finally:
            await proxy.close()
        return got, proxy.counters()

    got, c = run(main())
    assert got == b"" and c["connections"] == 1 and c["bytes_down"] == 0


def test_proxies_in_their_own_process_shape_the_link_and_report_counters():
    """`LinkProxyProcess`: two proxies on one loop in a child process pinned to a core (the hand-off
    bench's emulator, kept out of the device's process); the shaped one adds its 2 x 40 ms to a
    round trip, the other does not, and each one's counters come back when it stops."""
    up = socket.create_server(("127.0.0.1", 0))  # the upstream listens before the fork; served below
    port, core = up.getsockname()[1], min(os.sched_getaffinity(0))
    proc = LinkProxyProcess({"slow": (("127.0.0.1", port), LinkProfile(delay_ms=40.0)),
                             "plain": (("127.0.0.1", port), "loopback")}, core, life_s=60.0)
    with up, proc as urls:
        assert set(urls) == {"slow", "plain"} and urls["slow"] != urls["plain"]
        assert proc.pid != os.getpid() and os.sched_getaffinity(proc.pid) == {core}
        rtt = {}
        for name, url in urls.items():
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as c:
                up.settimeout(10)
                s, _ = up.accept()
                with s:
                    t = time.perf_counter()
                    c.sendall(b"x" * 100)
                    got = b""
                    while len(got) < 100:
                        got += s.recv(100)
                    s.sendall(got)
                    back = b""
                    while len(back) < 100:
                        back += c.recv(100)
                    rtt[name] = (time.perf_counter() - t) * 1e3
                    assert back == b"x" * 100
    assert rtt["slow"] >= 80.0 and rtt["plain"] < rtt["slow"], rtt
    with pytest.raises(ProcessLookupError):  # stopped and reaped on exit
        os.kill(proc.pid, 0)
    for name in urls:
        assert (proc.counters[name]["bytes_up"], proc.counters[name]["bytes_down"]) == (100, 100), proc.counters
        assert proc.counters[name]["connections"] == 1
    with pytest.raises(ValueError, match="unknown link profile"):
        LinkProxyProcess({"x": (("127.0.0.1", port), "5g")})  # refused before any fork
    for bad in (("127.0.0.1", 0), ("127.0.0.1", 70000), ("", port), ("127.0.0.1", "80"), ("127.0.0.1", True),
                ["127.0.0.1", port], ("127.0.0.1",)):
        with pytest.raises(ValueError, match="a \\(host, port\\) pair with a port in 1..65535"):
            LinkProxyProcess({"x": (bad, "lte")})  # before the fork, not per connection in the child


def test_bench_link_summary_counts_fallbacks_and_ratios():
    from relayinfer.sdk.cli import bench_module

    split = bench_module("split")  # the driver lives in bench/
    _link_summary, _mode_summary = split._link_summary, split._mode_summary

    def row(mode, fault, ttft):
        return {"mode": mode, "fault": fault, "ttft_ms": ttft, "shown_ms": [ttft, ttft + 100.0, ttft + 250.0],
                "target_len": 64, "stalls": 1, "cloud_streamed": 3, "cloud_tokens": 3, "cloud_busy_ms": 10.0,
                "device_prefill_ms": 0.0, "device_prompt_tokens": 10, "cloud_prefill_ms": None}

    modes = {"device-only": _mode_summary([row("device-only", None, 1000.0), row("device-only", None, 3000.0)], 50.0),
             "split": _mode_summary([row("split", "connection-lost", 500.0), row("cloud-only", None, 700.0),
                                     row("device-only", "cloud-unreachable", 900.0)], 50.0)}
    s = _link_summary(modes)["split"]
    assert s["fallbacks"] == 2  # network faults; cloud to the end is a planned outcome (fault None), not a fallback
    assert s["faults"] == {"connection-lost": 1, "cloud-unreachable": 1}
    assert s["result_modes"] == {"split": 1, "cloud-only": 1, "device-only": 1}
    assert s["ttft_p50_over_device_only"] == pytest.approx(700.0 / 2000.0)
    assert s["tpot_ms_p50"] == pytest.approx(125.0) and s["tpot_ms_max"] == pytest.approx(150.0) and s["stalls"] == 3
