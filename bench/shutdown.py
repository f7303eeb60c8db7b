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
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = os.path.join(os.path.dirname(sys.executable), "relayinfer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], ready: str = "cloud service:", timeout_s: float = 180.0, env: dict | None = None
          ) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `relayinfer ARGS` and wait (at most `timeout_s` s) for the stderr line containing
    `ready`; returns (process, that line, stderr lines so far). A thread keeps draining stderr
    into the list (so the server never blocks on a full pipe)."""
    import threading

    proc = subprocess.Popen([BIN, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines: list[str] = []
    found = threading.Event()

    def drain():
        for line in proc.stderr:
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
    """`relayinfer cloud serve` on free ports; (process, ws URL, http URL, stderr lines)."""
    ws, http = free_port(), free_port()
    proc, _, lines = serve(["cloud", "serve", "--port", str(ws), "--http-port", str(http), *extra], env=env)
    return proc, f"ws://127.0.0.1:{ws}", f"http://127.0.0.1:{http}", lines


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
