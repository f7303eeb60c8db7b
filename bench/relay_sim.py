"""Cascade SIMULATOR (benchmark code, not library code): retrieval -> pre-processing -> ranking on M
ranking instances (discrete events).

Each request arrives (Poisson) at retrieval time t0; its ranking request reaches the ranking tier at
t0 + delay_ms (retrieval + pre-processing). Ranking latency = completion - (t0 + delay_ms): the P99
budget applies to it. Compute durations come from the LatencyModel fitted on this machine (the real
HSTU timed at several lengths); every policy decision is made by the real objects: Router (bounded-load
consistent hashing + affinity), Trigger (risk, footprint, token budget), HBMPool, DramTier, Expander,
all on the simulated clock.

Modes. baseline: full inference on the critical path. relay: at t0, for a request the trigger finds at
risk (predicted full ranking > risk_fraction * budget), the pre-infer signal goes to the instance the
router picks; an admitted pre-inference runs there at low priority, in pieces of one attention chunk
per layer (HSTU.prefix_steps): a waiting ranking runs between two pieces, and the pre-inference then
resumes at its FIFO place among pre-inferences, as the real Worker does (cloud/relay/server.py); at ranking time the prefix is used if present (hbm), reloaded if it is in DRAM (dram),
waited for if its pre-inference is running, else the queued pre-inference is cancelled and the
request runs in full (recompute).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from relayinfer.cloud.relay.expander import Expander
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.pool import DramTier, Entry, HBMPool
from relayinfer.cloud.relay.router import Router
from relayinfer.cloud.relay.trigger import Trigger, TriggerConfig


@dataclass
class SimConfig:
    """Cascade settings: instances, retrieval + pre-processing delay (ms), candidates, per-instance byte
    budgets, prefix bytes per token, lifecycle / reuse windows (s), reload bandwidth, trigger."""
    instances: int = 4
    delay_ms: float = 150.0             # retrieval + pre-processing before ranking
    n_cands: int = 100
    hbm_bytes: int = 64 << 20           # per instance
    dram_bytes: int = 512 << 20         # per instance
    bytes_per_token: int = 1032
    ttl_s: float = 5.0
    dram_window_s: float = 10.0
    reload_gbps: float = 10.0           # DRAM -> HBM copy bandwidth (GB/s) for a reload
    chunk: int = 256                    # pre-inference query chunk (HSTUConfig.query_chunk)
    layers: int = 2                     # HSTU layers (pieces = ceil(L / chunk) * (layers - 1))
    trigger: TriggerConfig = field(default_factory=TriggerConfig)


@dataclass
class Request:
    """One user request entering retrieval."""
    t0: float          # retrieval start (s)
    user: int
    length: int        # history events
    session: int = 0   # same session = same history (a returning user); new session = new history

@dataclass
class _Job:
    prio: int          # 0 rank, 1 pre-infer
    dur: float         # s
    kind: str
    req: int
    key: tuple = ()
    state: str = "queued"
    reserved: int = 0
    waiters: list = field(default_factory=list)
    pieces: int = 1    # chunked pre-inference: rankings may run between pieces
    seq: int = 0       # FIFO order within the priority (set on submit)


class _Instance:
    def __init__(self, name: str, sim: "Simulator"):
        c = sim.cfg
        self.name, self.sim = name, sim
        clock = lambda: sim.now  # noqa: E731
        self.pool = HBMPool(c.hbm_bytes, clock)
        self.dram = DramTier(c.dram_bytes, c.dram_window_s, clock)
        self.expander = Expander(self.pool, self.dram, c.ttl_s)
        self.trigger = Trigger(c.trigger, sim.lat.full_ms, self.pool, c.bytes_per_token, clock)
        self.queue: list = []
        self.busy = False
        self.pending: dict[tuple, _Job] = {}

    def submit(self, job: _Job) -> None:
        job.seq = next(self.sim.seq)           # FIFO place within its priority, kept across its pieces
        heapq.heappush(self.queue, (job.prio, job.seq, job))
        self.dispatch()

    def run_piece(self, job: _Job) -> None:
        job.state, self.busy = "running", True
        self.sim.busy_s += job.dur / job.pieces
        self.sim.at(self.sim.now + job.dur / job.pieces, "done", (self, job))

    def next_piece(self, job: _Job) -> None:
        """After a piece of a chunked pre-inference, as the real Worker (cloud/relay/server.py) does:
        continue with the next piece unless a higher-priority job (a ranking) waits; then queue the rest
        at its original FIFO place (not behind later pre-inferences) and run that job first."""
        job.left -= 1
        if self.queue and self.queue[0][0] < job.prio:
            heapq.heappush(self.queue, (job.prio, job.seq, job))
            self.busy = False
            self.dispatch()
        else:
            self.run_piece(job)

    def dispatch(self) -> None:
        while not self.busy and self.queue:
            _, _, job = heapq.heappop(self.queue)
            if job.state == "cancelled":
                continue
            self.run_piece(job)


class Simulator:
    """run(requests, mode) -> per-request ranking latencies (ms) and counters."""

    def __init__(self, lat: LatencyModel, cfg: SimConfig):
        self.lat, self.cfg = lat, cfg

    def at(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self, requests: list[Request], mode: str) -> dict:
        """Simulate `requests` in mode "baseline" or "relay" (ValueError otherwise). Returns
        {"latency_ms": (n,) ranking latencies, "counts": trigger / prefix-source counters,
        "hbm_peak_bytes": max pool footprint over instances, "preinfer_tokens": admitted tokens,
        "busy_s": compute seconds over all instances}."""
        if mode not in ("baseline", "relay"):
            raise ValueError(f"unknown mode {mode!r}")
        c = self.cfg
        self.now, self.seq, self.events, self.busy_s = 0.0, itertools.count(), [], 0.0
        insts = {f"i{k}": _Instance(f"i{k}", self) for k in range(c.instances)}
        router = Router(list(insts), ttl_s=c.ttl_s, clock=lambda: self.now)
        self.trigger_risk = next(iter(insts.values())).trigger
        lat_ms = np.full(len(requests), np.nan)
        source = [""] * len(requests)
        counts: dict[str, int] = {}
        for i, r in enumerate(requests):
            if mode == "relay":
                self.at(r.t0, "signal", i)
            self.at(r.t0 + c.delay_ms / 1e3, "rank", i)
        N = c.n_cands

        def start_rank(inst: _Instance, i: int, src: str, extra_s: float = 0.0) -> None:
            r = requests[i]
            dur = extra_s + (self.lat.cached_ms(r.length, N) if src in ("hbm", "dram") else self.lat.full_ms(r.length, N)) / 1e3
            source[i] = src
            inst.submit(_Job(0, dur, "rank", i, key=(r.user, r.session)))

        while self.events:
            self.now, _, kind, p = heapq.heappop(self.events)
            if kind == "signal":
                r = requests[p]
                key = (r.user, r.session)
                if not self.trigger_risk.at_risk(r.length):       # sequence-aware: short ones rank as before
                    counts["trigger_short"] = counts.get("trigger_short", 0) + 1
                    continue
                inst = insts[router.route_preinfer(r.user)]
                if inst.pool.get(key) is not None or key in inst.pending:
                    continue
                if key in inst.dram:
                    e = inst.expander.reload(key)
                    if e is not None:
                        counts["signal_dram"] = counts.get("signal_dram", 0) + 1
                        continue
                ok, reason, nbytes = inst.trigger.admit(r.length)
                counts[f"trigger_{reason}"] = counts.get(f"trigger_{reason}", 0) + 1
                if ok:
                    pieces = max(1, -(-r.length // c.chunk) * (c.layers - 1))
                    job = _Job(1, self.lat.prefix_ms(r.length) / 1e3, "prefix", p, key=key, reserved=nbytes,
                               pieces=pieces)
                    job.left = pieces
                    inst.pending[key] = job
                    inst.submit(job)
            elif kind == "rank":
                r = requests[p]
                key = (r.user, r.session)
                name, _ = router.route_rank(r.user)
                inst = insts[name]
                if mode == "baseline":
                    start_rank(inst, p, "none")
                    continue
                job = inst.pending.get(key)
                if inst.pool.get(key) is not None:
                    start_rank(inst, p, "hbm")
                elif job is not None and job.state == "running":   # started (maybe between pieces)
                    job.waiters.append(p)               # its prefix is being computed: wait for it,
                    job.prio = 0                        # and the rest of it now runs at ranking priority
                elif job is not None:                   # still queued: cancel, rank in full now
                    job.state = "cancelled"
                    inst.pending.pop(key)
                    inst.pool.release(job.reserved)
                    counts["preinfer_cancelled"] = counts.get("preinfer_cancelled", 0) + 1
                    start_rank(inst, p, "recompute")
                elif key in inst.dram and inst.expander.reload(key) is not None:
                    start_rank(inst, p, "dram", inst.pool.get(key).nbytes / (c.reload_gbps * 1e9))
                else:
                    start_rank(inst, p, "recompute")
            elif kind == "done":
                inst, job = p
                r = requests[job.req]
                if job.kind == "prefix" and job.left > 1:      # next piece, after any waiting ranking
                    inst.next_piece(job)
                    continue
                inst.busy = False
                if job.kind == "prefix":
                    inst.pending.pop(job.key, None)
                    inst.pool.put(Entry(job.key, None, job.reserved, self.now + c.ttl_s), job.reserved)
                    for w in job.waiters:
                        start_rank(inst, w, "hbm")
                else:
                    lat_ms[job.req] = (self.now - r.t0) * 1e3 - c.delay_ms
                    router.done(inst.name)
                    if mode == "relay":
                        if inst.pool.get(job.key) is not None:
                            inst.expander.demote(job.key)
                        else:
                            inst.expander.keep(Entry(job.key, None, r.length * c.bytes_per_token, 0.0))
                inst.dispatch()
        for s in source:
            counts[f"rank_{s}"] = counts.get(f"rank_{s}", 0) + 1
        peak = max(i.pool.peak for i in insts.values())
        tokens = sum(i.trigger.admitted_tokens for i in insts.values())
        return {"latency_ms": lat_ms, "counts": counts, "hbm_peak_bytes": peak, "preinfer_tokens": tokens,
                "busy_s": self.busy_s}


def poisson_requests(rate: float, n: int, users: list[int], lengths, rng: np.random.Generator,
                     p_return: float = 0.1, return_s: tuple[float, float] = (1.0, 5.0)) -> list[Request]:
    """n requests with exponential inter-arrival gaps (rate req/s). users: pool of user ids; lengths:
    int (all requests) or callable user -> length. With probability p_return a request repeats a
    recent user's request (same history) 1-5 s later: the short-term reuse the DRAM tier serves."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.exponential(1.0 / rate)
        if out and rng.random() < p_return:
            back = t - rng.uniform(*return_s)
            prev = [q for q in out[-200:] if q.t0 <= back]
            if prev:
                q = prev[-1]
                out.append(Request(t, q.user, q.length, q.session))
                continue
        u = users[int(rng.integers(len(users)))]
        out.append(Request(t, u, lengths if isinstance(lengths, int) else int(lengths(u)), len(out)))
    return out


def p99(lat_ms: np.ndarray) -> float:
    """99th percentile (ms)."""
    return float(np.percentile(lat_ms, 99))
