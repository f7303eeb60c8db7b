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
The controller starts there and then corrects from measurements: within a group it moves an
instance between roles (`Hysteresis`); across groups it lends an idle instance of a group with
slack to a group that misses an SLO it cannot fix by itself, and takes it back (`RatioController`).
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


@dataclass
class Loan:
    """An instance lent by group `home` (where it had role `home_role`) to group `to` as `role`."""

    instance: str
    home: str
    home_role: str
    to: str
    role: str
    since: float


class RatioController:
    """Every `interval_s`, per group, p90 TTFT/TPOT of the requests finished since the last window
    against the group's SLOs:

    * **within a group** (`Hysteresis`): move the least busy instance of the role that has slack
      to the role that misses its SLO (`Gateway.move`).
    * **across groups**: a group that misses an SLO (TTFT -> it needs a prefill instance, TPOT -> a
      decode one) and could not fix it by itself in that window (its other role has no slack, or
      no instance to spare) *needs*; a group whose p90s are both below `slack` x its SLOs (or that
      saw no request) and has an **idle** instance (no request in flight from the gateway, none
      running, queued, held or being imported in its last report) in a role with more than
      `min_per_role` instances *has slack*. After `borrow_patience` windows in a row of the same
      need, one idle instance of the group with slack is lent to it in the role it needs. A loan
      is given back (the instance returns to its home group and role) once the borrower has met
      both SLOs for `return_patience` windows in a row, or the lender misses one; the instance
      must be idle for the move (else it waits for a later window). At most `max_loans` loans at a
      time and one cross-group move per window, `cooldown_s` apart.

    Every move is logged (`relayinfer.pd.ratio`), kept in `moves` and counted in
    `relayinfer_pd_ratio_moves_total{kind="role"|"lend"|"return", src, dst}`. Requests already on
    a moved instance finish there (`Gateway.move`); none is lost.

    Raises:
        ValueError: a patience below 1 or a negative `max_loans`.
    """

    def __init__(self, gateway, interval_s: float = 5.0, borrow_patience: int = 3, return_patience: int = 3,
                 max_loans: int = 2, **hysteresis):
        if borrow_patience < 1 or return_patience < 1 or max_loans < 0:
            raise ValueError(f"borrow_patience and return_patience must be >= 1 and max_loans >= 0, got "
                             f"{borrow_patience}, {return_patience}, {max_loans}")
        self.gateway, self.interval_s = gateway, interval_s
        self.rules = {g.name: Hysteresis(**hysteresis) for g in gateway.groups}
        self.borrow_patience, self.return_patience, self.max_loans = borrow_patience, return_patience, max_loans
        self.cooldown_s = self.rules[gateway.groups[0].name].cooldown_s if gateway.groups else 10.0
        self.moves: list[dict] = []
        self.loans: list[Loan] = []
        self._need: dict[str, tuple[str | None, int]] = {}  # group -> (role it needs, windows in a row)
        self._calm: dict[str, int] = {}  # group -> windows in a row meeting both SLOs
        self._last_cross = -1e18
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

    def _busy(self, h) -> int:
        rep = self.gateway.reports.get(h.name, {})
        return rep.get("running", 0) + rep.get("queued_requests", 0)

    def _least_busy(self, handles):
        return min(handles, key=self._busy)

    def _idle(self, h) -> bool:
        gw, rep = self.gateway, self.gateway.reports.get(h.name)
        if rep is None or h.name in gw.dead:
            return False
        inflight = gw._decode_active.get(h.name, 0) + gw._prefill_active.get(h.name, 0)
        return inflight == 0 and not any(rep.get(k, 0) for k in ("running", "waiting", "queued_requests", "held",
                                                                  "imports"))

    def _record(self, now: float, kind: str, h, src, dst, role: str, **extra) -> dict:
        rec = {"t": now, "kind": kind, "instance": h.name, "group": dst.name, "from": src.name, "to": role,
               "ratio": dst.ratio, **extra}
        self.gateway.metrics.moves.labels(kind, src.name, dst.name).inc()
        log.info("ratio: %s", rec)
        return rec

    async def step(self, now: float | None = None) -> list[dict]:
        """One window: measure, move within groups, then lend or return at most one instance
        across groups. Returns the moves made (each a dict: t, kind, instance, group, from, to...)."""
        now = time.monotonic() if now is None else now
        made, stats, needs = [], {}, {}
        for g in self.gateway.groups:
            ttft, tpot = p90(g.ttft_ms), p90(g.tpot_ms)
            g.ttft_ms.clear()
            g.tpot_ms.clear()
            stats[g.name] = (ttft, tpot)
            sc = g.scenario
            rule = self.rules.setdefault(g.name, Hysteresis())
            move = rule.observe(now, ttft, tpot, sc.ttft_slo_ms, sc.tpot_slo_ms, len(g.prefill), len(g.decode))
            ttft_bad = ttft is not None and ttft > sc.ttft_slo_ms
            tpot_bad = tpot is not None and tpot > sc.tpot_slo_ms
            self._calm[g.name] = 0 if (ttft_bad or tpot_bad) else self._calm.get(g.name, 0) + 1
            if move is not None:
                src, dst = (g.decode, "prefill") if move == "to_prefill" else (g.prefill, "decode")
                h = self._least_busy(src)
                await self.gateway.move(h, g, g, dst)
                made.append(self._record(now, "role", h, g, g, dst, ttft_p90_ms=ttft, tpot_p90_ms=tpot))
                self._need[g.name] = (None, 0)
                continue
            if rule.want(ttft, tpot, sc.ttft_slo_ms, sc.tpot_slo_ms, len(g.prefill), len(g.decode)) is not None:
                self._need[g.name] = (None, 0)  # it can fix this itself (after its own patience)
                continue
            role = None
            if ttft_bad or tpot_bad:  # the worse relative miss decides the role it needs
                role = "prefill" if (ttft or 0) / sc.ttft_slo_ms >= (tpot or 0) / sc.tpot_slo_ms else "decode"
            prev, streak = self._need.get(g.name, (None, 0))
            self._need[g.name] = (role, streak + 1 if role is not None and role == prev else (1 if role else 0))
            needs[g.name] = self._need[g.name]
        if now - self._last_cross >= self.cooldown_s:
            rec = await self._give_back(now, stats) or await self._lend(now, stats, needs)
            if rec is not None:
                self._last_cross = now
                made.append(rec)
        self.moves += made
        return made

    def _slack(self, g, stats) -> bool:
        ttft, tpot = stats[g.name]
        rule, sc = self.rules[g.name], g.scenario
        return (ttft is None or ttft < rule.slack * sc.ttft_slo_ms) and (tpot is None or tpot < rule.slack * sc.tpot_slo_ms)

    async def _lend(self, now: float, stats, needs) -> dict | None:
        if len(self.loans) >= self.max_loans:
            return None
        gw = self.gateway
        for g in gw.groups:
            role, streak = needs.get(g.name, (None, 0))
            if role is None or streak < self.borrow_patience:
                continue
            for lender in gw.groups:
                if lender is g or not self._slack(lender, stats) or any(ln.to == lender.name for ln in self.loans):
                    continue  # a group that borrows lends nothing
                min_role = self.rules[lender.name].min_per_role
                pools = sorted(((r, pool) for r, pool in (("prefill", lender.prefill), ("decode", lender.decode))
                                if len(pool) > min_role), key=lambda rp: rp[0] != role)  # same role first
                for home_role, pool in pools:
                    idle = [h for h in pool if self._idle(h)]
                    if not idle:
                        continue
                    h = idle[0]
                    await gw.move(h, lender, g, role)
                    self.loans.append(Loan(h.name, lender.name, home_role, g.name, role, now))
                    self._need[g.name] = (None, 0)
                    return self._record(now, "lend", h, lender, g, role, home_role=home_role,
                                        ttft_p90_ms=stats[g.name][0], tpot_p90_ms=stats[g.name][1])
        return None

    async def _give_back(self, now: float, stats) -> dict | None:
        gw = self.gateway
        for loan in list(self.loans):
            borrower, home = gw.group(loan.to), gw.group(loan.home)
            h = next((x for x in borrower.prefill + borrower.decode if x.name == loan.instance), None)
            if h is None:  # moved on by someone else: the loan is over
                self.loans.remove(loan)
                continue
            home_bad = not self._slack(home, stats) and self._calm.get(home.name, 0) == 0
            if (self._calm.get(borrower.name, 0) < self.return_patience and not home_bad) or not self._idle(h):
                continue
            pool = borrower.prefill if loan.role == "prefill" else borrower.decode
            if len(pool) <= self.rules[borrower.name].min_per_role:
                continue  # never below one per role, even to give back
            await gw.move(h, borrower, home, loan.home_role)
            self.loans.remove(loan)
            return self._record(now, "return", h, borrower, home, loan.home_role, lent_s=round(now - loan.since, 3))
        return None
