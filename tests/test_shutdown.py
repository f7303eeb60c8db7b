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


def _descendants(pid: int) -> list[str]:
    """Command lines of the processes below `pid` (from /proc)."""
    import os

    parent, cmd = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += [cmd.get(c, "") for c in kids]
        todo += kids
    return out


def test_cloud_serve_stops_on_sigterm_while_it_loads():
    """A SIGTERM before the service is up (here: while the model loads) stops it as one after:
    exit 0 and one line saying so, not death by the signal."""
    proc, _, lines = sd.serve(["cloud", "serve", "--port", "0", "--http-port", "0"], ready="loading the model")
    code, _ = sd.stop(proc, signal.SIGTERM, 60)
    assert code == 0, (code, "".join(lines[-20:]))
    assert any("stopped by SIGTERM before the cloud service was up" in ln for ln in lines), "".join(lines[-20:])


@pytest.mark.slow
def test_pd_serve_stops_on_sigterm_once_ray_runs_before_it_is_up():
    """`pd serve` sent SIGTERM after its local Ray started, while its actors start: exit 0 with one
    line (not Ray's stack dump and abort, not Ray's exit 15), and no Ray process left."""
    import subprocess
    import time

    proc = subprocess.Popen([sd.BIN, "pd", "serve", "--port", "0", "--http-port", "0", "--no-export",
                             "--duration-s", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t_end = time.monotonic() + 180
        while not any("raylet" in c for c in _descendants(proc.pid)):
            assert proc.poll() is None and time.monotonic() < t_end, "no raylet came up"
            time.sleep(0.2)
        kids = _descendants(proc.pid)
        code, _ = sd.stop(proc, signal.SIGTERM, 60)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and "stopped by SIGTERM before the P/D service was up" in out, (code, out[-2000:])
    assert "*** SIGTERM received" not in out, out[-2000:]
    time.sleep(3)
    assert not any("raylet" in c or "gcs_server" in c for c in _descendants(1) if c in kids), kids
