"""Sequence-aware trigger (RelayGR): admit pre-inference only for requests at risk of missing the
ranking P99 budget, under a bounded cache footprint and a bounded pre-inference load.

risk:      predicted full ranking latency (LatencyModel fitted on this machine) for the history length
           exceeds risk_fraction * budget_ms; shorter requests rank as before.
footprint: the prefix's bytes (length * bytes_per_token) must fit in the HBM pool next to what is
           stored and reserved (the pool enforces it; the reservation is held until put or release).
load:      a token bucket of pre-inference tokens: at most burst + rate * t tokens admitted in any
           interval of t seconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from relayinfer.cloud.relay.pool import HBMPool


@dataclass
class TriggerConfig:
    """Budget (ms), risk threshold (fraction of the budget), candidates per request, token budget."""
    budget_ms: float = 200.0        # ranking P99 budget
    risk_fraction: float = 0.5      # at risk if predicted full ranking ms > risk_fraction * budget_ms
    n_cands: int = 100              # candidates expected per ranking request
    token_rate: float = 20_000.0    # pre-inference tokens per second
    token_burst: float = 40_000.0   # bucket size (tokens)


class Trigger:
    """admit(length) -> (admitted, reason, reserved_bytes); reason in ok | short | load | footprint.
    On "ok" the caller owns `reserved_bytes` in the pool (put it or release it)."""

    def __init__(self, cfg: TriggerConfig, predict_full_ms: Callable[[int, int], float], pool: HBMPool,
                 bytes_per_token: int, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.predict, self.pool, self.bpt, self.clock = cfg, predict_full_ms, pool, bytes_per_token, clock
        self.tokens, self.t_last = cfg.token_burst, clock()
        self.counts = {"ok": 0, "short": 0, "load": 0, "footprint": 0}
        self.admitted_tokens = 0

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.cfg.token_burst, self.tokens + (now - self.t_last) * self.cfg.token_rate)
        self.t_last = now

    def at_risk(self, length: int) -> bool:
        """Would full ranking of a `length`-event history take more than risk_fraction * budget_ms?"""
        return self.predict(length, self.cfg.n_cands) > self.cfg.risk_fraction * self.cfg.budget_ms

    def admit(self, length: int) -> tuple[bool, str, int]:
        """Decide one pre-inference of `length` tokens (see the class docstring)."""
        if not self.at_risk(length):
            reason = "short"
        else:
            self._refill()
            nbytes = length * self.bpt
            if self.tokens < length:
                reason = "load"
            elif not self.pool.reserve(nbytes):
                reason = "footprint"
            else:
                self.tokens -= length
                self.admitted_tokens += length
                self.counts["ok"] += 1
                return True, "ok", nbytes
        self.counts[reason] += 1
        return False, reason, 0
