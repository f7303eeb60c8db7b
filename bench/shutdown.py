"""Shutdown after load: `relayinfer cloud serve` (a subprocess on 127.0.0.1, free ports) gets N cheap
requests (max_tokens 1, a short prompt) over HTTP (OpenAI chat completions, keep-alive connections)
and over the websocket (one `Generate` per session), then SIGINT or SIGTERM; the time to exit and
the exit code are measured. A server that does not exit within `kill_after_s` is killed (exit code
recorded as None).

    python bench/shutdown.py --requests 3000 --signal INT     # results in bench/results/shutdown.json

`serve(...)`, `load(...)` and `stop(...)` are also what tests/test_shutdown.py uses with a small N.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = os.path.join(os.path.dirname(sys.executable), "relayinfer")


def serve(args: list[str], ready: str = "cloud service:", timeout_s: float = 180.0, env: dict | None = None
          ) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `relayinfer ARGS` and wait (at most `timeout_s` s) for the output line (stderr or
    stdout) containing `ready`; returns (process, that line, output lines so far). A thread keeps
    draining the output into the list (so the server never blocks on a full pipe)."""
    import threading

    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines: list[str] = []
    found = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if ready in line:
                found.set()

    threading.Thread(target=drain, daemon=True).start()
    t_end = time.monotonic() + timeout_s
    while not found.wait(0.2):
        if proc.poll() is not None or time.monotonic() > t_end:
            proc.kill()
            raise RuntimeError(f"`relayinfer {' '.join(args)}` did not come up: {''.join(lines)[-2000:]}")
    return proc, next(line for line in lines if ready in line), lines


def cloud_serve(extra: list[str] = (), env: dict | None = None):
    """`relayinfer cloud serve` on free ports (port 0: the server picks them, so no other process
    can take them between a check and the bind); (process, ws URL, http URL, stderr lines)."""
    proc, line, lines = serve(["cloud", "serve", "--port", "0", "--http-port", "0", *extra], env=env)
    ws, http = ports_of(line)
    return proc, f"ws://127.0.0.1:{ws}", f"http://127.0.0.1:{http}", lines


def ports_of(line: str) -> list[int]:
    """The ports a server's start-up line names (`ws://127.0.0.1:PORT  http://127.0.0.1:PORT`)."""
    import re

    return [int(p) for p in re.findall(r"://[^\s/]+:(\d+)", line)]


async def hold_idle(ws_port: int, http_port: int | None = None, n: int = 4) -> list:
    """Connections that stay open doing nothing, of every kind a server must not wait for at
    shutdown: `n` raw TCP connections per port that never send a byte, `n` websockets that
    upgraded and never said Hello, `n` that sent the first 3 bytes of a 4,096-byte frame and
    stopped, and on the HTTP port a keep-alive connection idling after one request and one with
    half a request head. Returns them (streams and websockets) for the caller to close."""
    from websockets.asyncio.client import connect

    held: list = []
    for port in [ws_port] + ([http_port] if http_port else []):
        held += [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    held += [await connect(f"ws://127.0.0.1:{ws_port}", open_timeout=60) for _ in range(n)]
    for _ in range(n):
        c = await connect(f"ws://127.0.0.1:{ws_port}", open_timeout=60)
        c.transport.write(b"\x82\xfe\x10\x00" + b"\x00" * 4 + b"abc")  # masked binary, 4096 bytes: 3 sent
        held.append(c)
    if http_port:
        r, w = await asyncio.open_connection("127.0.0.1", http_port)
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 60)
        held.append((r, w))
        r, w = await asyncio.open_connection("127.0.0.1", http_port)
        w.write(b"GET /heal")
        held.append((r, w))
    return held


async def load(http_url: str, ws_url: str | None, n_http: int, n_ws: int, concurrency: int = 8,
               fingerprint: str | None = None, timeout_s: float = 600.0) -> dict:
    """`n_http` chat completions (max_tokens 1) on `concurrency` keep-alive connections and `n_ws`
    websocket Generates (one session each, `concurrency` at a time); counts by outcome."""
    import aiohttp

    from relayinfer.protocol.transport import ws as proto_ws
    from relayinfer.protocol.messages import Done, Error, Generate

    counts = {"http_ok": 0, "http_err": 0, "ws_ok": 0, "ws_err": 0}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    left = {"http": n_http, "ws": n_ws}

    async def http_worker(session):
        while left["http"] > 0:
            left["http"] -= 1
            try:
                async with session.post(http_url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    counts["http_ok" if r.status == 200 else "http_err"] += 1
            except aiohttp.ClientError:
                counts["http_err"] += 1

    async def ws_worker(fp):
        while left["ws"] > 0:
            left["ws"] -= 1
            try:
                async with await proto_ws.open_channel(ws_url, fp, open_timeout=30) as ch:
                    await ch.send(Generate(f"r{left['ws']}", list(range(10, 20)), 1))
                    async for m in ch:
                        if isinstance(m, (Done, Error)):
                            counts["ws_ok" if isinstance(m, Done) else "ws_err"] += 1
                            if isinstance(m, Error):
                                counts.setdefault("ws_first_error", f"{m.code}: {m.message}")
                            break
            except Exception as e:
                counts["ws_err"] += 1
                counts.setdefault("ws_first_error", f"{type(e).__name__}: {e}")

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            fp = fingerprint
            if n_ws and fp is None:
                async with session.get(http_url + "/healthz") as r:
                    fp = (await r.json())["model_fingerprint"]
            tasks = [http_worker(session) for _ in range(concurrency if n_http else 0)]
            tasks += [ws_worker(fp) for _ in range(concurrency if n_ws else 0)]
            await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    await asyncio.wait_for(main(), timeout_s)
    counts["load_s"] = round(time.perf_counter() - t0, 2)
    return counts


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, kill_after_s: float = 120.0) -> tuple[int | None, float]:
    """Send `sig`; (exit code or None if it had to be killed after `kill_after_s` s, seconds to exit)."""
    t0 = time.perf_counter()
    proc.send_signal(sig)
    try:
        code = proc.wait(kill_after_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        code = None
    return code, round(time.perf_counter() - t0, 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="requests in all (half HTTP, half websocket)")
    p.add_argument("--signal", choices=("INT", "TERM"), default="INT")
    p.add_argument("--kill-after-s", type=float, default=120.0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "shutdown.json"))
    a = p.parse_args(argv)
    proc, ws, http, lines = cloud_serve()
    try:
        counts = asyncio.run(load(http, ws, a.requests // 2, a.requests - a.requests // 2))
    except BaseException:
        proc.kill()
        raise
    code, exit_s = stop(proc, getattr(signal, "SIG" + a.signal), a.kill_after_s)
    res = {"command": "python bench/shutdown.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "requests": a.requests, "signal": a.signal, **counts, "exit_code": code, "exit_s": exit_s,
           "stderr_tail": [line.rstrip() for line in lines[-5:]]}
    print(json.dumps(res, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
