"""Link emulation: a fault-injecting TCP proxy between the device and the cloud (tests, benchmarks).

`LinkProxy` listens on 127.0.0.1 and forwards every TCP connection to the cloud's websocket port,
shaping each direction (up = device -> cloud, down = cloud -> device) like a network link:

* **delay**: every segment is delivered `delay_ms` (one way) after the link sent it, plus a jitter
  drawn uniformly from [0, `jitter_ms`] (queueing only adds delay). Bytes of one connection are
  never reordered: a segment is never delivered before the one ahead of it (so jitter mostly adds
  to the delay of the segments behind a late one, like a FIFO queue).
* **bandwidth cap**: a token bucket per direction, shared by the proxy's connections (one radio
  link), `*_bytes_per_s` refill rate and `burst_bytes` depth; a segment leaves when the bucket
  holds its size. Bytes wait, they are never dropped.
* **loss**, as TCP presents it to the application: TCP never delivers corrupted, missing or
  reordered bytes, so a lost segment shows up as a *retransmission stall*: with probability `loss`
  per segment (of at most `mss` bytes) the segment is held `rto_ms` longer, and every later byte of
  that direction waits behind it (head-of-line blocking). `rto_ms` defaults to 200 ms, Linux's
  `TCP_RTO_MIN`; a sparse stream such as one token every 50-100 ms has too few segments in flight
  for fast retransmit, so a lost segment typically costs about one RTO. (Not modelled: the sender's
  congestion-window cut after a loss, tail-loss probes that may recover faster.)
* **faults**: `cut_after_bytes` closes both sockets of a connection once that many bytes went
  through it in `cut_direction` (exactly that many are delivered, then EOF: the connection
  dropping); `cut()` closes every open connection now; `blackhole()` stops forwarding and stops
  reading in both directions while keeping the sockets open (a stalled or black-holed network: the
  peers see silence, not an error); `blackhole(False)` lets the held bytes through again.
* **counters**: `bytes_up` / `bytes_down` (bytes delivered), `connections` (accepted),
  `active` (open now), `loss_stalls_up` / `loss_stalls_down`, `cuts`.

This is an emulation on loopback: the proxy delays and paces bytes of real TCP connections between
processes of one machine; it does not reproduce a radio link's scheduling, a real TCP stack's
congestion control or the variability of a mobile network. The named `PROFILES` are order-of-
magnitude figures from public crowd-sourced reports (below), not a measurement of any network.

Profiles (`PROFILES`; RTT = 2 x delay + jitter):

* `loopback`: no shaping (the control).
* `wifi`: 7 ms one-way + up to 5 ms jitter (RTT ~14-24 ms to a nearby cloud region), 30 Mbit/s
  down, 15 Mbit/s up, no loss (802.11 retransmits at the MAC layer; what remains is jitter).
  OpenSignal reported average smartphone Wi-Fi speeds at more than twice LTE's 13.5 Mbit/s
  (State of LTE 2015-2016), i.e. tens of Mbit/s.
* `lte`: 30 ms one-way + up to 10 ms jitter (RTT ~60-80 ms: OpenSignal measured US 4G latencies
  of 58-69 ms, 2018), 15 Mbit/s down (OpenSignal State of LTE, Nov 2016: global average LTE
  download 17.4 Mbit/s, US 14 Mbit/s), 5 Mbit/s up (uplink is typically a third or less of the
  downlink), no loss.
* `lossy`: `lte` with 2 % of segments lost (each costs a 200 ms retransmission stall): a weak
  cell edge.

Use `LinkProxyThread` (its own event loop in a daemon thread, like `ServiceThread`) from sync code:

    with ServiceThread(svc) as cloud, LinkProxyThread(cloud.url, PROFILES["lte"]) as link:
        Client(cloud_url=link.url, ...).complete(...)
        link.blackhole()          # thread-safe: runs on the proxy's loop and waits for it
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

DIRECTIONS = ("up", "down")


@dataclass(frozen=True)
class LinkProfile:
    """How the emulated link treats each direction (see the module docstring).

    delay_ms: one-way delay added to every segment, each direction (ms; RTT = 2x).
    jitter_ms: extra delay per segment, uniform in [0, jitter_ms] (ms), never reordering.
    down_bytes_per_s / up_bytes_per_s: bandwidth caps (bytes/s; None = unlimited).
    loss: probability per segment of a retransmission stall of `rto_ms` (0..1), each direction.
    rto_ms: the stall a lost segment costs (ms; Linux's minimum RTO is 200 ms).
    mss: segment size (bytes) for the loss draw and the token bucket.
    burst_bytes: token-bucket depth (bytes) of the bandwidth cap.
    """

    name: str = "custom"
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    down_bytes_per_s: float | None = None
    up_bytes_per_s: float | None = None
    loss: float = 0.0
    rto_ms: float = 200.0
    mss: int = 1448
    burst_bytes: int = 16384
    description: str = ""

    def __post_init__(self):
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rto_ms < 0:
            raise ValueError("delay_ms, jitter_ms and rto_ms must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        for r in (self.down_bytes_per_s, self.up_bytes_per_s):
            if r is not None and r <= 0:
                raise ValueError("bandwidth caps must be > 0 bytes/s (None = unlimited)")
        if self.mss < 1 or self.burst_bytes < self.mss:
            raise ValueError("need mss >= 1 and burst_bytes >= mss")

    @property
    def shapes(self) -> bool:
        """Whether the profile changes anything (a delay, jitter, a cap or loss); `loopback` does not."""
        return bool(self.delay_ms or self.jitter_ms or self.loss or self.down_bytes_per_s or self.up_bytes_per_s)

    def rate(self, direction: str) -> float | None:
        """The bandwidth cap of 'up' or 'down' (bytes/s, None = unlimited)."""
        return self.up_bytes_per_s if direction == "up" else self.down_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)


_MBIT = 1e6 / 8  # bytes/s per Mbit/s

PROFILES: dict[str, LinkProfile] = {
    "loopback": LinkProfile("loopback", description="no shaping (control)"),
    "wifi": LinkProfile("wifi", delay_ms=7.0, jitter_ms=5.0, down_bytes_per_s=30 * _MBIT, up_bytes_per_s=15 * _MBIT,
                        description="Wi-Fi-like: RTT ~14-24 ms, 30/15 Mbit/s down/up, no loss (emulated)"),
    "lte": LinkProfile("lte", delay_ms=30.0, jitter_ms=10.0, down_bytes_per_s=15 * _MBIT, up_bytes_per_s=5 * _MBIT,
                       description="LTE-like: RTT ~60-80 ms, 15/5 Mbit/s down/up, no loss (emulated)"),
    "lossy": LinkProfile("lossy", delay_ms=30.0, jitter_ms=10.0, down_bytes_per_s=15 * _MBIT, up_bytes_per_s=5 * _MBIT,
                         loss=0.02, rto_ms=200.0,
                         description="LTE-like + 2% segment loss, each a 200 ms retransmission stall (emulated)"),
}


def get_profile(name: str) -> LinkProfile:
    """The named profile.

    Raises:
        ValueError: unknown name.
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; choose one of {', '.join(PROFILES)}") from None


class _Bucket:
    """Token bucket on virtual time (seconds of the loop clock): `send_at(now, n)` returns when `n`
    bytes may leave, consuming them; calls are in arrival order, so times never decrease."""

    def __init__(self, rate: float | None, burst: int):
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.t = float(burst), 0.0

    def send_at(self, now: float, n: int) -> float:
        if self.rate is None:
            return now
        if now > self.t:
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
        if self.tokens >= n:
            self.tokens -= n
            return self.t
        self.t += (n - self.tokens) / self.rate
        self.tokens = 0.0
        return self.t


_EOF, _CUT = object(), object()


class _Conn:
    """One proxied connection: the client's and the upstream's streams and the four pipe tasks."""

    def __init__(self, proxy: "LinkProxy", cid: int, cr: asyncio.StreamReader, cw: asyncio.StreamWriter):
        self.proxy, self.cid, self.cr, self.cw = proxy, cid, cr, cw
        self.ur: asyncio.StreamReader | None = None
        self.uw: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task] = []
        self.read = {d: 0 for d in DIRECTIONS}  # bytes read per direction (for cut_after_bytes)
        self.last = {d: 0.0 for d in DIRECTIONS}  # last delivery time per direction (no reordering)
        self.closed = asyncio.Event()

    def close(self) -> None:
        """Close both sockets (pending bytes are flushed by the transport) and stop the pipes."""
        if self.closed.is_set():
            return
        self.closed.set()
        for w in (self.cw, self.uw):
            if w is not None:
                w.close()
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me:
                t.cancel()


class LinkProxy:
    """A TCP proxy on 127.0.0.1 emulating `profile` between its clients and `target` (see the module
    docstring). Run on an asyncio loop (`await start()`, `await close()`), or via `LinkProxyThread`.

    Args:
        target: the cloud's websocket URL (ws://host:port) or a (host, port) pair.
        profile: a `LinkProfile` or a name in `PROFILES` (default loopback: no shaping).
        seed: seed of the jitter and loss draws (deterministic per run).
        cut_after_bytes: close each connection once this many bytes went through it in
            `cut_direction` ('up' or 'down'); None = never. Settable later for new bytes.
        connect_timeout_s: bound on opening the upstream connection (s); on failure the client's
            connection is closed.
        queue_segments: segments held per direction per connection before the proxy stops reading
            (back-pressure: bounded memory).
        close_timeout_s: bound on each wait of `close()` (s).

    Raises:
        ValueError: bad profile name, direction or target.
    """

    def __init__(self, target: str | tuple[str, int], profile: LinkProfile | str | None = None, *, seed: int = 0,
                 cut_after_bytes: int | None = None, cut_direction: str = "down", connect_timeout_s: float = 5.0,
                 queue_segments: int = 256, close_timeout_s: float = 5.0, port: int = 0):
        if isinstance(target, str):
            u = urlsplit(target)
            if not u.hostname or not u.port:
                raise ValueError(f"target needs a host and a port: {target!r}")
            target = (u.hostname, u.port)
        if (not isinstance(target, tuple) or len(target) != 2 or not isinstance(target[0], str) or not target[0]
                or isinstance(target[1], bool) or not isinstance(target[1], int) or not 0 < target[1] < 65536):
            raise ValueError(f"target must be ws://host:port or a (host, port) pair with a port in 1..65535, "
                             f"got {target!r}")
        if cut_direction not in DIRECTIONS:
            raise ValueError(f"cut_direction must be 'up' or 'down', got {cut_direction!r}")
        if cut_after_bytes is not None and cut_after_bytes < 0:
            raise ValueError("cut_after_bytes must be >= 0")
        self.target = target
        self.profile = get_profile(profile) if isinstance(profile, str) else (profile or PROFILES["loopback"])
        self.cut_after_bytes, self.cut_direction = cut_after_bytes, cut_direction
        self.connect_timeout_s, self.queue_segments, self.close_timeout_s = connect_timeout_s, queue_segments, close_timeout_s
        self.port = port
        self.rng = random.Random(seed)
        self.bytes_up = self.bytes_down = 0
        self.loss_stalls_up = self.loss_stalls_down = 0
        self.connections = self.cuts = 0
        self._conns: set[_Conn] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flowing: asyncio.Event | None = None
        self._buckets: dict[str, _Bucket] = {}

    # -- public -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """ws://127.0.0.1:<port> of the proxy (valid after `start()`)."""
        return f"ws://127.0.0.1:{self.port}"

    @property
    def active(self) -> int:
        """Connections open now."""
        return len(self._conns)

    @property
    def blackholed(self) -> bool:
        return self._flowing is not None and not self._flowing.is_set()

    def counters(self) -> dict:
        """Bytes delivered each way, connections accepted / open, loss stalls each way, cuts."""
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "connections": self.connections,
                "active": self.active, "loss_stalls_up": self.loss_stalls_up,
                "loss_stalls_down": self.loss_stalls_down, "cuts": self.cuts}

    async def start(self) -> None:
        """Listen on 127.0.0.1 (`port`, 0 = a free one)."""
        self._loop = asyncio.get_running_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        p = self.profile
        self._buckets = {d: _Bucket(p.rate(d), p.burst_bytes) for d in DIRECTIONS}
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and close every connection; each wait bounded by `close_timeout_s`."""
        if self._server is not None:
            self._server.close()
        conns = list(self._conns)
        for c in conns:
            c.close()
        tasks = [t for c in conns for t in c.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=self.close_timeout_s)
        for c in conns:  # transports that could not flush (peer not reading): drop them
            for w in (c.cw, c.uw):
                if w is not None and w.transport.get_write_buffer_size():
                    w.transport.abort()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), self.close_timeout_s)
            except asyncio.TimeoutError:
                pass

    def blackhole(self, on: bool = True) -> None:
        """Stop (on) or resume (off) forwarding and reading, both directions, every connection; the
        sockets stay open. Thread-safe (waits up to 5 s for the proxy's loop)."""
        def do():
            (self._flowing.clear if on else self._flowing.set)()
        self._call(do)

    def cut(self) -> int:
        """Close every open connection now (both sockets). Returns how many. Thread-safe."""
        def do():
            conns = list(self._conns)
            for c in conns:
                c.close()
            self.cuts += len(conns)
            return len(conns)
        return self._call(do)

    # -- internals ----------------------------------------------------------------------------------

    def _call(self, fn):
        if self._loop is None:
            raise RuntimeError("LinkProxy not started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                fut.set_result(fn())
            except BaseException as e:  # pragma: no cover - surfaced to the caller
                fut.set_exception(e)
        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout=5.0)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = _Conn(self, self.connections, cr, cw)
        self._conns.add(conn)
        conn.tasks.append(asyncio.current_task())
        try:
            # a black-holed network does not reach the cloud either: wait (until resumed or closed)
            await self._flowing.wait()
            try:
                conn.ur, conn.uw = await asyncio.wait_for(asyncio.open_connection(*self.target),
                                                          self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                return
            pipes = []
            for d, src, dst in (("up", cr, conn.uw), ("down", conn.ur, cw)):
                q: asyncio.Queue = asyncio.Queue(self.queue_segments)
                pipes.append(asyncio.create_task(self._writer(conn, d, q, dst)))
                conn.tasks += [asyncio.create_task(self._reader(conn, d, src, q)), pipes[-1]]
            # done when both directions delivered their EOF, or on a cut / error / close
            await asyncio.gather(*pipes, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            conn.close()
            self._conns.discard(conn)

    async def _reader(self, conn: _Conn, d: str, src: asyncio.StreamReader, q: asyncio.Queue) -> None:
        """Read `d`'s bytes, cut them into segments, stamp each with its delivery time, queue them."""
        p, bucket, loop = self.profile, self._buckets[d], asyncio.get_running_loop()
        try:
            while True:
                await self._flowing.wait()
                data = await src.read(65536)
                if not data:
                    await q.put(_EOF)
                    return
                limit = self.cut_after_bytes if d == self.cut_direction else None
                cut = False
                if limit is not None and conn.read[d] + len(data) >= limit:
                    data, cut = data[:max(0, limit - conn.read[d])], True
                conn.read[d] += len(data)
                for i in range(0, len(data), p.mss):
                    seg = data[i:i + p.mss]
                    at = bucket.send_at(loop.time(), len(seg)) + p.delay_ms / 1e3
                    if p.jitter_ms:
                        at += self.rng.uniform(0.0, p.jitter_ms) / 1e3
                    if p.loss and self.rng.random() < p.loss:
                        at += p.rto_ms / 1e3
                        setattr(self, f"loss_stalls_{d}", getattr(self, f"loss_stalls_{d}") + 1)
                    at = conn.last[d] = max(at, conn.last[d])  # FIFO: never before the segment ahead
                    await q.put((at, seg))
                if cut:
                    await q.put(_CUT)
                    return
        except (ConnectionError, OSError):  # reset by the peer: the connection is gone
            conn.close()

    async def _writer(self, conn: _Conn, d: str, q: asyncio.Queue, dst: asyncio.StreamWriter) -> None:
        """Deliver queued segments at their times; forward EOF; on a cut close the connection."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await q.get()
                if item is _EOF:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                if item is _CUT:
                    await dst.drain()
                    self.cuts += 1
                    conn.close()
                    return
                at, seg = item
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                dst.write(seg)
                await dst.drain()
                if d == "up":
                    self.bytes_up += len(seg)
                else:
                    self.bytes_down += len(seg)
        except (ConnectionError, OSError):
            conn.close()


class LinkProxyThread:
    """Run a `LinkProxy` on its own event loop in a daemon thread (sync tests and benchmarks).
    A context manager: `__enter__` starts it and returns the `LinkProxy` (its `blackhole()` and
    `cut()` are thread-safe, its counters readable); `__exit__` closes every connection and stops
    the loop. Arguments are `LinkProxy`'s.

    Raises:
        TimeoutError: the proxy did not start or stop within 10 s.
    """

    def __init__(self, target, profile: LinkProfile | str | None = None, **kw):
        self.proxy = LinkProxy(target, profile, **kw)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="link-proxy", daemon=True)

    def __enter__(self) -> LinkProxy:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        except BaseException:
            self._stop_loop()
            raise
        return self.proxy

    def __exit__(self, *exc) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(3 * self.proxy.close_timeout_s + 5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class LinkProxyProcess:
    """Run `LinkProxy`s in a child process of their own, on one event loop, optionally pinned to
    `core` (`os.sched_setaffinity`): a benchmark whose device runs in this process then keeps the
    emulator's work (its reads, sleeps and writes of every segment) off the device's interpreter
    and, given a core of its own, off both ends' cores. A context manager: `__enter__` forks the
    child and returns {name: proxy URL}; `__exit__` closes every proxy and collects `counters`
    ({name: `LinkProxy.counters()`}). Fork it before this process starts a thread or loads a model.

    Args:
        targets: {name: (target, profile)}: one proxy per name, `LinkProxy`'s target and profile.
        core: the CPU the child is pinned to; None = not pinned.
        seed: every proxy's seed (`LinkProxy`).
        life_s: the child stops by itself after this many seconds (s), or when this process goes.

    Raises:
        RuntimeError: the child did not report its proxies within 30 s, or exited first.
        ValueError: a bad target or profile (raised here, before the fork).
    """

    def __init__(self, targets: dict[str, tuple], core: int | None = None, *, seed: int = 0, life_s: float = 3600.0):
        from relayinfer.sdk.forked import ForkedChild

        for target, profile in targets.values():
            LinkProxy(target, profile)  # a bad target or profile -> ValueError in this process
        self._child = ForkedChild(self._serve, (dict(targets), core, seed, life_s), name="link-proxies",
                                  start_timeout_s=30.0)
        self.counters: dict[str, dict] = {}

    @staticmethod
    def _serve(conn, targets: dict, core: int | None, seed: int, life_s: float) -> None:
        import os

        if core is not None:
            os.sched_setaffinity(0, {core})

        async def main() -> None:
            proxies = {name: LinkProxy(t, p, seed=seed) for name, (t, p) in targets.items()}
            for p in proxies.values():
                await p.start()
            conn.send({name: p.url for name, p in proxies.items()})
            loop = asyncio.get_running_loop()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the pipe wait, off the proxies' loop
                await loop.run_in_executor(pool, conn.poll, life_s)
            counters = {name: p.counters() for name, p in proxies.items()}
            for p in proxies.values():
                await p.close()
            try:
                conn.send(counters)
            except OSError:  # the parent is gone (the pipe's end woke the wait): nobody to tell
                pass

        asyncio.run(main())

    @property
    def pid(self) -> int | None:
        """The child's process id (None before `__enter__`)."""
        return self._child.pid

    def __enter__(self) -> dict[str, str]:
        return self._child.start()

    def __exit__(self, *exc) -> None:
        self.counters = self._child.stop() or {}
