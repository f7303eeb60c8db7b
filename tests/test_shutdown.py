"""`relayinfer cloud serve` as a supervisor runs it (a subprocess on free loopback ports): after HTTP
and websocket requests, with idle connections of every kind still open (raw TCP, upgraded websockets
without a Hello, a half-sent frame, an idle keep-alive, half a request head), SIGINT or SIGTERM stop it
with exit code 0 within a bound; `relay serve` and `patho serve` the same way; an engine that
fails (the documented RELAYINFER_TEST_ENGINE_FAULT hook) makes /healthz answer 503 with the reason
and the process exit with code 3. The large run (thousands of requests) is bench/shutdown.py."""
from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

import pytest

from relayinfer.sdk.cli import bench_module

sd = bench_module("shutdown")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cloud_serve_stops_on_signal_after_requests(sig):
    proc, ws, http, lines = sd.cloud_serve(["--kv-cache-mb", "32", "--max-queue-wait-ms", "1e9"])

    async def load_then_stop():
        counts = await sd.load(http, ws, 40, 40, concurrency=4, timeout_s=300)
        held = await sd.hold_idle(int(ws.rsplit(":", 1)[1]), int(http.rsplit(":", 1)[1]))  # open through the stop
        return counts, await asyncio.to_thread(sd.stop, proc, sig, 60)
    try:
        counts, (code, exit_s) = asyncio.run(load_then_stop())
    except BaseException:
        proc.kill()
        raise
    assert counts["http_ok"] == 40 and counts["ws_ok"] + counts["ws_err"] == 40 and counts["ws_ok"] > 0, counts
    assert code == 0, (code, exit_s, "".join(lines[-20:]))  # None: still running 60 s after the signal, killed


def test_cloud_serve_exits_3_when_its_engine_fails():
    proc, ws, http, lines = sd.cloud_serve(["--kv-cache-mb", "32"], env={"RELAYINFER_TEST_ENGINE_FAULT": "1"})
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
        req = urllib.request.Request(http + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 500 and "engine thread failed" in json.loads(e.value.read())["error"]["message"]
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert code == 3, text[-2000:]
    start = next(ln for ln in lines if ln.startswith("cloud service:"))  # what runs where, said at start
    assert "model smollm2-135m-instruct " in start and "device cpu  dtype float32" in start, start
    assert "engine failed: EngineFailed" in text and "exiting with code 3" in text


def _rank_flood(port: int, fp: str, n: int) -> "asyncio.Future":
    """Open a channel to a relay instance and send `n` Rank requests without waiting for answers."""
    from relayinfer.protocol.messages import Rank
    from relayinfer.protocol.transport import ws as proto_ws

    async def flood():
        ch = await proto_ws.open_channel(f"ws://127.0.0.1:{port}", fp, open_timeout=60)
        for i in range(n):
            await ch.send(Rank(request_id=f"r{i}", user_id=1 + i % 900, item_ids=list(range(1, 201)),
                               timestamps=list(range(1, 201)), candidate_ids=list(range(300, 400))))
        return ch
    return flood()


@pytest.mark.parametrize("server", ["relay", "patho"])
def test_relay_and_patho_serve_stop_on_sigterm_with_connections_open(server):
    if server == "relay":
        proc, line, lines = sd.serve(["relay", "serve", "--port", "0"], ready="READY", timeout_s=600)
        port, fp = int(line.split()[1]), line.split()[2]
    else:
        proc, line, lines = sd.serve(["patho", "serve", "--port", "0", "--arch", "vit-tiny-test"],
                                     ready="patho service:", timeout_s=600)
        port, fp = sd.ports_of(line)[0], None

    async def hold_then_stop():
        held = await sd.hold_idle(port)
        busy = await _rank_flood(port, fp, 300) if fp else None  # rankings queued on the compute thread
        code_s = await asyncio.to_thread(sd.stop, proc, signal.SIGTERM, 60)
        return code_s, held, busy
    try:
        (code, exit_s), _, _ = asyncio.run(hold_then_stop())
    except BaseException:
        proc.kill()
        raise
    assert code == 0, (code, exit_s, "".join(lines[-20:]))  # None: still running 60 s after the signal, killed
