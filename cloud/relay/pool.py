"""Two cache tiers for pre-inferred prefixes: an accelerator-memory pool (HBM) and a host DRAM tier.

On this CPU-only machine the HBM pool is *accounted*: entries are ordinary tensors in process memory
and the pool enforces a byte budget standing for the accelerator memory an instance would set aside
for prefix caches (RelayGR keeps the prefix KV in HBM on the instance that ranks). The DRAM tier holds
entries after ranking for short-term reuse (RelayGR's memory-aware expander), bounded in bytes, LRU.
All times are seconds from an injectable clock (time.monotonic by default, simulated time in the bench).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable


@dataclass
class Entry:
    """A cached prefix. kv: PrefixKV (or any payload in the simulator); nbytes: bytes it occupies;
    expires: clock time (s) after which it is dropped (lifecycle timeout)."""
    key: Hashable
    kv: Any
    nbytes: int
    expires: float


class HBMPool:
    """Byte-bounded pool. Invariant: used + reserved <= capacity (bytes) at all times.

    reserve(n) books space before a pre-inference runs (so in-flight work counts toward the footprint),
    put(entry) turns a reservation into an entry, pop/expire free it. Thread-safe.
    """

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.clock = int(capacity), clock
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.used = self.reserved = self.peak = 0
        self.expired = 0
        self.lock = threading.RLock()

    def reserve(self, nbytes: int) -> bool:
        """Book nbytes (bytes) for a coming entry; False (nothing booked) if it would exceed capacity."""
        with self.lock:
            if self.used + self.reserved + nbytes > self.capacity:
                return False
            self.reserved += nbytes
            self.peak = max(self.peak, self.used + self.reserved)
            return True

    def release(self, nbytes: int) -> None:
        """Give back a reservation that will not be put (cancelled or failed pre-inference)."""
        with self.lock:
            self.reserved -= nbytes

    def put(self, entry: Entry, reserved: int) -> None:
        """Store `entry` in space booked by reserve(reserved). Replaces an entry with the same key."""
        with self.lock:
            self.reserved -= reserved
            old = self.entries.pop(entry.key, None)
            if old is not None:
                self.used -= old.nbytes
            if self.used + self.reserved + entry.nbytes > self.capacity:
                raise RuntimeError("HBM pool over budget (entry larger than its reservation)")
            self.entries[entry.key] = entry
            self.used += entry.nbytes
            self.peak = max(self.peak, self.used + self.reserved)

    def get(self, key: Hashable) -> Entry | None:
        """The live entry for key (expired entries are dropped first), else None."""
        with self.lock:
            self.expire()
            return self.entries.get(key)

    def pop(self, key: Hashable) -> Entry | None:
        """Remove and return the entry for key (its bytes are freed), else None."""
        with self.lock:
            e = self.entries.pop(key, None)
            if e is not None:
                self.used -= e.nbytes
            return e

    def expire(self) -> int:
        """Drop entries past their lifecycle timeout; returns how many."""
        with self.lock:
            now, n = self.clock(), 0
            for k in [k for k, e in self.entries.items() if e.expires <= now]:
                self.pop(k)
                n += 1
            self.expired += n
            return n


class DramTier:
    """Host-memory tier: byte-bounded LRU with a reuse window (s) per entry. Thread-safe."""

    def __init__(self, capacity: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.window_s, self.clock = int(capacity), window_s, clock
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.used = self.evicted = 0
        self.lock = threading.RLock()

    def put(self, entry: Entry) -> bool:
        """Keep `entry` for window_s seconds, evicting least-recently-used entries to fit."""
        with self.lock:
            self.take(entry.key)
            if entry.nbytes > self.capacity:
                return False
            while self.used + entry.nbytes > self.capacity:
                _, old = self.entries.popitem(last=False)
                self.used -= old.nbytes
                self.evicted += 1
            entry.expires = self.clock() + self.window_s
            self.entries[entry.key] = entry
            self.used += entry.nbytes
            return True

    def take(self, key: Hashable) -> Entry | None:
        """Remove and return the live entry for `key` (None if absent or past its window)."""
        with self.lock:
            e = self.entries.pop(key, None)
            if e is not None:
                self.used -= e.nbytes
                if e.expires <= self.clock():
                    return None
            return e

    def __contains__(self, key: Hashable) -> bool:
        with self.lock:
            e = self.entries.get(key)
            return e is not None and e.expires > self.clock()
