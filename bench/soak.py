"""`relayinfer bench soak`: many virtual devices against one cloud service for minutes, with faults.

Set-up: one `relayinfer cloud serve` (a subprocess on 127.0.0.1 started here with a random token,
its own process so its memory can be read; or any running service given by URL). `devices`
virtual devices (asyncio tasks in this process, no model) loop until `duration_s` has passed: open
a connection (`open_channel`: websocket + Hello/Welcome), run 1-3 requests on it, close, think
`think_s` seconds, again. A request is a `Generate` of a real chitchat-dataset conversation
(chat-templated ids, at most `max_prompt_tokens` tokens), `max_new_tokens` uniform in 8..48,
`cloud_budget` None or uniform in 1..max_new_tokens, greedy or seeded sampling; it ends with the
cloud's `Done` or, for a device that takes over, with `Stop{handoff}` after a random number of
tokens and then `Done`.

With probability `fault_rate` per request the device injects one fault (`FAULTS`; every kind once
per round of len(FAULTS) faults, in a seeded random order) and checks that the server answers it as specified:

* `disconnect`: transport abort (TCP RST, no close frame) or a plain close, before the first token
  or after a few tokens. Nothing to answer; the server must free the request (checked at the end).
* `stall`: stop reading for 2-6 s after the first token, then read on to `Done` (the stream must
  still be complete) or close.
* `oversize`: a frame above the server's frame limit after the handshake (between the limit and the
  websockets margin: a real Generate answered by an `Error` frame; above the margin: raw bytes
  refused by websockets with close 1009). Must get FRAME_TOO_LARGE and a closed connection.
* `oversize_hello`: a frame above the 4 KiB handshake limit before the Hello (its own connection):
  FRAME_TOO_LARGE (an Error frame, or websockets' close 1009 above the margin); OVERLOADED when the
  server is at its session cap (it refuses before reading).
* `garbage`: random bytes (binary or text websocket message) after the handshake: BAD_FRAME or
  UNKNOWN_MESSAGE and a closed connection.
* `garbage_tcp`: random bytes on a raw TCP connection (not even HTTP): the server must close it
  within 30 s.
* `prompt_too_long`: prompt + max_new_tokens above the server's per-request limit:
  PROMPT_TOO_LONG for that request, the session stays usable (a normal request follows on it).
* `bad_token`: a token id outside the vocabulary: BAD_REQUEST, the session stays usable.
* `cancel`: `Cancel` after a few tokens: `Done` (reason "cancel", or the earlier end).
* `burst`: `max_requests_per_session + 2` Generates at once on one session: the ones above the
  cap get OVERLOADED with `retry_after_ms`, the admitted ones complete; the device then honours
  the hint by waiting that long (bounded by the run's end) before its next connection.

A refused handshake (OVERLOADED at `max_sessions`) is honoured the same way.

Checks per request (every stream, faults included, as far as it got): token indices 0, 1, 2, ...
with no gap (`tokens_lost`) and no repeat (`tokens_duplicated`); a `Done` whose `cloud_tokens`
differs from the tokens received counts the difference as lost (fewer received) or duplicated
(more). Tokens after a `Stop` are received but not shown (`tokens_shown` counts indices below the
hand-off). Must be 0 and 0. Every request message sent and received goes through the connection's
`protocol.requests.RequestTable` (device side): a violation (a gap or repeat, a miscounting `Done`,
anything after a request's end, an unknown request id) fails the request as unexpected, naming it.

Server side: RSS (`VmRSS` of /proc/<pid>/status, MiB) sampled every `sample_s` seconds; `start` is
the sample after `warmup_s`, `end` the sample after the run settled. After the run the driver waits
up to `settle_s` seconds for active sessions, active requests, KV blocks used, engine running and
waiting to reach 0 (the authorized `/healthz` details and `/metrics` gauges, both read), then checks
that `/healthz` answers 200 and the process is alive. Its stderr is scanned for tracebacks.

Bounded: devices start no request after `duration_s`; each request is abandoned after
`request_timeout_s` (an unexpected failure); all device tasks are cancelled at the hard deadline
`duration_s + grace_s` (those requests count as unexpected failures too); at most `max_requests`
Generates are sent.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ChannelClosed, ErrorCode, RelayInferError, RemoteError
from relayinfer.protocol.messages import HANDSHAKE_MAX_BYTES, Cancel, Done, Error, Generate, Stop, Token, encode
from relayinfer.protocol.requests import RequestTable, RequestViolation, Role

FAULTS = ("disconnect", "stall", "oversize", "oversize_hello", "garbage", "garbage_tcp", "prompt_too_long",
          "bad_token", "cancel", "burst")
RAW_FAULTS = ("oversize_hello", "garbage_tcp")  # on a connection of their own, below the protocol
GAUGES = {  # name in the report -> Prometheus gauge
    "sessions": "relayinfer_active_sessions", "requests": "relayinfer_active_requests",
    "kv_blocks_used": "relayinfer_engine_kv_blocks_used", "engine_running": "relayinfer_engine_running",
    "engine_waiting": "relayinfer_engine_waiting"}
EXPECTED_CODES = {  # what each fault must be answered with
    "oversize": {ErrorCode.FRAME_TOO_LARGE.value}, "oversize_hello": {ErrorCode.FRAME_TOO_LARGE.value},
    "garbage": {ErrorCode.BAD_FRAME.value, ErrorCode.UNKNOWN_MESSAGE.value},
    "prompt_too_long": {ErrorCode.PROMPT_TOO_LONG.value}, "bad_token": {ErrorCode.BAD_REQUEST.value},
    "burst": {ErrorCode.OVERLOADED.value}}


class Unexpected(Exception):
    """A request ended in a way the protocol does not specify for what the device did."""


class Overloaded(Exception):
    """The server refused a request with OVERLOADED and a back-off hint before streaming it (its
    prefill queue is full): a specified answer, which the device honours by waiting `wait_s`."""

    def __init__(self, wait_s: float):
        super().__init__(f"OVERLOADED, retry after {wait_s:.1f} s")
        self.wait_s = wait_s


# --- server process --------------------------------------------------------------------------------

def rss_mib(pid: int) -> float | None:
    """Resident set size of process `pid` (MiB, from /proc/<pid>/status VmRSS), None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ServerProcess:
    """`relayinfer cloud serve` on 127.0.0.1 (free ports, a random token passed in the environment),
    started as a subprocess with stderr in a temporary file; `start()` waits (at most
    `start_timeout_s` seconds) for its "cloud service: ws://... http://..." line."""

    def __init__(self, threads: int = 1, kv_cache_mb: int = 256, start_timeout_s: float = 240.0,
                 model: str | None = None):
        self.token = secrets.token_hex(16)
        exe = Path(sys.executable).with_name("relayinfer")
        base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "relayinfer.sdk.cli"]
        self.argv = base + ["cloud", "serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                            "--threads", str(threads), "--kv-cache-mb", str(kv_cache_mb)] + \
            (["--model", str(model)] if model is not None else [])
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = self.http_url = None
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="soak-server-", suffix=".log", delete=False)

    @property
    def command(self) -> str:
        return " ".join(self.argv[-12:] if self.argv[1] != "-m" else self.argv)

    def start(self) -> None:
        env = {**os.environ, "RELAYINFER_TOKEN": self.token, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=self.log, env=env,
                                     stdin=subprocess.DEVNULL)
        t_end = time.monotonic() + self.start_timeout_s
        while time.monotonic() < t_end:
            m = re.search(r"cloud service: (ws://\S+)\s+(http://\S+)", self.stderr())
            if m:
                self.url, self.http_url = m.group(1), m.group(2)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"cloud serve exited with {self.proc.returncode}: {self.stderr()[-2000:]}")
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"cloud serve did not start within {self.start_timeout_s} s: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (the service stops cleanly), then SIGKILL after `timeout_s` s. The exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def model_config(model=None):
    """The `ModelConfig` (vocabulary size, context length) of `model` (a GGUF path or installed name;
    None: the default model): from the export cache's config.json when there is one (instant), else
    read from the GGUF file (seconds)."""
    from relayinfer.protocol.model.model_file import (ModelConfig, model_cache_dir, open_gguf, read_config,
        resolve_model_path)

    path = resolve_model_path(model)
    cached = model_cache_dir(path) / "config.json"
    if cached.is_file():
        return ModelConfig.from_json(cached.read_text())
    return read_config(open_gguf(path))


# --- prompts ---------------------------------------------------------------------------------------

def soak_prompts(tokenizer, n: int = 200, max_prompt_tokens: int = 256, seed: int = 0) -> list[list[int]]:
    """`n` chat-templated chitchat-dataset conversations (1-6 turns, cut after a user turn) of at
    most `max_prompt_tokens` tokens, from a seeded random start."""
    from relayinfer.sdk.datasets import _chitchat, chitchat_messages

    convs, rng, out = _chitchat(), random.Random(seed), []
    i = rng.randrange(len(convs))
    for k in range(len(convs)):
        msgs = chitchat_messages(convs[(i + k) % len(convs)], rng.randint(1, 6))
        if not msgs:
            continue
        ids = tokenizer.encode_chat(msgs)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
            if len(out) >= n:
                break
    if not out:
        raise ValueError(f"no chitchat conversation fits {max_prompt_tokens} tokens")
    return out


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class SoakConfig:
    """Settings of one soak run (seconds, tokens, bytes; see the module docstring)."""

    devices: int = 100
    duration_s: float = 600.0
    fault_rate: float = 0.2
    seed: int = 0
    request_timeout_s: float = 120.0
    grace_s: float = 150.0
    think_s: tuple[float, float] = (0.2, 2.0)
    max_requests: int | None = None
    max_new_tokens: tuple[int, int] = (8, 48)
    max_prompt_tokens: int = 256
    stall_s: tuple[float, float] = (2.0, 6.0)
    warmup_s: float | None = None  # default min(60, duration_s / 10)
    settle_s: float = 30.0
    sample_s: float = 5.0
    max_requests_per_session: int = 4  # the server's cap (CloudService default)


@dataclass
class _Tally:
    """Counters of the whole run, shared by the device tasks (one event loop: no locks)."""

    generates: int = 0  # Generate messages sent (every request of a burst counts)
    connections: int = 0  # successful handshakes
    connect_failures: Counter = field(default_factory=Counter)
    handshake_overloaded: int = 0
    backoff_s: float = 0.0  # time devices waited on OVERLOADED hints
    outcomes: Counter = field(default_factory=Counter)  # completed / by_design / unexpected
    kinds: Counter = field(default_factory=Counter)  # requests by kind (normal or the fault)
    faults_injected: Counter = field(default_factory=Counter)
    faults_refused: Counter = field(default_factory=Counter)  # drawn, but the request got OVERLOADED first
    faults_answered: Counter = field(default_factory=Counter)  # answered as specified
    done_reasons: Counter = field(default_factory=Counter)
    error_codes: Counter = field(default_factory=Counter)  # Error codes the devices received
    unexpected: Counter = field(default_factory=Counter)  # grouped error texts
    unexpected_examples: list = field(default_factory=list)  # the first ones verbatim
    tokens_received: int = 0
    tokens_shown: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    stream_problems: list = field(default_factory=list)  # first few lost/duplicated cases, for the report
    ttft_ms: list = field(default_factory=list)  # normal requests
    retry_after_ms: list = field(default_factory=list)


def _group(text: str) -> str:
    """An error text with ids and numbers blanked, so equal failures group together."""
    return re.sub(r"\b[0-9a-f]{12}\b|\d+(\.\d+)?", "#", text)[:160]


class _Device:
    """One virtual device (see the module docstring)."""

    def __init__(self, idx: int, run: "_Soak"):
        self.idx, self.run, self.cfg = idx, run, run.cfg
        self.rng = random.Random(run.cfg.seed * 100_003 + idx)
        self.req_deadline = 0.0
        self.table = RequestTable(Role.DEVICE)  # the open connection's requests (protocol/requests.py)

    # -- helpers -------------------------------------------------------------------------------------
    def _prompt(self) -> list[int]:
        return self.run.prompts[self.rng.randrange(len(self.run.prompts))]

    def _generate(self, prompt=None, **over) -> Generate:
        r, lo_hi = self.rng, self.cfg.max_new_tokens
        n = r.randint(*lo_hi)
        sampled = r.random() < 0.3
        kw = dict(request_id=uuid.uuid4().hex[:12], prompt_ids=list(prompt or self._prompt()), max_new_tokens=n,
                  temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0,
                  seed=r.randrange(2**31) if sampled else None,
                  cloud_budget=None if r.random() < 0.5 else r.randint(1, n))
        kw.update(over)
        return Generate(**kw)

    async def _send(self, ch, msg) -> None:
        """Send a request message through the connection's table (a Stop/Cancel that crossed the
        request's Done is not sent)."""
        if isinstance(msg, Generate):
            if self.run.max_reached():
                raise _Exhausted()
            self.run.tally.generates += 1
        if not self.table.send(msg).ignored:
            await ch.send(msg)

    def _check(self, msg):
        """Feed a received message to the connection's table; a violation (a token gap or repeat, a
        Done miscounting the tokens, anything after a request's end, an unknown request) is an
        unexpected failure naming the request, its state and the message. Returns the message."""
        ev = self.table.receive(msg)
        if isinstance(ev, RequestViolation):
            raise Unexpected(f"protocol violation: {ev.message}")
        return msg

    async def _recv(self, ch, timeout_s: float | None = None):
        """The next message, waiting at most `timeout_s` s, and never past the request's deadline
        (`request_timeout_s` after it started) or the run's hard deadline."""
        now = time.monotonic()
        wait = timeout_s or self.cfg.request_timeout_s
        t = max(0.1, min(wait, self.req_deadline - now, self.run.hard_deadline - now))
        try:
            return await asyncio.wait_for(ch.recv(), t)
        except asyncio.TimeoutError:
            if t < wait:
                why = ("the run's hard deadline" if self.run.hard_deadline <= self.req_deadline
                       else f"the request's bound of {self.cfg.request_timeout_s:.0f} s")
                raise Unexpected(f"timeout: not finished within {why}") from None
            raise Unexpected(f"timeout: no frame from the server for {t:.0f} s") from None

    def _check_stream(self, rid: str, indices: list[int], done: Done | None, handoff: int | None) -> None:
        """Count lost / duplicated tokens of one request's stream (see the module docstring)."""
        tl = self.run.tally
        seen = set(indices)
        lost = (max(indices) + 1 - len(seen)) if indices else 0
        dup = len(indices) - len(seen)
        order = sum(1 for a, b in zip(indices, indices[1:]) if b <= a)  # out of order (not a repeat)
        if done is not None:
            diff = done.cloud_tokens - len(indices)
            lost += max(0, diff) if not lost else 0
            dup += max(0, -diff) if not dup else 0
        tl.tokens_received += len(indices)
        tl.tokens_shown += len([i for i in seen if handoff is None or i < handoff])
        tl.tokens_lost += lost
        tl.tokens_duplicated += dup
        if (lost or dup or order) and len(tl.stream_problems) < 20:
            tl.stream_problems.append({"request_id": rid, "indices": indices[:80], "lost": lost, "duplicated": dup,
                                       "out_of_order": order, "done_cloud_tokens": None if done is None else done.cloud_tokens})

    async def _stream(self, ch, g: Generate, stop_after: int | None = None, cancel_after: int | None = None,
                      stall_after: tuple[float, bool] | None = None, ttft: bool = False) -> tuple[str, Done | None]:
        """Read one request's stream to its Done. stop_after: send Stop(handoff=k) after k tokens;
        cancel_after: send Cancel after k tokens; stall_after: (seconds, close) stop reading after
        the first token, then go on (close=False) or close. Returns (how it ended, Done)."""
        rid, idx, t0, handoff, t_first = g.request_id, [], time.perf_counter(), None, None
        done, ended = None, "done"
        try:
            while True:
                try:
                    msg = await self._recv(ch)
                except Unexpected as e:
                    first = "" if t_first is None else f", first token after {t_first:.1f} s"
                    raise Unexpected(f"{e} ({len(idx)} of max {g.max_new_tokens} tokens received, "
                                     f"{time.perf_counter() - t0:.1f} s after the Generate{first}, "
                                     f"{len(g.prompt_ids)} prompt tokens)") from None
                try:
                    self._check(msg)
                except Unexpected:
                    if isinstance(msg, Token) and msg.request_id == rid:
                        idx.append(msg.index)  # counted lost / duplicated below
                    elif isinstance(msg, Done) and msg.request_id == rid:
                        done = msg  # its cloud_tokens against the tokens received, below
                    raise
                if isinstance(msg, Token) and msg.request_id == rid:
                    if not idx:
                        t_first = time.perf_counter() - t0
                        if ttft:
                            self.run.tally.ttft_ms.append(t_first * 1e3)
                    idx.append(msg.index)
                    k = len(idx)
                    if stop_after is not None and k == stop_after and handoff is None:
                        handoff = k
                        await self._send(ch, Stop(rid, k))
                    if cancel_after is not None and k == cancel_after:
                        await self._send(ch, Cancel(rid))
                        cancel_after = None
                    if stall_after is not None and k == 1:
                        secs, close = stall_after
                        await asyncio.sleep(secs)
                        if close:
                            ended = "closed"
                            return ended, None
                elif isinstance(msg, Done) and msg.request_id == rid:
                    done = msg
                    self.run.tally.done_reasons[msg.reason] += 1
                    return ended, done
                elif isinstance(msg, Error):
                    self.run.tally.error_codes[msg.code] += 1
                    if msg.code == ErrorCode.OVERLOADED.value and msg.retry_after_ms and not idx:
                        self.run.tally.retry_after_ms.append(msg.retry_after_ms)
                        raise Overloaded(msg.retry_after_ms / 1e3)
                    raise Unexpected(f"request error [{msg.code}] {msg.message}")
                else:
                    raise Unexpected(f"unexpected {type(msg).__name__} for request {rid}")
        finally:
            self._check_stream(rid, idx, done, handoff)

    def _record(self, kind: str, outcome: str, err: str | None = None) -> None:
        tl = self.run.tally
        tl.kinds[kind] += 1
        tl.outcomes[outcome] += 1
        if outcome == "unexpected":
            tl.unexpected[f"{kind}: {_group(err or '?')}"] += 1
            if len(tl.unexpected_examples) < 30:
                tl.unexpected_examples.append(f"{kind}: {err}")

    # -- one connection ----------------------------------------------------------------------------
    async def connection(self) -> float:
        """Open a session, run 1-3 requests on it (one maybe with a fault), close. Returns how long
        the device must wait before its next connection (s; an OVERLOADED hint), else 0."""
        r, run = self.rng, self.run
        try:
            ch = await asyncio.wait_for(proto_ws.open_channel(run.url, run.fingerprint, run.token,
                                                              client="relayinfer-soak", open_timeout=30.0), 40.0)
        except RemoteError as e:
            if e.code is ErrorCode.OVERLOADED:
                run.tally.handshake_overloaded += 1
                run.tally.error_codes[e.code.value] += 1
                wait = (e.retry_after_ms or 1000.0) / 1e3
                run.tally.retry_after_ms.append(e.retry_after_ms)
                run.tally.backoff_s += wait
                return wait
            run.tally.connect_failures[_group(str(e))] += 1
            return 1.0
        except (OSError, asyncio.TimeoutError, RelayInferError, Exception) as e:  # noqa: BLE001
            run.tally.connect_failures[_group(f"{type(e).__name__}: {e}")] += 1
            return 1.0
        run.tally.connections += 1
        self.table = RequestTable(Role.DEVICE)  # a fresh connection: no requests yet
        wait = 0.0
        try:
            for _ in range(r.randint(1, 3)):
                if time.monotonic() > run.soft_deadline:
                    break
                f = run.next_fault() if r.random() < self.cfg.fault_rate else None
                if f in RAW_FAULTS:
                    await self._raw_fault(f)
                    continue
                kind = f or "normal"
                if f:
                    run.tally.faults_injected[kind] += 1
                self.req_deadline = time.monotonic() + self.cfg.request_timeout_s
                try:
                    answered_before = run.tally.faults_answered[kind]
                    keep, wait = await self._request(ch, f)
                except (_Exhausted, asyncio.CancelledError):
                    raise
                except Overloaded as e:  # the queue bound: honour the hint like a refused handshake
                    self._record(kind, "overloaded")
                    if f and run.tally.faults_answered[kind] == answered_before:  # refused before the
                        # fault could happen (a follow-up normal request may be refused after it): not injected
                        run.tally.faults_injected[kind] -= 1
                        run.tally.faults_refused[kind] += 1
                    run.tally.backoff_s += e.wait_s
                    wait = e.wait_s
                    break
                except Unexpected as e:
                    self._record(kind, "unexpected", str(e))
                    break
                except Exception as e:  # noqa: BLE001  anything else is a finding too
                    self._record(kind, "unexpected", f"{type(e).__name__}: {e}")
                    break
                if not keep:
                    break
                if wait:
                    break
        finally:
            try:
                await asyncio.wait_for(ch.close(), 5.0)
            except Exception:  # noqa: BLE001  already closed / aborted
                pass
        return wait

    async def _request(self, ch, fault: str | None) -> tuple[bool, float]:
        """One request (or a burst) on an open channel. Returns (the channel is still usable, the
        back-off the device must honour in s)."""
        r, tl, kind = self.rng, self.run.tally, fault or "normal"
        if fault is None:
            g = self._generate()
            await self._send(ch, g)
            stop_after = r.randint(1, max(1, g.max_new_tokens - 1)) if r.random() < 0.4 else None
            ended, done = await self._stream(ch, g, stop_after=stop_after, ttft=True)
            self._check_done(g, done, stop_after)
            self._record(kind, "completed")
            return True, 0.0
        if fault == "disconnect":
            g = self._generate()
            await self._send(ch, g)
            after = r.choice([0, 1, 2, 3])
            got = []
            while len(got) < after:
                msg = self._check(await self._recv(ch))
                if isinstance(msg, Done):
                    break
                if isinstance(msg, Error) and msg.code == ErrorCode.OVERLOADED.value and msg.retry_after_ms and not got:
                    raise Overloaded(msg.retry_after_ms / 1e3)
                if isinstance(msg, Token):
                    got.append(msg.index)
            self._check_stream(g.request_id, got, None, None)
            if r.random() < 0.7:
                ch.ws.transport.abort()
            else:
                await asyncio.wait_for(ch.close(), 5.0)
            self._answered(fault)
            self._record(kind, "by_design")
            return False, 0.0
        if fault == "stall":
            g = self._generate(max_new_tokens=r.randint(20, 48), cloud_budget=None)
            await self._send(ch, g)
            close = r.random() < 0.5
            ended, done = await self._stream(ch, g, stall_after=(r.uniform(*self.cfg.stall_s), close))
            if not close:
                self._check_done(g, done, None)
            self._answered(fault)
            self._record(kind, "completed" if not close else "by_design")
            return not close, 0.0
        if fault == "cancel":
            g = self._generate(max_new_tokens=r.randint(16, 48), cloud_budget=None)
            await self._send(ch, g)
            ended, done = await self._stream(ch, g, cancel_after=r.randint(1, 3))
            if done is None or done.reason not in ("cancel", "eos", "length"):
                raise Unexpected(f"cancel ended with {done}")
            self._answered(fault)
            self._record(kind, "by_design")
            return True, 0.0
        if fault in ("prompt_too_long", "bad_token"):
            if fault == "prompt_too_long":
                p = self._prompt()
                if r.random() < 0.5:  # a huge answer on a real prompt
                    g = self._generate(p, max_new_tokens=self.run.context_length + 1)
                else:  # a real prompt repeated past the server's per-request limit
                    n = self.run.context_length - r.randint(1, 64)
                    g = self._generate((p * (n // len(p) + 1))[:n], max_new_tokens=r.randint(65, 128))
            else:
                p = list(self._prompt())
                p[r.randrange(len(p))] = r.choice([self.run.vocab_size, self.run.vocab_size + 12345, -1])
                g = self._generate(p)
            await self._send(ch, g)
            msg = self._check(await self._recv(ch, 30.0))
            if not (isinstance(msg, Error) and msg.request_id == g.request_id):
                raise Unexpected(f"{fault}: got {type(msg).__name__} instead of a request Error")
            tl.error_codes[msg.code] += 1
            if msg.code not in EXPECTED_CODES[fault]:
                raise Unexpected(f"{fault}: got [{msg.code}] {msg.message}")
            self._answered(fault)
            self._record(kind, "by_design")
            g2 = self._generate()  # the session must still serve a normal request
            await self._send(ch, g2)
            ended, done = await self._stream(ch, g2)
            self._check_done(g2, done, None)
            self._record("normal", "completed")
            return True, 0.0
        if fault == "oversize":
            limit = self.run.frame_limit
            if r.random() < 0.5:  # a real Generate above the limit, inside the websockets margin
                p, n = self._prompt(), limit // 3 + r.randint(16, 2000)
                while True:  # ids take 1-3 bytes each
                    g = self._generate((p * (n // len(p) + 1))[:n])
                    if len(encode(g)) > limit:
                        break
                    n = int(n * 1.25)
                self.run.tally.generates += 1
                await ch.send(g)
            else:  # raw bytes far above it: websockets refuses it before reading
                frame = os.urandom(r.randint(proto_ws.ws_max_size(limit) + 1, 1 << 20))
                await _send_raw(ch, frame)
            await self._expect_connection_error(ch, fault)
            return False, 0.0
        if fault == "garbage":
            if r.random() < 0.8:
                await _send_raw(ch, os.urandom(r.randint(1, 512)))
            else:
                await _send_raw(ch, "garbage " + secrets.token_hex(r.randint(1, 64)))
            await self._expect_connection_error(ch, fault)
            return False, 0.0
        if fault == "burst":
            cap = self.cfg.max_requests_per_session
            gs = [self._generate(max_new_tokens=r.randint(8, 24)) for _ in range(cap + 2)]
            for g in gs:
                await self._send(ch, g)
            pending = {g.request_id: g for g in gs}
            streams: dict[str, list[int]] = {rid: [] for rid in pending}
            overloaded, hint = 0, 0.0
            try:
                while pending:
                    msg = self._check(await self._recv(ch))
                    if isinstance(msg, Token) and msg.request_id in pending:
                        streams[msg.request_id].append(msg.index)
                    elif isinstance(msg, Done) and msg.request_id in pending:
                        del pending[msg.request_id]
                        tl.done_reasons[msg.reason] += 1
                        self._check_stream(msg.request_id, streams.pop(msg.request_id), msg, None)
                        self._record("burst", "completed")
                    elif isinstance(msg, Error) and msg.request_id in pending:
                        tl.error_codes[msg.code] += 1
                        if msg.code != ErrorCode.OVERLOADED.value or not msg.retry_after_ms:
                            raise Unexpected(f"burst: got [{msg.code}] {msg.message} (retry_after_ms={msg.retry_after_ms})")
                        if streams.pop(msg.request_id):
                            raise Unexpected("burst: OVERLOADED for a request that had streamed tokens")
                        del pending[msg.request_id]
                        overloaded += 1
                        hint = max(hint, msg.retry_after_ms / 1e3)
                        tl.retry_after_ms.append(msg.retry_after_ms)
                        self._record("burst", "by_design")
                    else:
                        raise Unexpected(f"burst: unexpected {type(msg).__name__}")
            finally:
                for rid, idx in streams.items():
                    self._check_stream(rid, idx, None, None)
            if overloaded == 0:
                raise Unexpected(f"burst of {len(gs)} Generates on one session: no OVERLOADED (cap {cap})")
            if len(gs) - overloaded > cap:  # fewer may be admitted when the prefill queue is full too
                raise Unexpected(f"burst: {len(gs) - overloaded} of {len(gs)} admitted, cap {cap}")
            self._answered(fault)
            tl.backoff_s += hint
            return True, hint
        raise ValueError(f"unknown fault {fault!r}")

    def _answered(self, fault: str) -> None:
        self.run.tally.faults_answered[fault] += 1

    def _check_done(self, g: Generate, done: Done | None, stop_after: int | None) -> None:
        """The Done of a normal request must be there, with a reason that fits what was asked."""
        if done is None:
            raise Unexpected("stream ended without Done")
        cap = g.max_new_tokens if g.cloud_budget is None else min(g.max_new_tokens, g.cloud_budget)
        if done.cloud_tokens > cap:
            raise Unexpected(f"Done after {done.cloud_tokens} tokens above the cap of {cap} "
                             f"(max_new_tokens {g.max_new_tokens}, cloud_budget {g.cloud_budget})")
        ok = {"eos", "length", "budget"} | ({"stop"} if stop_after is not None else set())
        if done.reason not in ok:
            raise Unexpected(f"Done reason {done.reason!r} (expected one of {sorted(ok)})")
        if done.reason == "length" and done.cloud_tokens != g.max_new_tokens:
            raise Unexpected(f"Done 'length' after {done.cloud_tokens} of {g.max_new_tokens} tokens")
        if done.reason == "budget" and done.cloud_tokens != g.cloud_budget:
            raise Unexpected(f"Done 'budget' after {done.cloud_tokens} tokens, budget {g.cloud_budget}")

    async def _expect_connection_error(self, ch, fault: str) -> None:
        """After a connection-level fault: Tokens/Done of earlier requests may still come, then an
        Error with the expected code (or its close code), then the connection must be closed."""
        tl, want = self.run.tally, EXPECTED_CODES[fault]
        t_end = time.monotonic() + 30.0
        while True:
            if time.monotonic() > t_end:
                raise Unexpected(f"{fault}: no connection error within 30 s")
            try:
                msg = await self._recv(ch, 30.0)
            except RemoteError as e:
                tl.error_codes[e.code.value] += 1
                if e.code.value not in want:
                    raise Unexpected(f"{fault}: got [{e.code.value}] {e.message}") from None
                break
            except ChannelClosed as e:
                tl.error_codes[f"closed:{e.close_code}"] += 1
                if "closed" not in want:
                    raise Unexpected(f"{fault}: connection closed ({e.close_code} {e.reason!r}) without "
                                     f"{'/'.join(sorted(want))}") from None
                break
            if isinstance(msg, Error) and msg.request_id is not None:
                tl.error_codes[msg.code] += 1  # the oversize Generate never reached validation: unexpected
                raise Unexpected(f"{fault}: request error [{msg.code}] {msg.message}")
        if not ch.session.closed:
            raise Unexpected(f"{fault}: the connection stayed open")
        self._answered(fault)
        self._record(fault, "by_design")

    async def _raw_fault(self, kind: str) -> None:
        """Faults below the protocol: an oversize frame before the Hello, or non-HTTP garbage on TCP."""
        run, tl = self.run, self.run.tally
        tl.faults_injected[kind] += 1
        try:
            if kind == "garbage_tcp":
                host, port = re.match(r"wss?://([^:/]+):(\d+)", run.url).groups()
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10.0)
                try:
                    writer.write(os.urandom(self.rng.randint(1, 2048)) + b"\r\n\r\n")
                    await writer.drain()
                    t_end = time.monotonic() + 30.0
                    while time.monotonic() < t_end:  # the server must answer (HTTP 400) and close
                        if not await asyncio.wait_for(reader.read(65536), max(0.1, t_end - time.monotonic())):
                            break
                    else:
                        raise Unexpected("garbage on TCP: the server kept the connection open 30 s")
                finally:
                    writer.close()
            else:
                from websockets.asyncio.client import connect
                from websockets.exceptions import ConnectionClosed

                ws = await asyncio.wait_for(connect(run.url, max_size=None, open_timeout=30.0), 40.0)
                try:
                    try:
                        await ws.send(os.urandom(self.rng.randint(HANDSHAKE_MAX_BYTES + 1, 256 * 1024)))
                    except ConnectionClosed:
                        pass  # refused before all of it went out: the recv below tells how
                    try:
                        frame = await asyncio.wait_for(ws.recv(), 30.0)
                    except ConnectionClosed as e:
                        if e.rcvd is None or e.rcvd.code != 1009:
                            raise Unexpected(f"oversize hello: closed with {e.rcvd} instead of 1009") from None
                        tl.error_codes[ErrorCode.FRAME_TOO_LARGE.value] += 1  # close 1009
                    else:
                        from relayinfer.protocol.messages import decode

                        msg = decode(frame)
                        if isinstance(msg, Error) and msg.code == ErrorCode.OVERLOADED.value and msg.retry_after_ms:
                            tl.handshake_overloaded += 1  # refused at the session cap before reading it: fine too
                        elif not (isinstance(msg, Error) and msg.code == ErrorCode.FRAME_TOO_LARGE.value):
                            raise Unexpected(f"oversize hello: got {msg}")
                        try:  # then the close
                            await asyncio.wait_for(ws.recv(), 10.0)
                            raise Unexpected("oversize hello: a second frame after the Error")
                        except ConnectionClosed:
                            pass
                        tl.error_codes[msg.code] += 1
                finally:
                    await asyncio.wait_for(ws.close(), 10.0)
        except Unexpected as e:
            self._record(kind, "unexpected", str(e))
            return
        except (OSError, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001
            self._record(kind, "unexpected", f"{type(e).__name__}: {e}")
            return
        self._answered(kind)
        self._record(kind, "by_design")

    # -- the device's life -------------------------------------------------------------------------
    async def life(self) -> None:
        run = self.run
        await asyncio.sleep(self.rng.uniform(0, min(5.0, self.cfg.duration_s / 10)))  # staggered start
        while time.monotonic() < run.soft_deadline and not run.max_reached():
            try:
                wait = await self.connection()
            except _Exhausted:
                return
            wait = max(wait, self.rng.uniform(*self.cfg.think_s))
            await asyncio.sleep(min(wait, max(0.0, run.soft_deadline - time.monotonic())))


async def _send_raw(ch, data: bytes | str) -> None:
    """Send one websocket message past the protocol layer; a server that already closed is fine
    (the next recv reports how)."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ch.ws.send(data)
    except ConnectionClosed:
        pass


class _Exhausted(Exception):
    """max_requests Generates have been sent."""


class _Soak:
    def __init__(self, cfg: SoakConfig, url: str, http_url: str, token: str | None, pid: int | None,
                 prompts: list[list[int]], vocab_size: int, context_length: int, frame_limit: int):
        self.cfg, self.url, self.http_url, self.token, self.pid = cfg, url, http_url, token, pid
        self.prompts, self.vocab_size, self.context_length = prompts, vocab_size, context_length
        self.frame_limit = frame_limit
        self.tally = _Tally()
        self.fingerprint = ""
        self.soft_deadline = self.hard_deadline = 0.0
        self.timeline: list[dict] = []
        self._fault_rng, self._fault_round = random.Random(cfg.seed), []

    def next_fault(self) -> str:
        """The next fault kind: every kind once per round, in a seeded random order per round (so
        a short run still injects each kind)."""
        if not self._fault_round:
            self._fault_round = list(FAULTS)
            self._fault_rng.shuffle(self._fault_round)
        return self._fault_round.pop()

    def max_reached(self) -> bool:
        return self.cfg.max_requests is not None and self.tally.generates >= self.cfg.max_requests

    async def _http(self, session, path: str) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with session.get(self.http_url + path, headers=headers) as resp:
            return resp.status, await resp.text()

    async def state(self, session) -> dict:
        """The server's gauges now: /healthz details (authorized) and /metrics, plus RSS."""
        out: dict = {"rss_mib": rss_mib(self.pid) if self.pid else None}
        try:
            status, text = await asyncio.wait_for(self._http(session, "/healthz"), 10.0)
            out["healthz_status"] = status
            h = json.loads(text)
            out["healthz"] = h
            status, text = await asyncio.wait_for(self._http(session, "/metrics"), 10.0)
            out["metrics_status"] = status
            out["gauges"] = {k: _metric(text, name) for k, name in GAUGES.items()}
            out["counters"] = {"requests_by_outcome": _labelled(text, "relayinfer_requests_total", "outcome"),
                               "protocol_errors_by_code": _labelled(text, "relayinfer_protocol_errors_total", "code"),
                               "engine_requests_by_reason": _labelled(text, "relayinfer_engine_requests_total", "reason"),
                               "engine_preemptions": _metric(text, "relayinfer_engine_preemptions_total")}
        except Exception as e:  # noqa: BLE001  the server may be dead: that is the finding
            out["http_error"] = f"{type(e).__name__}: {e}"
        return out

    @staticmethod
    def idle(s: dict) -> bool:
        g = s.get("gauges") or {}
        h = s.get("healthz") or {}
        e = h.get("engine") or {}
        vals = [g.get(k) for k in GAUGES] + [h.get("sessions"), h.get("requests"), e.get("running"), e.get("waiting"),
                                              e.get("kv_blocks_used")]
        return all(v == 0 for v in vals if v is not None) and bool(g) and all(g.get(k) is not None for k in GAUGES)

    async def sampler(self, session, t0: float) -> None:
        while True:
            s = await self.state(session)
            g = s.get("gauges") or {}
            self.timeline.append({"t_s": round(time.monotonic() - t0, 1),
                                  "rss_mib": None if s["rss_mib"] is None else round(s["rss_mib"], 1),
                                  **{k: g.get(k) for k in GAUGES}, "generates": self.tally.generates})
            await asyncio.sleep(self.cfg.sample_s)

    async def main(self) -> dict:
        import aiohttp

        cfg = self.cfg
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
            before = await self.state(session)
            h = before.get("healthz") or {}
            self.fingerprint = h.get("model_fingerprint", "")
            if not self.fingerprint:
                raise RuntimeError(f"no model fingerprint from {self.http_url}/healthz (token right?): {before}")
            t0 = time.monotonic()
            self.soft_deadline, self.hard_deadline = t0 + cfg.duration_s, t0 + cfg.duration_s + cfg.grace_s
            sampler = asyncio.create_task(self.sampler(session, t0))
            devices = [asyncio.create_task(_Device(i, self).life()) for i in range(cfg.devices)]
            warmup = cfg.warmup_s if cfg.warmup_s is not None else min(60.0, cfg.duration_s / 10)
            await asyncio.sleep(warmup)
            rss_start = rss_mib(self.pid) if self.pid else None
            done, pending = await asyncio.wait(devices, timeout=max(0.0, self.hard_deadline - time.monotonic()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            crashed = [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None]
            wall = time.monotonic() - t0
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            t1, after = time.monotonic(), None
            while True:  # the server settles: every gauge back to 0
                after = await self.state(session)
                if self.idle(after) or time.monotonic() - t1 > cfg.settle_s:
                    break
                await asyncio.sleep(0.5)
            settle = time.monotonic() - t1
        return {"wall_s": round(wall, 1), "warmup_s": warmup, "rss_start": rss_start, "before": before,
                "after": after, "settle_s": round(settle, 1), "settled": self.idle(after),
                "devices_cancelled_at_deadline": len(pending), "device_task_errors": crashed}


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _labelled(text: str, name: str, label: str) -> dict:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}\{{{label}="([^"]*)"\}} (\S+)$', text, re.M)}


def _tracebacks(stderr: str) -> list[str]:
    """The server's logged errors: first line of each traceback / ERROR record, grouped."""
    lines = stderr.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback") or " ERROR " in line or line.startswith("ERROR"):
            tail = next((lines[j] for j in range(i + 1, min(i + 200, len(lines)))
                         if lines[j] and not lines[j].startswith((" ", "Traceback"))), line)
            found.append(_group(tail))
    return [f"{n} x {t}" for t, n in Counter(found).most_common(20)]


def run_soak(devices: int = 100, duration_s: float = 600.0, *, cloud_url: str | None = None,
             http_url: str | None = None, token: str | None = None, server_pid: int | None = None,
             fault_rate: float = 0.2, seed: int = 0, out: str | Path | None = None, threads: int = 1,
             kv_cache_mb: int = 256, command: str | None = None, progress=None, model: str | None = None,
             **settings) -> dict:
    """Run the soak (see the module docstring) and return the report; write it to `out` (JSON).

    Without `cloud_url` a `relayinfer cloud serve` subprocess is started on 127.0.0.1 (`threads`
    torch threads, `kv_cache_mb` MiB of KV cache, a random token) and stopped at the end; with it,
    `http_url` (its HTTP side) and `token` are needed, and `server_pid` to read its RSS. `model`: the
    GGUF path or installed name the started server runs and the prompts are tokenized with (with
    `cloud_url`: the model that server runs; default SmolLM2-135M-Instruct).
    `settings`: further `SoakConfig` fields (seconds, tokens)."""
    from relayinfer.cloud.serve.service import split_frame_limit
    from relayinfer.protocol.model.tokenizer import Tokenizer

    say = progress or (lambda m: None)
    cfg = SoakConfig(devices=devices, duration_s=duration_s, fault_rate=fault_rate, seed=seed, **settings)
    from relayinfer.protocol.model.model_file import resolve_model_path

    mc = model_config(model)
    prompts = soak_prompts(Tokenizer.from_gguf(resolve_model_path(model)), max_prompt_tokens=cfg.max_prompt_tokens,
                           seed=seed)
    frame_limit = split_frame_limit(mc.context_length, mc.vocab_size)
    server = None
    if cloud_url is None:
        server = ServerProcess(threads=threads, kv_cache_mb=kv_cache_mb, model=model)
        say(f"starting: {server.command}")
        server.start()
        cloud_url, http_url, token, server_pid = server.url, server.http_url, server.token, server.proc.pid
        say(f"cloud {cloud_url}  http {http_url}  pid {server_pid}")
    elif http_url is None:
        raise ValueError("with cloud_url, give http_url (the service's HTTP side) too")
    started = datetime.datetime.now(datetime.timezone.utc)
    run = _Soak(cfg, cloud_url, http_url, token, server_pid, prompts, mc.vocab_size, mc.context_length, frame_limit)
    rc = None
    try:
        say(f"{devices} devices for {duration_s:.0f} s, fault rate {fault_rate}")
        res = asyncio.run(run.main())
        server_alive = alive(server_pid) if server_pid else None
    finally:
        stderr = server.stderr() if server else ""
        if server is not None:
            rc = server.stop()
            server.cleanup()
    tl = run.tally
    after, rss_start = res["after"], res["rss_start"]
    rss_end = (after or {}).get("rss_mib")
    g = (after or {}).get("gauges") or {}
    import numpy as np

    report = {
        "command": command, "date": started.isoformat(timespec="seconds"), "code": _git_state(),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": list(os.getloadavg())},
        "settings": {**{k: v for k, v in cfg.__dict__.items()}, "threads": threads, "kv_cache_mb": kv_cache_mb,
                     "server": server.command if server else cloud_url, "frame_limit_bytes": frame_limit,
                     "prompts": len(prompts), "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1)},
        "wall_s": res["wall_s"],
        "requests": {"started": tl.generates, "completed": tl.outcomes["completed"],
                     "failed_by_design": tl.outcomes["by_design"], "failed_unexpectedly": tl.outcomes["unexpected"],
                     "overloaded": tl.outcomes["overloaded"],
                     "by_kind": dict(tl.kinds), "done_reasons": dict(tl.done_reasons),
                     "unexpected_errors": dict(tl.unexpected.most_common(30)),
                     "unexpected_examples": tl.unexpected_examples,
                     "ttft_ms_p50": _pct(tl.ttft_ms, 50), "ttft_ms_p99": _pct(tl.ttft_ms, 99)},
        "connections": {"handshakes": tl.connections, "handshake_overloaded": tl.handshake_overloaded,
                        "connect_failures": dict(tl.connect_failures), "backoff_s_total": round(tl.backoff_s, 1),
                        "retry_after_ms": sorted(set(tl.retry_after_ms))},
        "faults": {"injected": dict(tl.faults_injected), "answered_as_specified": dict(tl.faults_answered),
                   "refused_overloaded_before_injection": dict(tl.faults_refused)},
        "tokens": {"received": tl.tokens_received, "shown": tl.tokens_shown, "lost": tl.tokens_lost,
                   "duplicated": tl.tokens_duplicated, "problems": tl.stream_problems},
        "errors_by_code": dict(tl.error_codes),
        "server": {"pid": server_pid, "rss_mib_ready": (res["before"] or {}).get("rss_mib"),
                   "rss_mib_start": None if rss_start is None else round(rss_start, 1),
                   "rss_mib_end": None if rss_end is None else round(rss_end, 1),
                   "rss_mib_growth": None if rss_start is None or rss_end is None else round(rss_end - rss_start, 1),
                   "rss_mib_max": max((s["rss_mib"] for s in run.timeline if s["rss_mib"] is not None), default=None),
                   "after_run": {k: g.get(k) for k in GAUGES}, "healthz_after": (after or {}).get("healthz"),
                   "healthz_status_after": (after or {}).get("healthz_status"),
                   "http_error_after": (after or {}).get("http_error"),
                   "settled": res["settled"], "settle_s": res["settle_s"], "alive": server_alive, "exit_code": rc,
                   "counters_after": (after or {}).get("counters"), "logged_errors": _tracebacks(stderr)},
        "driver": {"devices_cancelled_at_deadline": res["devices_cancelled_at_deadline"],
                   "device_task_errors": res["device_task_errors"], "rss_mib": rss_mib(os.getpid())},
        "timeline": run.timeline,
    }
    report["passed"] = passed(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def _git_state() -> dict:
    """The commit the run's code is on and whether the working tree differs from it (the server
    runs the working tree)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": head, "modified_tracked_files": len(dirty)}


def _pct(xs, q) -> float | None:
    import numpy as np

    return round(float(np.percentile(xs, q)), 1) if xs else None


def passed(r: dict) -> dict:
    """The soak's acceptance checks, each True/False (`all` = every one)."""
    s, req = r["server"], r["requests"]
    inj, ans = r["faults"]["injected"], r["faults"]["answered_as_specified"]
    checks = {
        "no_lost_tokens": r["tokens"]["lost"] == 0, "no_duplicated_tokens": r["tokens"]["duplicated"] == 0,
        "no_unexpected_failures": req["failed_unexpectedly"] == 0 and not r["driver"]["device_task_errors"],
        "every_fault_answered": all(ans.get(k, 0) == v for k, v in inj.items()),
        "server_idle_after": s["settled"] and all(v == 0 for v in s["after_run"].values()),
        "server_alive_and_healthy": bool(s["alive"]) and s["healthz_status_after"] == 200,
        "no_server_errors_logged": not s["logged_errors"],
    }
    checks["all"] = all(checks.values())
    return checks


def table(r: dict) -> str:
    """A short text summary of a report."""
    q, t, s, f = r["requests"], r["tokens"], r["server"], r["faults"]
    lines = [
        f"requests started {q['started']}  completed {q['completed']}  failed by design {q['failed_by_design']}  "
        f"overloaded (backed off) {q.get('overloaded', 0)}  failed unexpectedly {q['failed_unexpectedly']}  (wall {r['wall_s']} s, TTFT p50 {q['ttft_ms_p50']} ms "
        f"p99 {q['ttft_ms_p99']} ms)",
        f"tokens received {t['received']}  shown {t['shown']}  lost {t['lost']}  duplicated {t['duplicated']}",
        "faults " + "  ".join(f"{k} {f['answered_as_specified'].get(k, 0)}/{v}" for k, v in sorted(f["injected"].items())),
        "errors by code " + "  ".join(f"{k} {v}" for k, v in sorted(r["errors_by_code"].items())),
        f"handshakes {r['connections']['handshakes']}  handshake OVERLOADED {r['connections']['handshake_overloaded']}"
        f"  back-off {r['connections']['backoff_s_total']} s  connect failures {sum(r['connections']['connect_failures'].values())}",
        f"server RSS ready {s['rss_mib_ready'] and round(s['rss_mib_ready'], 1)} MiB  after warm-up {s['rss_mib_start']} MiB  "
        f"end {s['rss_mib_end']} MiB  growth {s['rss_mib_growth']} MiB  max {s['rss_mib_max']} MiB",
        "after the run " + "  ".join(f"{k} {v:g}" if v is not None else f"{k} ?" for k, v in s["after_run"].items())
        + f"  (settled in {s['settle_s']} s)  healthz {s['healthz_status_after']}  alive {s['alive']}",
    ]
    if q["unexpected_errors"]:
        lines.append("unexpected: " + "; ".join(f"{n} x {e}" for e, n in q["unexpected_errors"].items()))
        lines.append("first ones: " + "; ".join(q["unexpected_examples"][:5]))
    if s["logged_errors"]:
        lines.append("server logged: " + "; ".join(s["logged_errors"]))
    lines.append("checks " + "  ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in r["passed"].items()))
    return "\n".join(lines)
