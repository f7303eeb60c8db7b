"""`relayinfer bench split --goodput` (loaded by `sdk.cli.bench_module`): cloud goodput under TTFT and
TPOT SLOs, cloud-only against split, with virtual devices.

Definition (DistServe; vLLM benchmark_serving `--goodput`): a request *attains* an SLO pair
(TTFT_slo, TPOT_slo) iff it completed, its TTFT <= TTFT_slo and its user-visible TPOT <= TPOT_slo,
where the TPOT of a request is the 90th percentile of its inter-token gaps as the user sees them
(after the speed controller, `device.speed.release_time`); an answer of one token has no gap and
is judged on its TTFT alone. The attainment of a rate point is the fraction of its measured
requests that attain; goodput is the highest offered Poisson rate (requests/s) of the grid at which
attainment >= 90 %, every lower rate of the grid attaining too (a sweep stops at its first failing
rate). These rules are the pure functions `tpot_p90_ms`, `attains`, `attainment` and `goodput_rps`.

Set-up: one batched cloud (`CloudService(llm=AsyncLLMEngine(LLMEngine(TorchEngine)))`, one thread,
no prefix cache) in its own forked process pinned to the first core this process may use
(`bench.split._CloudProcess`); this process (the load driver: one asyncio thread) is pinned to the
second. Virtual devices (`timed_request`): the device side of the split protocol with a profile's
timing and no model. Each request connects (TTFT counts from before the connect, as in a real
`SplitSession`), sends `Generate` (greedy, answers to EOS capped at `max_new_tokens`), receives the
cloud's tokens (ready when they arrive) and, in split mode, simulates the device: prefill of the
prompt, then catch-up batches by `device.settings.CatchUp` (each costs `Timing.prefill_ms`), then
`Stop{h}`; device tokens h, h+1, ... are ready at R, R + d, ... (R: the hand-off time, d: decode
ms/token) up to the answer's length (the greedy cloud-only answer of that prompt, measured once per
prompt in a sequential reference pass before the sweep). The cloud budget and the display interval
are the settings algorithm's (`device.settings.choose_settings`) for the profile's timing and a
fresh client's cloud estimate (`device.split.CloudEstimate`); the interval becomes max(target, d)
once the device took over. Shown times follow the speed controller (`display_ms`). In cloud-only
mode the interval is the target TPOT.

Workload: chitchat prompts (`sdk.datasets`) in three length buckets (`BUCKETS`, target lengths 64,
128, 192 tokens), drawn uniformly at random (seeded) from a pool; Poisson arrivals. A rate point
runs until `duration_s` have passed or `max_requests` have arrived (whichever first; defaults 120 s,
200 requests); requests arriving in the first `warmup_s` (default 20 s) are not measured; every
request is awaited to its end or `timeout_s` (a timeout attains nothing). The cloud runs with the
admission control of `relayinfer cloud serve` (OVERLOADED when the expected wait for a first token
passes 2 s): a refused request attains nothing in either mode (a real split device would answer it
alone; that answer is the device's, not the cloud's goodput), and each point counts its refusals
('errors', measured requests).

Per rate point also: the cloud process's CPU time over the point (`cpu_times_s`; 'cloud_cpu_busy':
its share of the wall time, and 'cloud_cpu_wait': the time its threads were runnable but another
process had the core, the shared machine's toll), the mean number of requests the cloud held (sum of cloud busy time / wall time, Little's
law: queue + batch), cloud busy ms and cloud tokens per request, the cloud's own inter-token gap
(`Token.t_cloud_ms`, a decode step at that batch) and TTFT minus the zero-load TTFT (queueing);
`bound_of` reads from these which resource ends each mode's goodput.

Validation (`validate`): real `SplitSession`s (`sdk.Client`, the shipped model on ONNX Runtime, one
thread, `PacedEngine(profile)`) run one at a time against the same cloud under a virtual split load
at two rates; after each, its virtual twins run the same prompt, one at a time, on the same
background load (run together they would queue behind each other at the cloud), planning on the
cloud estimate the real request started with: one with the profile's timing (as in the sweep) and,
where the real client's device fit differs from the profile, one with that fit. Per request: TTFT,
TPOT (p90 shown gap) and hand-off index, and their relative deviations.

Limits of the virtual device (what the real one does and it does not): no refinement and no KV
hand-off (both off in the real `Client` by default here: no refine ratio, no measured link
bandwidth); the re-plan is done once, after the prompt prefill (the real device also re-plans once
the refined prompt arrives, and re-plans an idle cloud-to-the-end plan as cloud tokens arrive; the
virtual device keeps that plan idle to the end); device tokens are ready on the profile's decode
pace exactly (the real one adds its scheduling jitter).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from relayinfer.device.speed import display_ms, tpot_p90_ms  # noqa: F401  (the display model, written once)

BUCKETS = (("short", 64), ("medium", 128), ("long", 192))  # (name, target prompt tokens); see SLOS
# (TTFT ms, TPOT ms). The longest bucket is the longest prompt this CPU prefills well within the first
# TTFT SLO at zero load (~3.3 ms/token: 192 tokens ~0.7 s); the second pair: see docs/BENCHMARKS.md
SLOS = ((1000.0, 100.0), (2000.0, 200.0))
RATES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 1.6, 2.4, 3.2)  # requests/s: x2 steps, x1.5 where split mode ends
QUICK_RATES = (0.05, 0.4)
ATTAINMENT_GOAL = 0.9
MODES = ("cloud-only", "split")


# -- the goodput math (pure) --

def attains(ok: bool, ttft_ms: float | None, tpot_ms: float | None, ttft_slo_ms: float, tpot_slo_ms: float) -> bool:
    """Whether one request meets the SLO pair: it completed (`ok`), ttft_ms <= ttft_slo_ms and
    tpot_ms <= tpot_slo_ms (tpot_ms None: an answer without a gap, judged on TTFT alone)."""
    if not ok or ttft_ms is None or not ttft_ms <= ttft_slo_ms:
        return False
    return tpot_ms is None or tpot_ms <= tpot_slo_ms


def attainment(rows: Sequence[dict], ttft_slo_ms: float, tpot_slo_ms: float) -> float | None:
    """Fraction of `rows` (dicts with 'ok', 'ttft_ms', 'tpot_ms') that attain the SLO pair; None for
    no rows."""
    if not rows:
        return None
    return sum(attains(r["ok"], r["ttft_ms"], r["tpot_ms"], ttft_slo_ms, tpot_slo_ms) for r in rows) / len(rows)


def goodput_rps(points: Sequence[tuple[float, float | None]], goal: float = ATTAINMENT_GOAL) -> float:
    """Goodput (requests/s) of a sweep: the highest rate r of `points` ((rate rps, attainment))
    such that every point with rate <= r attains >= `goal`; 0.0 when the lowest fails (or none).
    An attainment of None (no measured request) fails."""
    best = 0.0
    for rate, att in sorted(points):
        if att is None or att < goal:
            break
        best = rate
    return best


def bound_of(point: dict, zero_load_ttft_ms: float | None, cores: int = 1) -> dict:
    """Which resource ends a mode's goodput, read from the first rate point that fails (`point`: a
    `rate_point` summary under one SLO pair): 'ttft' or 'tpot' misses dominate, the cloud's CPU
    busy fraction and the mean requests it held. The verdict: 'cloud compute' when the cloud
    process ran or was runnable (cloud_cpu_busy + cloud_cpu_wait) >= 90 % of the point on its
    `cores` core(s): it wanted the CPU all along (on a shared machine part of it went to others), else 'queueing' when TTFT misses
    dominate and the TTFT p50 is over twice the zero-load TTFT, else 'decode step' (TPOT misses:
    the batch grew until a step took longer than the SLO), else 'other'. Returns the figures and
    the verdict ('verdict', str)."""
    miss_ttft, miss_tpot = point.get("miss_ttft", 0), point.get("miss_tpot", 0)
    busy, wait = point.get("cloud_cpu_busy"), point.get("cloud_cpu_wait")
    demand = None if busy is None else busy + (wait or 0.0)
    q = point.get("ttft_ms_p50")
    if demand is not None and demand >= 0.9 * cores:
        verdict = "cloud compute"
    elif miss_ttft >= miss_tpot and miss_ttft and q is not None and zero_load_ttft_ms and q > 2 * zero_load_ttft_ms:
        verdict = "queueing"
    elif miss_tpot > miss_ttft:
        verdict = "decode step"
    else:
        verdict = "other"
    return {"rate_rps": point.get("offered_rps"), "miss_ttft": miss_ttft, "miss_tpot": miss_tpot,
            "cloud_cpu_busy": busy, "cloud_cpu_wait": wait, "cloud_concurrency": point.get("cloud_concurrency"),
            "cloud_busy_ms_per_request": point.get("cloud_busy_ms_mean"),
            "cloud_step_ms_p50": point.get("cloud_step_ms_p50"), "ttft_ms_p50": q,
            "zero_load_ttft_ms": zero_load_ttft_ms, "verdict": verdict}


# -- the virtual device --

async def timed_request(url: str, fingerprint: str, prompt: Sequence[int], mode: str, timing, answer_len: int | None,
                        max_new_tokens: int = 256, target_tpot_ms: float = 50.0, cloud=None,
                        timeout_s: float = 120.0):
    """One virtual device request with shown times (`device.virtual.virtual_request`, the one
    virtual device: the real device's plan and decisions, the profile's costs). timing: the device's
    `device.settings.Timing` (a, b, d; its cloud fields unused); answer_len: tokens of the greedy
    answer of this prompt (the device's answer length after a hand-off, <= max_new_tokens); cloud:
    the `device.settings.CloudEstimate` the plan uses (None: a fresh client's). Returns the
    `VirtualResult`; never raises for a cloud failure (`ok` False and `error` say it)."""
    from relayinfer.device.virtual import virtual_request

    return await virtual_request(url, fingerprint, prompt, mode, timing, max_new_tokens, target_tpot_ms=target_tpot_ms,
                                 timeout_s=timeout_s, answer_len=answer_len, cloud=cloud)


# -- the load --

def cpu_times_s(pid: int | None) -> tuple[float, float] | None:
    """(run, wait) seconds of all threads of process `pid` (Linux /proc/PID/task/*/schedstat: time on
    a CPU, time runnable but waiting for one), or None where it cannot be read. On a shared machine
    the wait is the CPU the process wanted and other processes had."""
    if pid is None:
        return None
    try:
        run = wait = 0
        for t in Path(f"/proc/{pid}/task").iterdir():
            f = (t / "schedstat").read_text().split()
            run, wait = run + int(f[0]), wait + int(f[1])
        return run / 1e9, wait / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def point_summary(rows: Sequence[dict], slo: tuple[float, float]) -> dict:
    """Attainment of the measured `rows` under one SLO pair (ttft ms, tpot ms), with the misses by
    cause (a request can miss both) and per bucket."""
    ttft_slo, tpot_slo = slo
    miss_ttft = sum(1 for r in rows if not r["ok"] or r["ttft_ms"] is None or r["ttft_ms"] > ttft_slo)
    miss_tpot = sum(1 for r in rows if r["ok"] and r["tpot_ms"] is not None and r["tpot_ms"] > tpot_slo)
    by = {b: attainment([r for r in rows if r["bucket"] == b], ttft_slo, tpot_slo) for b, _ in BUCKETS}
    return {"ttft_slo_ms": ttft_slo, "tpot_slo_ms": tpot_slo, "attainment": attainment(rows, ttft_slo, tpot_slo),
            "miss_ttft": miss_ttft, "miss_tpot": miss_tpot, "attainment_by_bucket": by}


async def rate_point(url: str, fingerprint: str, pool: Sequence[dict], rate_rps: float, mode: str, timing,
                     duration_s: float, max_requests: int, warmup_s: float, seed: int, max_new_tokens: int,
                     target_tpot_ms: float, timeout_s: float, cloud_pid: int | None,
                     slos: Sequence[tuple[float, float]] = SLOS) -> dict:
    """One sustained rate point (see the module docstring): Poisson arrivals (seeded) of virtual
    requests of `mode` on prompts drawn from `pool` (dicts with 'ids', 'bucket', 'answer_len').
    Returns the figures of the point, per SLO pair ('slo'), and per measured request ('requests')."""
    rng = random.Random(seed)
    tasks, meta = [], []
    t0, t = time.perf_counter(), 0.0
    cpu0 = cpu_times_s(cloud_pid)
    while True:
        if tasks:
            t += rng.expovariate(rate_rps)
        if t > duration_s or len(tasks) >= max_requests:
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        p = pool[rng.randrange(len(pool))]
        meta.append((t, p["bucket"]))
        tasks.append(asyncio.create_task(timed_request(url, fingerprint, p["ids"], mode, timing, p["answer_len"],
                                                       max_new_tokens, target_tpot_ms, timeout_s=timeout_s)))
    arrivals_end = time.perf_counter() - t0
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    cpu1 = cpu_times_s(cloud_pid)
    rows = []
    for (at, bucket), r in zip(meta, results):
        d = {k: v for k, v in asdict(r).items() if k not in ("ready_ms", "shown_ms")}
        d.update(arrival_s=at, bucket=bucket, measured=at >= warmup_s)
        rows.append(d)
    meas = [r for r in rows if r["measured"]]
    ok = [r for r in meas if r["ok"]]
    busy_all = sum(r["cloud_busy_ms"] or 0.0 for r in rows)
    out = {"offered_rps": rate_rps, "mode": mode, "requests": len(rows), "measured": len(meas), "ok": len(ok),
           "arrivals_s": arrivals_end, "wall_s": wall, "achieved_rps": len(rows) / arrivals_end if arrivals_end else None,
           "ttft_ms_p50": _pct([r["ttft_ms"] for r in ok], 50), "ttft_ms_p90": _pct([r["ttft_ms"] for r in ok], 90),
           "tpot_ms_p50": _pct([r["tpot_ms"] for r in ok], 50), "tpot_ms_p90": _pct([r["tpot_ms"] for r in ok], 90),
           "answer_tokens_mean": _mean([r["answer_tokens"] for r in ok]),
           "cloud_tokens_mean": _mean([r["cloud_tokens"] for r in ok]),
           "cloud_busy_ms_mean": _mean([r["cloud_busy_ms"] for r in ok]),
           "cloud_prefill_ms_p50": _pct([r["cloud_prefill_ms"] for r in ok], 50),
           "cloud_step_ms_p50": _pct([r["cloud_step_ms"] for r in ok], 50),
           "handed_off": sum(1 for r in ok if r["handoff"] is not None),
           "cloud_concurrency": busy_all / 1e3 / wall if wall else None,
           "cloud_cpu_s": (cpu1[0] - cpu0[0]) if cpu0 and cpu1 else None,
           "cloud_cpu_busy": (cpu1[0] - cpu0[0]) / wall if cpu0 and cpu1 and wall else None,
           "cloud_cpu_wait": (cpu1[1] - cpu0[1]) / wall if cpu0 and cpu1 and wall else None,
           "errors": dict(Counter(r["error"].split(":")[0] for r in meas if r["error"])),
           "load_avg_1m": os.getloadavg()[0]}
    out["slo"] = [point_summary(meas, s) for s in slos]
    out["requests_detail"] = rows
    return out


def refine_rates(points: Sequence[tuple[float, Sequence[float | None]]], n_slos: int, done: set,
                 min_ratio: float = 1.25) -> list[float]:
    """The next rates to measure between each SLO pair's goodput and the first rate that fails it
    (their geometric mean), where the two are more than `min_ratio` apart and the mean was not
    measured yet (`done`); `points`: (rate, attainment per SLO pair). A doubling grid alone puts
    the goodput anywhere in [r, 2r)."""
    out = []
    for j in range(n_slos):
        ordered = sorted((r, a[j]) for r, a in points)
        lo = goodput_rps(ordered)
        hi = next((r for r, a in ordered if r > lo and (a is None or a < ATTAINMENT_GOAL)), None)
        if lo > 0 and hi is not None and hi / lo > min_ratio:
            mid = round(math.sqrt(lo * hi), 3)
            if mid not in done and mid not in out:
                out.append(mid)
    return sorted(out)


async def sweep(url: str, fingerprint: str, pool, mode: str, timing, rates: Sequence[float], deadline: float,
                slos=SLOS, settle_s: float = 2.0, seed: int = 0, refine: int = 2, **kw) -> dict:
    """Rate points of `mode` at increasing `rates` until every SLO pair fails at one point (or
    `deadline`, a time.perf_counter() value, has passed: the sweep is then marked 'cut'), then up
    to `refine` rounds of `refine_rates` between each pair's goodput and its first failing rate.
    Returns {'mode', 'points': [...], 'goodput_rps': [per SLO pair], 'cut': bool}."""
    points, cut = [], False
    grid = list(rates)
    refined = 0
    i = 0
    while True:
        if i >= len(grid):
            if refined >= refine:
                break
            grid += refine_rates([(p["offered_rps"], [s["attainment"] for s in p["slo"]]) for p in points],
                                 len(slos), {p["offered_rps"] for p in points})
            refined += 1
            if i >= len(grid):
                break
        rate = grid[i]
        if time.perf_counter() > deadline:
            cut = True
            break
        p = await rate_point(url, fingerprint, pool, rate, mode, timing, seed=seed * 1000 + i,
                             slos=slos, **kw)
        i += 1
        points.append(p)
        atts = [s["attainment"] for s in p["slo"]]
        print(f"[bench goodput] {mode:10s} {rate:6.3f} rps: {p['measured']:3d} measured, attainment "
              f"{', '.join('-' if a is None else f'{a:.2f}' for a in atts)}, TTFT p50 {p['ttft_ms_p50'] or 0:6.0f} ms, "
              f"TPOT p90 {p['tpot_ms_p90'] or 0:5.0f} ms, cloud CPU {p['cloud_cpu_busy'] or 0:.2f} + wait "
              f"{p['cloud_cpu_wait'] or 0:.2f}, "
              f"held {p['cloud_concurrency'] or 0:.1f}", flush=True)
        if all(a is None or a < ATTAINMENT_GOAL for a in atts) and not refined:  # the grid ends here
            grid = grid[:i]
        await asyncio.sleep(settle_s)
    gp = [goodput_rps([(p["offered_rps"], p["slo"][j]["attainment"]) for p in points]) for j in range(len(slos))]
    return {"mode": mode, "points": points, "goodput_rps": gp, "cut": cut}


# -- validation against real SplitSessions --

def rel_dev(virtual: float | None, real: float | None) -> float | None:
    """Relative deviation |virtual - real| / |real| (0.0 when both are equal, None for a missing
    value; real 0 with virtual != 0 counts against max(|real|, 1))."""
    if virtual is None or real is None:
        return 0.0 if virtual is None and real is None else None
    if virtual == real:
        return 0.0
    return abs(virtual - real) / max(abs(real), 1.0)


async def _background(url, fingerprint, pool, rate_rps, timing, stop: asyncio.Event, seed, max_new_tokens,
                      target_tpot_ms, timeout_s) -> list:
    """Poisson virtual split requests at `rate_rps` until `stop` is set; their `Timed` results."""
    rng, tasks = random.Random(seed), []
    while not stop.is_set():
        p = pool[rng.randrange(len(pool))]
        tasks.append(asyncio.create_task(timed_request(url, fingerprint, p["ids"], "split", timing, p["answer_len"],
                                                       max_new_tokens, target_tpot_ms, timeout_s=timeout_s)))
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate_rps))
        except asyncio.TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


async def _real(client, ids, max_new_tokens, **kw):
    """One real generation through `client` (async; `kw`: per-request options such as mode):
    (GenerationResult, shown times ms)."""
    stream = client.agenerate(ids, max_new_tokens=max_new_tokens, **kw)
    shown = [e.shown_at_ms async for e in stream]
    return stream.result, shown


def measured_cost(real, fit):
    """What the real request's device calls took (`device.settings.Timing`, ms): its prompt
    prefill's ms/token (`device_prompt_ms` over the prompt tokens, a = 0) and its decode pace (the
    median gap between its device tokens' ready times; `fit`'s d without two device tokens)."""
    from relayinfer.device.settings import Timing

    n = real.device_prompt_tokens or len(real.prompt_ids)
    b = real.device_prompt_ms / n if real.device_prompt_ms and n else fit.prefill_ms_per_token
    h = real.handoff_index
    dev = real.ready_ms[h:] if h is not None else []
    d = float(np.median(np.diff(dev))) if len(dev) > 2 else fit.decode_ms_per_token
    return Timing(0.0, b, d, 0.0, 0.0)


def _replay_twin(real, profile_timing, max_new_tokens: int, target_tpot_ms: float, est, cost=None) -> dict:
    """The virtual device replayed on the real request's own cloud stream (`device.virtual.replay`):
    the cloud tokens it received before its hand-off (or all of them), its answer length, the cloud
    estimate it started with; plus the display model alone on the real request's ready times
    ('display_tpot_ms': the speed controller of `display_ms` at the replay's intervals, hand-off at
    the real one), which separates the real display's scheduling delays from the device model."""
    from relayinfer.device.virtual import replay

    h = real.handoff_index
    n_cloud = h if h is not None else (len(real.token_ids) if real.mode != "device-only" else 0)
    arrivals = list(real.ready_ms[:n_cloud])
    r = replay(profile_timing, len(real.prompt_ids), arrivals, len(real.token_ids), max_new_tokens, target_tpot_ms,
               cloud=est, cost=cost)
    after = max(target_tpot_ms, profile_timing.decode_ms_per_token)
    hms = real.ready_ms[h] if h is not None and h < len(real.ready_ms) else None
    r["display_tpot_ms"] = tpot_p90_ms(display_ms(real.ready_ms, r["interval_ms"], after if hms is not None else None, hms,
                                                   follow_source=True))
    return r


def _dev_stats(devs: Sequence[float | None]) -> dict:
    """Median / max of relative deviations and the fraction within 10 % (a None: a mismatch that
    has no ratio, e.g. a hand-off on one side only, counts as outside)."""
    xs = [x for x in devs if x is not None]
    return {"n": len(devs), "median": _pct(xs, 50), "max": max(xs) if xs else None,
            "within_10pct": (sum(1 for x in devs if x is not None and x <= 0.1) / len(devs)) if devs else None}


async def validate(url: str, fingerprint: str, pool, client, profile_timing, rates: Sequence[float], per_rate: int,
                   max_new_tokens: int, target_tpot_ms: float, timeout_s: float, seed: int = 0) -> dict:
    """Real `SplitSession`s (through `client`, an `sdk.Client` with a device profile) against
    virtual twins (see the module docstring): `per_rate` real requests one after another at each
    background rate of `rates` (virtual split requests/s with the profile's timing; 0: none).
    Returns {'pairs': per real request its figures (with its ready and shown times) and each
    twin's with relative deviations: 'virtual_replay' (the virtual device replayed on the real
    request's own cloud stream with the device fit that request planned with: the device model
    alone), 'virtual_replay_measured' (the same plan, each call costing what the real request's
    calls took: `measured_cost`), 'virtual_replay_profile' (the same with the profile's timing), 'virtual_profile' and
    'virtual_fit' (live twins, after it, on the same background load) (`rel_dev`) of TTFT, TPOT (p90 shown gap) and hand-off
    index; 'summary': per twin kind and figure, `_dev_stats`; 'device_fit': the real client's (a, b,
    d) ms}; per pair also 'cloud_only_ttft': the same prompt cloud-only (8 tokens), real against
    virtual (no device compute on either side), and in the summary the median signed differences
    (virtual - real)."""
    import copy

    from relayinfer.device.settings import Timing

    a, b, d = client.device_timing()
    fit = Timing(a, b, d, 0.0, 0.0)
    same = (a, b, d) == (profile_timing.prefill_ms_base, profile_timing.prefill_ms_per_token,
                         profile_timing.decode_ms_per_token)  # the profile bounds the real device: one twin
    pairs = []
    rng = random.Random(seed + 7)
    for rate in rates:
        stop = asyncio.Event()
        bg = asyncio.create_task(_background(url, fingerprint, pool, rate, profile_timing, stop, seed + int(rate * 100),
                                             max_new_tokens, target_tpot_ms, timeout_s)) if rate > 0 else None
        for _ in range(per_rate):
            p = pool[rng.randrange(len(pool))]
            est = copy.deepcopy(client.cloud)  # the twins plan on the estimate the real request starts with
            fit_now = Timing(*client.device_timing(), 0.0, 0.0)  # the fit this request plans with
            fit_prof = Timing(profile_timing.prefill_ms_base, profile_timing.prefill_ms_per_token,
                              profile_timing.decode_ms_per_token, 0.0, 0.0)
            real, shown = await _real(client, p["ids"], max_new_tokens)
            # one after the other (each alone on the background load: not queued behind each other)
            rp = _replay_twin(real, fit_now, max_new_tokens, target_tpot_ms, est)
            rpp = rp if fit_now == fit_prof else _replay_twin(real, profile_timing, max_new_tokens, target_tpot_ms, est)
            cost = measured_cost(real, fit_now)
            rpm = _replay_twin(real, fit_now, max_new_tokens, target_tpot_ms, est, cost)
            vp = await timed_request(url, fingerprint, p["ids"], "split", profile_timing, p["answer_len"],
                                     max_new_tokens, target_tpot_ms, cloud=est, timeout_s=timeout_s)
            vf = vp if same else await timed_request(url, fingerprint, p["ids"], "split", fit, p["answer_len"],
                                                     max_new_tokens, target_tpot_ms, cloud=est, timeout_s=timeout_s)
            row = {"rate_rps": rate, "bucket": p["bucket"], "prompt_tokens": len(p["ids"]),
                   "real": {"ttft_ms": real.ttft_ms, "tpot_ms": tpot_p90_ms(shown), "handoff": real.handoff_index,
                            "answer_tokens": len(real.token_ids), "cloud_budget": real.cloud_budget,
                            "interval_ms": real.interval_ms, "mode": real.mode, "plan": real.plan,
                            "budget_extensions": real.budget_extensions, "fault": real.fault,
                            "device_prefill_ms": real.device_prefill_ms, "device_prompt_ms": real.device_prompt_ms}}
            row["real"]["device_fit"] = [fit_now.prefill_ms_base, fit_now.prefill_ms_per_token, fit_now.decode_ms_per_token]
            row["real"]["ready_ms"], row["real"]["shown_ms"] = list(real.ready_ms), list(shown)
            row["real"]["measured_cost"] = [cost.prefill_ms_base, cost.prefill_ms_per_token, cost.decode_ms_per_token]
            row["cloud_estimate"] = [est.ttft_base_ms, est.prefill_ms_per_token, est.tpot_ms]
            for name, r_ in (("virtual_replay_measured", rpm), ("virtual_replay", rp), ("virtual_replay_profile", rpp)):
                row[name] = {k: r_[k] for k in ("ttft_ms", "tpot_ms", "handoff", "handoff_ms", "budget", "extensions",
                                                "interval_ms", "extrapolated", "display_tpot_ms", "shown_ms")}
                row[name]["dev"] = {k: rel_dev(r_[k], row["real"][k]) for k in ("ttft_ms", "tpot_ms", "handoff")}
                row[name]["dev"]["display_tpot_ms"] = rel_dev(r_["display_tpot_ms"], row["real"]["tpot_ms"])
            for name, v in (("virtual_profile", vp), ("virtual_fit", vf)):
                row[name] = {"ttft_ms": v.ttft_ms, "tpot_ms": v.tpot_ms, "handoff": v.handoff,
                             "answer_tokens": v.answer_tokens, "cloud_budget": v.budget, "interval_ms": v.interval_ms,
                             "ok": v.ok, "error": v.error,
                             "dev": {k: rel_dev(v_, row["real"][k]) for k, v_ in
                                     (("ttft_ms", v.ttft_ms), ("tpot_ms", v.tpot_ms), ("handoff", v.handoff))}}
            # the same prompt cloud-only, 8 tokens (TTFT): real and virtual differ only in the device's
            # compute, so this pair separates the device's interference with the cloud (shared memory
            # bandwidth and caches of one machine) from the virtual device's model of the split
            rc, _ = await _real(client, p["ids"], 8, mode="cloud-only")
            vc = await timed_request(url, fingerprint, p["ids"], "cloud-only", profile_timing, 8, 8, target_tpot_ms,
                                     timeout_s=timeout_s)
            row["cloud_only_ttft"] = {"real_ms": rc.ttft_ms, "virtual_ms": vc.ttft_ms, "dev": rel_dev(vc.ttft_ms, rc.ttft_ms)}
            pairs.append(row)
            r = row["real"]
            print(f"[bench goodput] validate {rate:5.2f} rps {len(p['ids']):4d} tok: real ttft {r['ttft_ms']:6.0f} "
                  f"tpot {r['tpot_ms'] or 0:5.1f} h {r['handoff']} | virtual ttft {vp.ttft_ms or 0:6.0f} tpot "
                  f"{vp.tpot_ms or 0:5.1f} h {vp.handoff} | fit ttft {vf.ttft_ms or 0:6.0f} tpot {vf.tpot_ms or 0:5.1f} "
                  f"h {vf.handoff} | replay ttft {rp['ttft_ms'] or 0:6.0f} tpot {rp['tpot_ms'] or 0:5.1f} h {rp['handoff']} | "
                  f"replay, measured cost: ttft {rpm['ttft_ms'] or 0:6.0f} tpot {rpm['tpot_ms'] or 0:5.1f} h {rpm['handoff']}",
                  flush=True)
        if bg is not None:
            stop.set()
            await bg
    summary = {name: {k: _dev_stats([p[name]["dev"][k] for p in pairs]) for k in ("ttft_ms", "tpot_ms", "handoff")}
               for name in ("virtual_replay_measured", "virtual_replay", "virtual_replay_profile", "virtual_profile",
                            "virtual_fit") if not (same and name == "virtual_fit")}
    for name in ("virtual_replay_measured", "virtual_replay", "virtual_replay_profile"):
        summary[name]["display_tpot_ms"] = _dev_stats([p[name]["dev"]["display_tpot_ms"] for p in pairs])
    summary["cloud_only_ttft"] = {"ttft_ms": _dev_stats([p["cloud_only_ttft"]["dev"] for p in pairs])}
    bias = lambda k, sub: _pct([p[sub][k] - p["real"][k] for p in pairs if p[sub][k] is not None  # noqa: E731
                                and p["real"][k] is not None], 50)
    summary["median_virtual_minus_real"] = {
        "split_ttft_ms": bias("ttft_ms", "virtual_profile"), "split_tpot_ms": bias("tpot_ms", "virtual_profile"),
        "split_handoff": bias("handoff", "virtual_profile"),
        "replay_ttft_ms": bias("ttft_ms", "virtual_replay"), "replay_tpot_ms": bias("tpot_ms", "virtual_replay"),
        "replay_handoff": bias("handoff", "virtual_replay"),
        "cloud_only_ttft_ms": _pct([p["cloud_only_ttft"]["virtual_ms"] - p["cloud_only_ttft"]["real_ms"] for p in pairs
                                    if p["cloud_only_ttft"]["virtual_ms"] is not None], 50)}
    return {"pairs": pairs, "summary": summary, "device_fit": [a, b, d], "rates": list(rates), "per_rate": per_rate}


# -- the benchmark --

def _pool(tokenizer, size: int, seed: int) -> list[dict]:
    """`size` chitchat prompts (at least one per bucket), round robin over `BUCKETS`."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    per = max(1, math.ceil(size / len(BUCKETS)))
    ids = chitchat_prompts_by_length(tokenizer, [t for _, t in BUCKETS], per, seed)
    out = [{"bucket": BUCKETS[i // per][0], "target": BUCKETS[i // per][1], "ids": ids[i]} for i in range(len(ids))]
    order = [out[j * per + k] for k in range(per) for j in range(len(BUCKETS))]
    return order[:max(size, len(BUCKETS))]


async def _reference(url, fingerprint, pool, max_new_tokens, target_tpot_ms, timeout_s) -> None:
    """Sequential cloud-only requests, one per pool prompt (no other load): each prompt's greedy
    answer length ('answer_len') and zero-load TTFT ('zero_load_ttft_ms'), set in place."""
    from relayinfer.device.settings import Timing

    for p in pool:
        r = await timed_request(url, fingerprint, p["ids"], "cloud-only", Timing(0, 0, 0, 0, 0), max_new_tokens,
                                max_new_tokens, target_tpot_ms, timeout_s=timeout_s)
        if not r.ok:
            raise RuntimeError(f"the reference request on a {len(p['ids'])}-token prompt failed: {r.error}")
        p["answer_len"], p["zero_load_ttft_ms"] = r.answer_tokens, r.ttft_ms
        p["zero_load_tpot_ms"], p["zero_load_cloud_step_ms"] = r.tpot_ms, r.cloud_step_ms


def session_priority() -> dict:
    """Make this process's niceness count against the other sessions on the machine, and say how
    the CPU is shared. With the kernel's autogroups on (`/proc/sys/kernel/sched_autogroup_enabled`),
    the scheduler first shares a core equally between sessions and only then by nice inside each,
    so `nice -n -10` alone leaves a benchmark its 1/k of a core among k busy sessions; a negative
    niceness (root) is therefore also set as this session's autogroup nice (`/proc/self/autogroup`).
    Returns {'nice', 'autogroup_enabled', 'autogroup' (the file's line after the change), 'set'
    (whether it was changed), 'error' (why not, if it failed)}."""
    out: dict = {"nice": os.getpriority(os.PRIO_PROCESS, 0), "set": False, "error": None}
    try:
        out["autogroup_enabled"] = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
        ag = Path("/proc/self/autogroup")
        if out["autogroup_enabled"] and out["nice"] < 0:
            ag.write_text(str(out["nice"]))
            out["set"] = True
        out["autogroup"] = ag.read_text().strip()
    except OSError as e:  # no autogroups on this kernel, or not permitted
        out.setdefault("autogroup_enabled", None)
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_goodput_bench(profiles: Sequence[str], out: str, seed: int = 0, max_new_tokens: int = 256,
                      pool_size: int = 12, rates: Sequence[float] = RATES, duration_s: float = 120.0,
                      max_requests: int = 200, warmup_s: float = 20.0, slos=SLOS, target_tpot_ms: float = 50.0,
                      timeout_s: float = 120.0, time_limit_s: float = 3600.0, validate_rates: Sequence[float] = (0.0, 0.4),
                      validate_per_rate: int = 4, kv_cache_mb: int = 256, plot: bool = True,
                      command: str | None = None, model: str | None = None, quantize: str | None = None,
                      refine: int = 2) -> dict:
    """The goodput benchmark (module docstring): reference pass, then per mode (cloud-only once, split
    per device profile of `profiles`) a sweep over `rates` (plus `refine` bisection rounds,
    `refine_rates`), then the validation against real
    `SplitSession`s (`validate_per_rate` requests at each of `validate_rates`, first profile; none
    when 0). Sweeps stop adding rate points once `time_limit_s` s have passed since the start (the
    sweep is marked 'cut'). Writes `out` (JSON), and beside it the .md table and the .png plot
    (attainment against rate, both modes, one panel per SLO pair). Returns the result dict.

    Raises:
        ValueError: fewer than 2 cores to pin to, an unknown profile, or an empty rate grid."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from relayinfer.device.profiles import load_profile
    from relayinfer.device.settings import Timing
    from relayinfer.protocol.model.model_file import resolve_model_path

    from .split import _CloudProcess, _git_commit

    profs = [load_profile(p) for p in profiles]  # unknown -> ValueError before anything loads
    if not profs or not (rates or validate_per_rate):
        raise ValueError("give at least one device profile, and one rate or a validation (no rates: validation only)")
    if pool_size < 1:
        raise ValueError(f"--prompts (the prompt pool) must be >= 1, got {pool_size}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"the benchmark pins the cloud and the load driver to two cores; this process may use {cores}")
    t_start = time.perf_counter()
    deadline = t_start + time_limit_s
    load0 = os.getloadavg()
    prio = session_priority()  # before the fork: the cloud process inherits the session and its niceness
    mp = resolve_model_path(model)
    cloud = _CloudProcess(mp, cores[0], kv_cache_mb, life_s=time_limit_s + 3600.0)
    res: dict = {"command": command, "profiles": list(profiles), "slos": [list(s) for s in slos],
                 "attainment_goal": ATTAINMENT_GOAL, "max_new_tokens": max_new_tokens, "target_tpot_ms": target_tpot_ms,
                 "rate_point": {"duration_s": duration_s, "max_requests": max_requests, "warmup_s": warmup_s,
                                "timeout_s": timeout_s},
                 "rates": list(rates), "buckets": {b: t for b, t in BUCKETS}}
    with cloud as (url, _http_url, fingerprint):
        os.sched_setaffinity(0, {cores[1]})  # the load driver (this thread) on the second core
        from relayinfer.sdk.engines import load_engine

        device_engine = load_engine("onnx", mp, quantize, threads=1)  # its tokenizer; the real device of the validation
        tok = device_engine.tokenizer()
        pool = _pool(tok, pool_size, seed)
        asyncio.run(_reference(url, fingerprint, pool, max_new_tokens, target_tpot_ms, timeout_s))
        print(f"[bench goodput] pool: {[(len(p['ids']), p['answer_len']) for p in pool]} (prompt, answer tokens)",
              flush=True)
        zero_ttft = _mean([p["zero_load_ttft_ms"] for p in pool])
        kw = dict(duration_s=duration_s, max_requests=max_requests, warmup_s=warmup_s, max_new_tokens=max_new_tokens,
                  target_tpot_ms=target_tpot_ms, timeout_s=timeout_s, cloud_pid=cloud.pid, refine=refine)
        from relayinfer.sdk import freeze_heap

        frozen = freeze_heap()  # the dataset and model: no full collection in the driver walks them during a sweep
        sweeps = {}
        zero = Timing(0, 0, 0, 0, 0)
        if rates:
            sweeps["cloud-only"] = asyncio.run(sweep(url, fingerprint, pool, "cloud-only", zero, rates, deadline, slos,
                                                     seed=seed, **kw))
        for prof in profs if rates else ():
            tm = Timing(prof.prefill_ms_base, prof.prefill_ms_per_token, prof.decode_ms_per_token, 0.0, 0.0)
            sweeps[f"split {prof.name}"] = asyncio.run(sweep(url, fingerprint, pool, "split", tm, rates, deadline, slos,
                                                             seed=seed, **kw))
        val = None
        if validate_per_rate:
            from relayinfer.sdk import Client

            from .split import _pin

            device_engine.warmup()
            prof = profs[0]
            client = Client(cloud_url=url, engine=device_engine, profile=prof.name if prof.name in profiles else profiles[0],
                            target_tpot_ms=target_tpot_ms)
            _pin(client._executor, cores[1])
            client.complete(pool[0]["ids"], max_new_tokens=8)  # first cloud estimates
            client.complete(pool[-1]["ids"], max_new_tokens=8, mode="cloud-only")  # a second prompt length
            tm = Timing(prof.prefill_ms_base, prof.prefill_ms_per_token, prof.decode_ms_per_token, 0.0, 0.0)

            async def _val():
                return await validate(url, fingerprint, pool, client, tm, validate_rates, validate_per_rate,
                                      max_new_tokens, target_tpot_ms, timeout_s, seed)
            val = asyncio.run(_val())
    res["pool"] = [{k: v for k, v in p.items() if k != "ids"} | {"prompt_tokens": len(p["ids"])} for p in pool]
    res["zero_load_ttft_ms_mean"] = zero_ttft
    res["sweeps"] = sweeps
    res["goodput"] = _goodput_table(sweeps, slos, zero_ttft)
    res["validation"] = val
    res["setup"] = {"cloud": f"CloudService(llm=AsyncLLMEngine(LLMEngine(TorchEngine cpu, 1 thread), {kv_cache_mb} MiB KV, "
                             f"no prefix cache)) in its own forked process pinned to core {cores[0]}",
                    "driver": f"virtual devices (bench.goodput.timed_request), one asyncio thread pinned to core {cores[1]}",
                    "validation_device": "sdk.Client + OnnxEngine 1 thread + PacedEngine(profile), pinned to core "
                                         f"{cores[1]}" if val else None,
                    "gc_frozen_objects": frozen,
                    "git_commit": _git_commit(), "cores": os.cpu_count(), "load_avg_start": list(load0),
                    "load_avg_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start, "priority": prio,
                    "shared_machine": "other processes ran on this machine: see load_avg_* and each point's load_avg_1m"}
    from .goodput_model import model

    try:
        res["model"] = model(res) if sweeps else None
    except ValueError as e:  # too few prompt lengths for the prefill fit
        res["model"] = None
        print(f"[bench goodput] no model: {e}", flush=True)
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    if plot and sweeps:
        res["plot"] = _plot(res, outp.with_suffix(".png"))
    outp.write_text(json.dumps(res, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))
    outp.with_suffix(".md").write_text(markdown(res))
    return res


def _goodput_table(sweeps: dict, slos, zero_ttft) -> list[dict]:
    """Per SLO pair: each mode's goodput, the split / cloud-only ratios, and each mode's bound (`bound_of`
    on its first failing point; None when no point failed)."""
    out = []
    for j, (ttft, tpot) in enumerate(slos):
        row = {"ttft_slo_ms": ttft, "tpot_slo_ms": tpot, "goodput_rps": {}, "ratio_over_cloud_only": {},
               "bound": {}, "lower_bound": {}}
        for mode, sw in sweeps.items():
            g = sw["goodput_rps"][j]
            row["goodput_rps"][mode] = g
            fail = next((p for p in sw["points"] if (p["slo"][j]["attainment"] or 0) < ATTAINMENT_GOAL), None)
            # no failing point: the sweep ran out of rates or time, the goodput is a lower bound
            row["lower_bound"][mode] = fail is None
            row["bound"][mode] = bound_of({**fail, **fail["slo"][j]}, zero_ttft) if fail else None
        c = row["goodput_rps"].get("cloud-only")
        for mode, g in row["goodput_rps"].items():
            if mode != "cloud-only":
                row["ratio_over_cloud_only"][mode] = (g / c) if c else (None if not g else float("inf"))
        out.append(row)
    return out


def _plot(res: dict, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = res["slos"]
    fig, axes = plt.subplots(1, len(slos), figsize=(5.2 * len(slos), 4.0), squeeze=False)
    for j, (ttft, tpot) in enumerate(slos):
        ax = axes[0][j]
        for mode, sw in res["sweeps"].items():
            xs = [p["offered_rps"] for p in sw["points"]]
            ys = [p["slo"][j]["attainment"] for p in sw["points"]]
            ax.plot(xs, [np.nan if y is None else y for y in ys], "o-", label=f"{mode} (goodput {sw['goodput_rps'][j]:g} rps)")
        ax.axhline(ATTAINMENT_GOAL, color="grey", ls="--", lw=1)
        ax.set(xscale="log", ylim=(-0.03, 1.03), xlabel="offered rate (requests/s, Poisson)", ylabel="SLO attainment",
               title=f"TTFT <= {ttft / 1e3:g} s, TPOT p90 <= {tpot:g} ms")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def arrived_rps(point: dict, rate_point: dict) -> float | None:
    """The rate (requests/s) the seeded Poisson draw of a point actually offered: its requests over
    the arrival window (`duration_s`, or the time of the last arrival when `max_requests` ended it).
    At low rates one 120 s draw can be far from the nominal rate (12 arrivals at 0.2 rps)."""
    window = point["arrivals_s"] if point["requests"] >= rate_point["max_requests"] else rate_point["duration_s"]
    return point["requests"] / window if window else None


def _priority_line(p: dict | None) -> str:
    """The run's CPU priority in words (`session_priority`)."""
    if not p:
        return "priority not recorded"
    ag = "its session's autogroup nice set to match" if p.get("set") else \
        f"autogroups {'on' if p.get('autogroup_enabled') else 'off'}, autogroup not changed"
    return f"nice {p['nice']}, {ag}"


def markdown(res: dict) -> str:
    """The tables of a `run_goodput_bench` result: goodput per SLO pair and mode, each rate point,
    and the validation summary."""
    f = lambda x, p=0: "-" if x is None else f"{x:,.{p}f}"  # noqa: E731
    s = res["setup"]
    lines = [f"`{res['command']}` (commit {s['git_commit']}; load average {s['load_avg_start'][0]:.1f} at the start, "
             f"{s['load_avg_end'][0]:.1f} at the end, on a shared {s['cores']}-core machine; rate points of "
             f"{res['rate_point']['duration_s']:g} s or {res['rate_point']['max_requests']} requests, first "
             f"{res['rate_point']['warmup_s']:g} s not measured; speed controller target TPOT "
             f"{res.get('target_tpot_ms', 50):g} ms; {_priority_line(s.get('priority'))})", "",
             "| SLO (TTFT / TPOT p90) | " + " | ".join(f"{m} goodput (rps)" for m in res["sweeps"]) +
             " | " + " | ".join(f"{m} / cloud-only" for m in res["sweeps"] if m != "cloud-only") + " | bound |",
             "|" + "---|" * (2 + 2 * (len(res["sweeps"]) - 1) + 1)]
    if not res["sweeps"]:
        lines = lines[:2] + ["(validation only: no rate sweep)"]
    for g in res["goodput"] if res["sweeps"] else ():
        gp = [f"{f(v, 2)}{' (>=)' if g['lower_bound'][m] else ''}" for m, v in g["goodput_rps"].items()]
        ratio = [f(g["ratio_over_cloud_only"][m], 1) for m in g["goodput_rps"] if m != "cloud-only"]
        bound = "; ".join(f"{m}: {b['verdict']} at {b['rate_rps']:g} rps" for m, b in g["bound"].items() if b)
        lines.append(f"| {g['ttft_slo_ms'] / 1e3:g} s / {g['tpot_slo_ms']:g} ms | " + " | ".join(gp) + " | "
                     + " | ".join(ratio) + f" | {bound or '-'} |")
    lines += [] if not res["sweeps"] else ["", "| mode | rate (rps) | arrived (rps) | measured | ok | " + " | ".join(f"attain {t / 1e3:g}s/{p:g}ms" for t, p in res["slos"])
              + " | TTFT p50 / p90 | TPOT p90 p50 / p90 | answer tok | cloud tok/req | cloud busy ms/req | cloud step ms |"
              " cloud CPU busy + wait | held | load avg |",
              "|" + "---|" * (5 + len(res["slos"]) + 9)]
    for mode, sw in res["sweeps"].items():
        for p in sw["points"]:
            lines.append(f"| {mode} | {p['offered_rps']:g} | {f(arrived_rps(p, res['rate_point']), 2)} | {p['measured']} | {p['ok']} | "
                         + " | ".join(f(x["attainment"], 2) for x in p["slo"])
                         + f" | {f(p['ttft_ms_p50'])} / {f(p['ttft_ms_p90'])} | {f(p['tpot_ms_p50'])} / {f(p['tpot_ms_p90'])} | "
                         f"{f(p['answer_tokens_mean'])} | {f(p['cloud_tokens_mean'], 1)} | {f(p['cloud_busy_ms_mean'])} | "
                         f"{f(p['cloud_step_ms_p50'])} | {f(p['cloud_cpu_busy'], 2)} + {f(p['cloud_cpu_wait'], 2)} | "
                         f"{f(p['cloud_concurrency'], 1)} | "
                         f"{p['load_avg_1m']:.1f} |")
    v = res.get("validation")
    if v:
        lines += ["", f"Validation: {len(v['pairs'])} real SplitSessions (profile {res['profiles'][0]}) at background "
                  f"rates {', '.join(f'{r:g}' for r in v['rates'])} rps; real device fit a {v['device_fit'][0]:.0f} ms, "
                  f"b {v['device_fit'][1]:.2f} ms/token, d {v['device_fit'][2]:.1f} ms.", "",
                  "| virtual twin | figure | pairs | median deviation | max deviation | within 10 % |", "|---|---|---|---|---|---|"]
        for name, figs in v["summary"].items():
            if name == "median_virtual_minus_real":
                continue
            for k, st in figs.items():
                lines.append(f"| {name} | {k} | {st['n']} | {f(st['median'] and st['median'] * 100, 1)} % | "
                             f"{f(st['max'] and st['max'] * 100, 1)} % | {f(st['within_10pct'] and st['within_10pct'] * 100)} % |")
        b = v["summary"]["median_virtual_minus_real"]
        lines.append(f"\nMedian virtual - real: split TTFT {f(b['split_ttft_ms'])} ms, TPOT {f(b['split_tpot_ms'], 1)} ms, "
                     f"hand-off index {f(b['split_handoff'], 1)}; replayed on the real stream: TTFT {f(b['replay_ttft_ms'], 1)} ms, "
                     f"TPOT {f(b['replay_tpot_ms'], 1)} ms, hand-off index {f(b['replay_handoff'], 1)}; "
                     f"cloud-only TTFT {f(b['cloud_only_ttft_ms'])} ms.")
    out = "\n".join(lines) + "\n"
    if res.get("model"):
        from .goodput_model import markdown as model_md

        out += model_md(res["model"])
    return out
