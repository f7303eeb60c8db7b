"""Affinity-aware router (RelayGR): the pre-infer signal and the later ranking request of a user go
to the same ranking instance.

Placement: consistent hashing on the user id with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", SODA 2018): walk the ring clockwise from hash(user) and take
the first live instance whose outstanding load is below ceil((1 + epsilon) * (total + 1) / n).
Affinity: the instance chosen at pre-infer time is remembered per user until ttl_s, so load changes
between the two calls cannot split them. If that instance is gone the ranking request is routed
afresh (and will miss the cache: the instance falls back to full inference).
"""
from __future__ import annotations

import bisect
import hashlib
import math
import threading
import time
from typing import Callable


def h64(s: str) -> int:
    """64-bit blake2b hash of a string (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class Router:
    """route_preinfer(user) -> instance; route_rank(user) -> (instance, affine); done(instance).

    Raises RuntimeError when no instance is live. Counters: affine, fallback (the remembered instance
    was removed), cold (no pre-infer seen for the user within ttl_s)."""

    def __init__(self, instances: list[str], vnodes: int = 64, epsilon: float = 0.25, ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.vnodes, self.epsilon, self.ttl_s, self.clock = vnodes, epsilon, ttl_s, clock
        self.ring: list[tuple[int, str]] = []
        self.load: dict[str, int] = {}
        self.affinity: dict[int, tuple[str, float]] = {}
        self.counts = {"affine": 0, "fallback": 0, "cold": 0}
        self.lock = threading.Lock()
        for i in instances:
            self.add(i)

    def add(self, inst: str) -> None:
        """Put an instance on the ring (vnodes points)."""
        with self.lock:
            self.load.setdefault(inst, 0)
            for v in range(self.vnodes):
                bisect.insort(self.ring, (h64(f"{inst}#{v}"), inst))

    def remove(self, inst: str) -> None:
        """Take an instance off the ring; its users are re-routed on their next request."""
        with self.lock:
            self.ring = [r for r in self.ring if r[1] != inst]
            self.load.pop(inst, None)

    def _place(self, user: int) -> str:
        if not self.load:
            raise RuntimeError("no live ranking instance")
        cap = math.ceil((1 + self.epsilon) * (sum(self.load.values()) + 1) / len(self.load))
        i = bisect.bisect(self.ring, (h64(f"user:{user}"), ""))
        for j in range(len(self.ring)):
            inst = self.ring[(i + j) % len(self.ring)][1]
            if self.load[inst] < cap:
                return inst
        return self.ring[i % len(self.ring)][1]  # unreachable: cap exceeds the average load

    def route_preinfer(self, user: int) -> str:
        """Choose the instance for the user's pre-infer signal and remember it (outstanding load +1)."""
        with self.lock:
            old = self.affinity.pop(user, None)
            if old is not None and old[0] in self.load:
                self.load[old[0]] -= 1
            inst = self._place(user)
            self.load[inst] += 1
            self.affinity[user] = (inst, self.clock() + self.ttl_s)
            return inst

    def route_rank(self, user: int) -> tuple[str, bool]:
        """The instance that holds the user's prefix (affine=True), else a fresh placement."""
        with self.lock:
            a = self.affinity.pop(user, None)
            if a is not None and a[0] in self.load:
                self.load[a[0]] -= 1
                if a[1] > self.clock():
                    self.counts["affine"] += 1
                    self.load[a[0]] += 1
                    return a[0], True
            self.counts["fallback" if a is not None and a[0] not in self.load else "cold"] += 1
            inst = self._place(user)
            self.load[inst] += 1
            return inst, False

    def done(self, inst: str) -> None:
        """A ranking request on `inst` finished (outstanding load -1)."""
        with self.lock:
            if inst in self.load:
                self.load[inst] = max(0, self.load[inst] - 1)
