"""Memory-aware expander (RelayGR): after ranking, a prefix leaves the HBM pool for the DRAM tier;
a returning user within the DRAM window reloads it into the pool instead of recomputing it.
Concurrent reloads of the same entry are single-flight: one copy, the others wait for it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

from relayinfer.cloud.relay.pool import DramTier, Entry, HBMPool


class Expander:
    """Moves entries HBM -> DRAM after use and DRAM -> HBM on a hit.

    copy(kv) -> kv stands for the host-to-device copy (a tensor clone on CPU; identity in the simulator).
    Counters: demoted, reloads (copies made), reload_waits (callers that joined an in-flight reload),
    reload_no_room (DRAM hit but no HBM space: the caller recomputes).
    """

    def __init__(self, pool: HBMPool, dram: DramTier, ttl_s: float, copy: Callable[[Any], Any] = lambda kv: kv):
        self.pool, self.dram, self.ttl_s, self.copy = pool, dram, ttl_s, copy
        self.inflight: dict[Hashable, threading.Event] = {}
        self.lock = threading.Lock()
        self.demoted = self.reloads = self.reload_waits = self.reload_no_room = 0

    def demote(self, key: Hashable) -> bool:
        """Ranking consumed `key`: free its HBM space and keep it in DRAM for the reuse window."""
        e = self.pool.pop(key)
        if e is None:
            return False
        self.demoted += 1
        return self.dram.put(e)

    def keep(self, entry: Entry) -> bool:
        """Put a prefix computed on the critical path (a miss) straight into DRAM for reuse."""
        return self.dram.put(entry)

    def reload(self, key: Hashable, timeout_s: float = 30.0) -> Entry | None:
        """The HBM entry for `key` after reloading it from DRAM if needed; None on a DRAM miss."""
        with self.lock:
            e = self.pool.get(key)
            if e is not None:
                return e
            ev = self.inflight.get(key)
            leader = ev is None
            if leader:
                ev = self.inflight[key] = threading.Event()
        if not leader:
            self.reload_waits += 1
            ev.wait(timeout_s)
            return self.pool.get(key)
        try:
            d = self.dram.take(key)
            if d is None:
                return None
            if not self.pool.reserve(d.nbytes):
                self.reload_no_room += 1
                self.dram.put(d)
                return None
            e = Entry(key, self.copy(d.kv), d.nbytes, self.pool.clock() + self.ttl_s)
            self.pool.put(e, d.nbytes)
            self.reloads += 1
            return e
        finally:
            with self.lock:
                self.inflight.pop(key, None)
            ev.set()
