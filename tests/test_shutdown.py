"""`relayinfer cloud serve` as a supervisor runs it (a subprocess on free loopback ports): after HTTP
and websocket requests SIGINT or SIGTERM stop it with exit code 0 within a bound; an engine that
fails (the documented RELAYINFER_TEST_ENGINE_FAULT hook) makes /healthz answer 503 with the reason
and the process exit with code 3. The large run (thousands of requests) is bench/shutdown.py."""
from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from relayinfer.sdk.cli import bench_module

sd = bench_module("shutdown")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cloud_serve_stops_on_signal_after_requests(sig):
    proc, ws, http, lines = sd.cloud_serve(["--kv-cache-mb", "32", "--max-queue-wait-ms", "1e9"])
    try:
        counts = asyncio.run(sd.load(http, ws, 40, 40, concurrency=4, timeout_s=300))
    except BaseException:
        proc.kill()
        raise
    code, exit_s = sd.stop(proc, sig, kill_after_s=60)
    assert counts["http_ok"] == 40 and counts["ws_ok"] + counts["ws_err"] == 40 and counts["ws_ok"] > 0, counts
    assert code == 0, (code, "".join(lines[-20:]))
    assert exit_s < 30, exit_s  # drain 5 s + stop slack 10 s, with margin for a loaded machine


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
    assert "engine failed: EngineFailed" in text and "exiting with code 3" in text
