"""P/D ratio: an analytic model that predicts the best prefill:decode split of a group for a
workload, and a controller with hysteresis that moves instances between roles (and groups) from
measured TTFT/TPOT against the group's SLOs (P/D-Serve, arXiv 2408.08147, sec. 3.2 and 4).

Model (per instance, measured on this machine: `bench/pd.py` fits it from the real engine):

* prefill: S = prompt_tokens / prefill_tok_s per request; the prefill pool is an M/D/n_p-ish queue,
  approximated per instance as M/D/1: TTFT = S + rho * S / (2 (1 - rho)) (+ KV transfer). The
  largest load meeting the TTFT SLO is rho* = 2 (T - S) / (2 T - S), so the pool sustains
  n_p * rho* / S requests/s.
* decode: a step of b sequences takes a + c * b ms; the largest batch meeting the TPOT SLO is
  b* = (TPOT - a) / c (capped by the engine's max_num_seqs), and one instance sustains
  b* / (output_tokens * step(b*)) requests/s (Little's law).

The best ratio maximises min(prefill capacity, decode capacity): the group's goodput at its SLOs.
The controller starts there and then corrects from measurements.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("relayinfer.pd.ratio")


@dataclass
class PerfModel:
    """One instance's speed: prefill tokens/s, decode step = a_ms + c_ms * batch, KV transfer ms
    per token, engine sequence cap."""

    prefill_tok_s: float
    decode_a_ms: float
    decode_c_ms: float
    transfer_ms_per_token: float = 0.0
    max_batch: int = 64

    def decode_step_ms(self, batch: float) -> float:
        return self.decode_a_ms + self.decode_c_ms * batch


@dataclass
class Workload:
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_slo_ms: float
    tpot_slo_ms: float


def prefill_capacity(n_p: int, w: Workload, perf: PerfModel) -> float:
    """Requests/s that `n_p` prefill instances serve within the TTFT SLO (M/D/1 per instance)."""
    s = w.mean_prompt_tokens / perf.prefill_tok_s * 1e3 + w.mean_prompt_tokens * perf.transfer_ms_per_token
    t = w.ttft_slo_ms
    if n_p <= 0 or s >= t:
        return 0.0
    rho = 2 * (t - s) / (2 * t - s)
    return n_p * rho / (s / 1e3)


def decode_capacity(n_d: int, w: Workload, perf: PerfModel) -> float:
    """Requests/s that `n_d` decode instances serve within the TPOT SLO."""
    if n_d <= 0 or perf.decode_step_ms(1) > w.tpot_slo_ms:
        return 0.0
    b = min(perf.max_batch, (w.tpot_slo_ms - perf.decode_a_ms) / max(perf.decode_c_ms, 1e-9))
    return n_d * b / (max(w.mean_output_tokens - 1, 1) * perf.decode_step_ms(b) / 1e3)


def best_ratio(n_instances: int, w: Workload, perf: PerfModel) -> tuple[int, int, float]:
    """(n_prefill, n_decode, predicted goodput req/s) maximising min(prefill, decode capacity)."""
    best = (1, n_instances - 1, -1.0)
    for n_p in range(1, n_instances):
        cap = min(prefill_capacity(n_p, w, perf), decode_capacity(n_instances - n_p, w, perf))
        if cap > best[2]:
            best = (n_p, n_instances - n_p, cap)
    return best


def p90(xs) -> float | None:
    return float(np.percentile(list(xs), 90)) if len(xs) else None


@dataclass
class Hysteresis:
    """The controller's decision rule for one group, pure (the simulator uses it too).

    A move is wanted when one SLO is violated (p90 above it) while the other side has slack (p90
    below `slack` x its SLO); it is made only after `patience` consecutive windows want the same
    move and `cooldown_s` after the last move, and never leaves a role with fewer than `min_per_role`.
    """

    patience: int = 2
    cooldown_s: float = 10.0
    slack: float = 0.7
    min_per_role: int = 1
    _want: str | None = None
    _streak: int = 0
    _last_move: float = field(default=-1e18)

    def want(self, ttft_p90, tpot_p90, ttft_slo, tpot_slo, n_p: int, n_d: int) -> str | None:
        ttft_bad = ttft_p90 is not None and ttft_p90 > ttft_slo
        tpot_bad = tpot_p90 is not None and tpot_p90 > tpot_slo
        if ttft_bad and not tpot_bad and (tpot_p90 is None or tpot_p90 < self.slack * tpot_slo) \
                and n_d > self.min_per_role:
            return "to_prefill"
        if tpot_bad and not ttft_bad and (ttft_p90 is None or ttft_p90 < self.slack * ttft_slo) \
                and n_p > self.min_per_role:
            return "to_decode"
        return None

    def observe(self, now: float, ttft_p90, tpot_p90, ttft_slo, tpot_slo, n_p: int, n_d: int) -> str | None:
        w = self.want(ttft_p90, tpot_p90, ttft_slo, tpot_slo, n_p, n_d)
        self._streak = self._streak + 1 if (w is not None and w == self._want) else (1 if w else 0)
        self._want = w
        if w and self._streak >= self.patience and now - self._last_move >= self.cooldown_s:
            self._last_move, self._streak = now, 0
            return w
        return None


class RatioController:
    """Every `interval_s`: per group, p90 TTFT/TPOT of the requests finished since the last window
    against the group's SLOs -> `Hysteresis` -> move the least busy instance of the role that has
    slack to the role that misses its SLO (`Gateway.move`). A group short of instances in both
    roles borrows one from a group with slack in both."""

    def __init__(self, gateway, interval_s: float = 5.0, **hysteresis):
        self.gateway, self.interval_s = gateway, interval_s
        self.rules = {g.name: Hysteresis(**hysteresis) for g in gateway.groups}
        self.moves: list[dict] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:  # pragma: no cover
                log.exception("ratio controller step failed")

    def _least_busy(self, handles):
        rep = self.gateway.reports
        return min(handles, key=lambda h: rep.get(h.name, {}).get("running", 0)
                   + rep.get(h.name, {}).get("queued_requests", 0))

    async def step(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        made, stats = [], {}
        for g in self.gateway.groups:
            ttft, tpot = p90(g.ttft_ms), p90(g.tpot_ms)
            g.ttft_ms.clear()
            g.tpot_ms.clear()
            stats[g.name] = (ttft, tpot)
            sc = g.scenario
            move = self.rules[g.name].observe(now, ttft, tpot, sc.ttft_slo_ms, sc.tpot_slo_ms, len(g.prefill),
                                              len(g.decode))
            if move is None:
                continue
            src, dst = (g.decode, "prefill") if move == "to_prefill" else (g.prefill, "decode")
            h = self._least_busy(src)
            await self.gateway.move(h, g, g, dst)
            made.append({"t": now, "group": g.name, "instance": h.name, "to": dst, "ratio": g.ratio,
                         "ttft_p90_ms": ttft, "tpot_p90_ms": tpot})
        for rec in made:
            log.info("ratio: %s", rec)
        self.moves += made
        return made
