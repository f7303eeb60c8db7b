"""GR relay cascade benchmark (`relayinfer bench relay`, `relayinfer relay bench`, or this file run
directly): baseline vs relay under one ranking P99 budget, measured in one run.

    .venv/bin/python bench/relay.py [--quick] [--no-live] [--shape trained|production] [--out PATH] [--reuse-timings]

The driver lives in bench/ and imports the library (relayinfer.cloud.relay); the cascade simulator
is bench/relay_sim.py. The CLI loads this file with sdk.cli.bench_module("relay").

Steps (all on this machine):
1. the model whose cost is timed: `shape="trained"`, the shipped ML-100K checkpoint (d=64, 2 layers;
   its HR@10 / NDCG@10 vs popularity are reported), or `shape="production"`, a production-shaped HSTU
   (8 layers, d=256, histories up to 8k; PRODUCTION_SHAPE) with RANDOM weights, for timing only;
2. the latency model: that HSTU timed at several history lengths (full, prefix, cached rank);
3. workload: Poisson arrivals of ML-100K users; 90 % keep their real history (20-737 events), 10 % form
   a long-history tail whose real history is extended to L events (L swept over 256..8192) with earlier
   events of other real users (`data.extend_history`); N candidates per request;
4. sweep L at a fixed arrival rate (SIMULATED): ranking P99 per mode -> the longest L meeting the budget;
5. at the baseline's longest L, bisect the arrival rate (SIMULATED): the highest rate whose P99 meets the
   budget (SLO-compliant throughput, goodput) per mode;
6. real processes: the same kind of requests through 2 spawned instance processes (router + protocol +
   model) at a rate this machine holds, baseline then relay, and the simulator's prediction for the
   very same requests and settings beside it, with its relative error (`live_vs_sim`);
7. the JSON (bench/results/relay.json or relay_production.json), a P99 plot beside it, the Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/: the simulator beside this driver
from relay_sim import Request, SimConfig, Simulator, p99, poisson_requests  # noqa: E402,F401

from relayinfer.cloud.models.hstu import HSTU, PRODUCTION_SHAPE, HSTUConfig, kv_bytes_per_token
from relayinfer.cloud.relay.data import extend_history, load_ml100k
from relayinfer.cloud.relay.latency import LatencyModel, measure
from relayinfer.cloud.relay.train import cache_dir, default_checkpoint, load, save
from relayinfer.cloud.relay.trigger import TriggerConfig

PAPER = {"seq_len_ratio": 1.5, "throughput_ratio": 3.6}
GRID = [int(round(256 * 2 ** (k / 8))) for k in range(41)]   # 256 .. 8192, steps of 2^(1/8) (+9 %)


def workload(data, rng, rate, n, tail_len, tail_frac=0.1, p_return=0.1):
    """Requests whose length is the user's real history length, or tail_len for a tail user."""
    tail = {u for u in data.users if rng.random() < tail_frac}
    return poisson_requests(rate, n, data.users, lambda u: tail_len if u in tail else len(data.items[u]), rng,
                            p_return=p_return), tail


def longest_ok(curve: dict, budget: float) -> int:
    """Longest L in the sweep whose P99 meets the budget, all shorter ones meeting it too (0 if none)."""
    best = 0
    for L in sorted(curve):
        if curve[L] > budget:
            break
        best = L
    return best


def max_rate(sim, data, mode, L, budget, n, seed, lo=0.05, hi=None, iters=14) -> float:
    """Highest Poisson rate (req/s) whose ranking P99 meets the budget, by bisection (0 if none)."""
    def ok(rate):
        reqs, _ = workload(data, np.random.default_rng(seed), rate, n, L)
        return p99(sim.run(reqs, mode)["latency_ms"]) <= budget
    if not ok(lo):
        return 0.0
    hi = hi or lo * 2
    while ok(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def production_checkpoint(num_items: int) -> Path:
    """A production-shaped HSTU (PRODUCTION_SHAPE: 8 layers, d=256, 4 heads, 64 + 64 per head, max_len
    8193) with RANDOM weights (seed 0), saved under the cache dir. For timing only: its scores mean
    nothing. Returns the checkpoint path (written once)."""
    p = cache_dir() / "relay" / "hstu_production_random_init.pt"
    if not p.exists():
        torch.manual_seed(0)
        save(HSTU(HSTUConfig(num_items=num_items, **PRODUCTION_SHAPE)).eval(),
             {"random_init": True, "note": "random weights, timing study only"}, p)
    return p


def live_requests(data, rng, rate, n, L, n_cands):
    """The live check's workload: Poisson arrivals, half of the users with L-event (extended) histories.
    Returns (requests, histories by user, candidates by request index)."""
    reqs, tail = workload(data, rng, rate, n, L, tail_frac=0.5)
    hist = {u: (extend_history(data, u, L, np.random.default_rng(u)) if u in tail else (data.items[u], data.ts[u]))
            for u in {r.user for r in reqs}}
    cands = {i: rng.integers(1, data.num_items + 1, n_cands) for i in range(len(reqs))}
    return reqs, hist, cands


def live_cores(n_max: int = 2) -> tuple[int, list[list[int]]]:
    """Core plan for the real processes: (the client's core, one core per instance), disjoint, from the
    cores this process may use: the client on the first, instances on the others (at most n_max; at
    least one instance, sharing the client's core only on a 1-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return cores[0], [[cores[0]]]
    return cores[0], [[c] for c in cores[1:1 + n_max]]


async def _live(data, ck, lat_path, cfg: SimConfig, reqs, hist, cands, log, inst_cpus=None):
    """Real requests through cfg.instances instance processes per mode (router + protocol + model),
    each pinned to its own core (inst_cpus[k]) with one torch thread, each request's ranking sent
    delay_ms after its pre-infer signal, at the request time last event + 60 s. Returns per mode:
    latencies (ms, in request order), percentiles, sources, the instances' /stats."""
    from relayinfer.cloud.relay.client import RelayClient
    out = {}
    icfg = {"hbm_bytes": cfg.hbm_bytes, "dram_bytes": cfg.dram_bytes, "ttl_s": cfg.ttl_s,
            "dram_window_s": cfg.dram_window_s, "trigger": asdict(cfg.trigger)}
    L = max(r.length for r in reqs)
    for mode in ("baseline", "relay"):
        client = await RelayClient.launch(cfg.instances, str(ck), str(lat_path), icfg, baseline=mode == "baseline",
                                          lifetime_s=1800, cpus=inst_cpus)
        try:
            wu = extend_history(data, data.users[0], L, np.random.default_rng(0))
            await client.warm_up(wu[0], wu[1], cands[0])
            base = await asyncio.to_thread(client.instance_stats)    # the warm-up's compute, subtracted below
            lat_ms, sources = [np.nan] * len(reqs), [""] * len(reqs)
            t_start = time.monotonic()

            async def one(i, r):
                await asyncio.sleep(max(0.0, t_start + r.t0 - time.monotonic()))
                it, ts = hist[r.user]
                if mode == "relay":
                    await client.pre_infer(r.user, it, ts)
                await asyncio.sleep(cfg.delay_ms / 1e3)
                t = time.monotonic()
                _, src, _ = await client.rank(r.user, it, ts, cands[i], timeout_s=600, request_ts=int(ts[-1]) + 60)
                lat_ms[i], sources[i] = (time.monotonic() - t) * 1e3, src
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
            stats = await asyncio.to_thread(client.instance_stats)
            for s, b in zip(stats, base):
                for k in ("worker_busy_s", "worker_cpu_s"):
                    s[k] -= b[k]
        finally:
            await client.close()
        a = np.array(lat_ms)
        by = {s: np.array([x for x, y in zip(lat_ms, sources) if y == s]) for s in set(sources)}
        out[mode] = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                     "mean_ms": float(a.mean()), "max_ms": float(a.max()), "latency_ms": a.round(2).tolist(),
                     "sources": {s: len(v) for s, v in by.items()},
                     "p50_ms_by_source": {s: float(np.percentile(v, 50)) for s, v in by.items()},
                     "max_ms_by_source": {s: float(v.max()) for s, v in by.items()},
                     "instances": stats}
        log(f"live {mode}: P50 {out[mode]['p50_ms']:.0f} ms  P99 {out[mode]['p99_ms']:.0f} ms  {out[mode]['sources']}  "
            f"max by source {({k: round(v) for k, v in out[mode]['max_ms_by_source'].items()})}")
    return out


def live_vs_sim(live: dict, sims: dict) -> dict:
    """Per mode and statistic (p50, p99, mean): the simulator's prediction for the same requests and
    settings beside the real-process measurement, and the relative error (sim / real - 1)."""
    out = {}
    for name, sim in sims.items():
        out[name] = {}
        for mode in ("baseline", "relay"):
            a = sim[mode]
            pred = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": p99(a), "mean_ms": float(np.mean(a))}
            out[name][mode] = {k: {"real": live[mode][k], "sim": v, "error": v / live[mode][k] - 1}
                               for k, v in pred.items()}
    return out


def where_goodput_is_lost(sim, data, L, budget, n_req, thr) -> dict:
    """Diagnosis (SIMULATED, nothing here changes the reported settings): the relay's goodput at L
    with one limit lifted at a time, as a ratio to the baseline's goodput `thr["baseline"]`, plus the
    instances' utilisation (compute seconds / instance seconds) at each mode's highest passing rate.
    Variants: as run; no pre-inference token budget; no HBM pool limit; both; every request at risk
    (risk threshold 0: short histories pre-inferred too)."""
    c = sim.cfg
    t = c.trigger
    big = float(1 << 40)
    variants = {
        "as_run": c,
        "no_token_budget": SimConfig(**{**asdict(c), "trigger": TriggerConfig(**{**asdict(t), "token_rate": big, "token_burst": big})}),
        "no_pool_limit": SimConfig(**{**asdict(c), "hbm_bytes": 1 << 50, "trigger": t}),
        "no_token_budget_no_pool_limit": SimConfig(**{**asdict(c), "hbm_bytes": 1 << 50, "trigger": TriggerConfig(
            **{**asdict(t), "token_rate": big, "token_burst": big})}),
        "all_requests_pre_inferred": SimConfig(**{**asdict(c), "trigger": TriggerConfig(**{**asdict(t), "risk_fraction": 0.0})}),
    }

    def util(s, mode, rate):
        reqs, _ = workload(data, np.random.default_rng(2), rate, n_req, L)
        r = s.run(reqs, mode)
        return r["busy_s"] / (s.cfg.instances * (reqs[-1].t0 + s.cfg.delay_ms / 1e3)), r["counts"]

    out = {"baseline": {"rate_per_s": thr["baseline"], "utilisation": util(sim, "baseline", thr["baseline"])[0]}}
    for name, cfg in variants.items():
        s = Simulator(sim.lat, cfg)
        rate = thr["relay"] if name == "as_run" else max_rate(s, data, "relay", L, budget, n_req, seed=2)
        u, counts = util(s, "relay", rate)
        out[name] = {"rate_per_s": rate, "ratio": rate / thr["baseline"] if thr["baseline"] else None,
                     "utilisation": u, "counts_at_rate": counts}
    return out


def workload_variants(res: dict, variants=(("tail_frac", 0.3), ("p_return", 0.5)), log=print) -> dict:
    """Diagnosis (SIMULATED) on a finished results dict: the goodput ratio at its throughput length when
    the WORKLOAD differs in one respect (a larger share of long-history users; more users returning
    within 1-5 s, whose prefix the DRAM tier serves again), with the run's latency model and settings.
    Returns {"<field> <value>": {"baseline": req/s, "relay": req/s, "ratio": relay / baseline}}."""
    global workload
    st, lm = res["settings"], res["latency_model"]
    lat = LatencyModel.fit(lm["samples"])
    cfg = SimConfig(instances=st["instances"], delay_ms=st["delay_ms"], n_cands=st["n_cands"],
                    hbm_bytes=st["hbm_bytes_per_instance"], dram_bytes=st["dram_bytes_per_instance"],
                    ttl_s=st["ttl_s"], dram_window_s=st["dram_window_s"], chunk=res["model"]["query_chunk"],
                    layers=res["model"]["layers"], bytes_per_token=res["model"]["kv_bytes_per_token"] + 8,
                    trigger=TriggerConfig(**st["trigger"]))
    sim, data, base = Simulator(lat, cfg), load_ml100k(), workload
    out = {}
    try:
        for field_, value in variants:
            def varied(data, rng, rate, n, tail_len, tail_frac=0.1, p_return=0.1):
                kw = {"tail_frac": tail_frac, "p_return": p_return, field_: value}
                return base(data, rng, rate, n, tail_len, **kw)
            workload = varied                                 # max_rate() draws its requests from it
            thr = {m: max_rate(sim, data, m, res["throughput_len"], st["budget_ms"], st["requests_per_run"], seed=2)
                   for m in ("baseline", "relay")}
            out[f"{field_} {value}"] = {**thr, "ratio": thr["relay"] / thr["baseline"] if thr["baseline"] else None}
            log(f"workload {field_}={value}: goodput {thr} -> {out[f'{field_} {value}']['ratio']:.2f}x (simulated)")
    finally:
        workload = base
    return out


def run(out_json: Path, quick: bool = False, live: bool = True, log=print, shape: str = "trained",
        timings: Path | None = None) -> dict:
    """Run the whole benchmark; writes out_json, the plot next to it, and returns the results dict.
    shape "trained": the shipped ML-100K checkpoint (d=64, 2 layers); "production": a production-shaped
    HSTU with random weights (PRODUCTION_SHAPE), timing only. timings: a previous results JSON of the
    same shape whose latency samples are reused instead of timing the model again (its path is
    recorded). Raises ValueError on another shape."""
    if shape not in ("trained", "production"):
        raise ValueError(f"unknown shape {shape!r}")
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    all_cores = os.sched_getaffinity(0)
    data = load_ml100k()
    dck = default_checkpoint() if shape == "trained" else None
    metrics = load(dck)[1] if dck else {}
    if dck:
        log(f"default checkpoint {dck}: HR@10 {metrics['hr']:.4f} NDCG@10 {metrics['ndcg']:.4f} "
            f"(popularity {metrics['pop_hr']:.4f} / {metrics['pop_ndcg']:.4f})")
    if shape == "production":
        ck = production_checkpoint(data.num_items)
        lengths = [128, 256, 512, 1024] + ([] if quick else [1536, 2048])
        reps = dict(repeats=1 if quick else 2, repeats_short=2 if quick else 3)
    else:
        ck = dck
        lengths = [128, 256, 512, 1024, 1536, 2048] + ([] if quick else [3072, 4096])
        reps = dict(repeats=2 if quick else 3, repeats_short=3 if quick else 5)
    model, _ = load(ck)
    label = ("production-shaped HSTU, RANDOM weights (timing study only)" if shape == "production"
             else "trained ML-100K checkpoint (shipped default)")
    log(f"timing model: {label}: {model.cfg.layers} layers, d={model.cfg.dim}, "
        f"{kv_bytes_per_token(model.cfg)} B KV per history event")

    # 2. latency model on this machine (minimum of the repeats; medians kept for the live comparison)
    if timings:
        prev = json.loads(Path(timings).read_text())
        if prev.get("shape", "trained") != shape:
            raise ValueError(f"{timings} holds timings of the {prev.get('shape')!r} shape")
        samples, lengths = prev["latency_model"]["samples"], prev["latency_model"]["timed_lengths"]
        log(f"reusing the latency samples of {timings}")
    else:
        # timed on the core the first live instance will use, one thread
        os.sched_setaffinity(0, set(live_cores()[1][0]))
        try:
            samples = measure(model, lengths, [100], **reps)
        finally:
            os.sched_setaffinity(0, all_cores)
    lat = LatencyModel.fit(samples)
    lat_med = LatencyModel.fit([{**s, **{k: s[k + "_median"] for k in ("full_ms", "prefix_ms", "cached_ms")}}
                                for s in samples])
    lat_path = cache_dir() / "relay" / f"latency_{shape}.json"
    lat.to_json(lat_path)
    for s in samples:
        log(f"L={s['L']:5d} N={s['N']}: full {s['full_ms']:8.1f} ms  prefix {s['prefix_ms']:8.1f} ms  "
            f"cached rank {s['cached_ms']:6.1f} ms   (fit {lat.full_ms(s['L'], s['N']):8.1f} / "
            f"{lat.prefix_ms(s['L']):8.1f} / {lat.cached_ms(s['L'], s['N']):5.1f})")

    # 3. budget and cascade settings, derived from this machine's speed
    N = 100
    budget = float(np.ceil(1.25 * lat.full_ms(1024, N) / 10) * 10)   # P99 budget: 1.25 x full ranking at 1k events
    delay = budget                                                   # retrieval + pre-processing before ranking
    inst = 4
    # pre-inference load budget: at most 50 % of an instance's time spent on prefixes of 2k events; the
    # bucket holds at least one prefix of the longest swept history (else a slow model admits none)
    token_rate = 0.5 * 2048 / (lat.prefix_ms(2048) / 1e3)
    token_burst = max(2 * token_rate, float(GRID[-1]))
    bpt = kv_bytes_per_token(model.cfg) + 8
    dram_tokens = 512 * 1024 if shape == "trained" else 128 * 1024   # production: 16 KiB/event, 2 GiB of DRAM
    cfg = SimConfig(instances=inst, delay_ms=delay, n_cands=N, hbm_bytes=64 * 1024 * bpt, dram_bytes=dram_tokens * bpt,
                    chunk=model.cfg.query_chunk, layers=model.cfg.layers, bytes_per_token=bpt,
                    trigger=TriggerConfig(budget_ms=budget, risk_fraction=0.5, n_cands=N,
                                          token_rate=token_rate, token_burst=token_burst))
    sim = Simulator(lat, cfg)
    n_req = 1500 if quick else 4000
    # light fixed load for the length sweep (10 % of the baseline's capacity with 1k-event tails), so
    # that the longest length reflects latency; capacity is what the throughput step measures
    mean_real = float(np.mean([len(data.items[u]) for u in data.users]))
    svc_1k = 0.9 * lat.full_ms(int(mean_real), N) + 0.1 * lat.full_ms(1024, N)
    rate_a = 0.1 * inst / (svc_1k / 1e3)
    log(f"budget {budget:.0f} ms, retrieval+pre-processing {delay:.0f} ms, {inst} instances, N={N}, "
        f"rate {rate_a:.2f} req/s, pre-infer budget {token_rate:.0f} tokens/s/instance")

    # 4. length sweep (simulated; lengths above the largest timed one use the fitted curves)
    grid = GRID[:29:2] if quick else GRID
    curves = {"baseline": {}, "relay": {}}
    detail = {}
    for L in grid:
        reqs, _ = workload(data, np.random.default_rng(1), rate_a, n_req, L)
        for mode in curves:
            r = sim.run(reqs, mode)
            curves[mode][L] = p99(r["latency_ms"])
            if mode == "relay":
                detail[L] = {"counts": r["counts"], "hbm_peak_bytes": r["hbm_peak_bytes"],
                             "hbm_capacity_bytes": cfg.hbm_bytes}
        log(f"tail L={L:5d}: P99 baseline {curves['baseline'][L]:9.1f} ms  relay {curves['relay'][L]:9.1f} ms")
    best = {m: longest_ok(c, budget) for m, c in curves.items()}

    # 5. SLO-compliant throughput at the baseline's longest length (simulated)
    L_ref = best["baseline"] or grid[0]
    thr = {m: max_rate(sim, data, m, L_ref, budget, n_req, seed=2) for m in curves}
    log(f"longest tail meeting P99: {best}; max rate at L={L_ref}: {thr}")
    lost = where_goodput_is_lost(sim, data, L_ref, budget, n_req, thr)
    log("goodput variants (simulated, diagnosis only): " + "; ".join(
        f"{k}: {v['ratio']:.2f}x at utilisation {v['utilisation']:.0%}" for k, v in lost.items() if "ratio" in v)
        + f"; baseline utilisation {lost['baseline']['utilisation']:.0%}")

    res = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1,
                    "cpus": os.cpu_count()},
        "shape": shape,
        "model": {**model.describe(), "checkpoint": str(ck), "weights": "random-init" if shape == "production" else "trained",
                  "label": label},
        "quality": ({k: metrics.get(k) for k in ("hr", "ndcg", "pop_hr", "pop_ndcg", "users")} if dck else
                    "none: random weights (the trained checkpoint's quality is in relay.json)"),
        "quality_checkpoint": str(dck) if dck else None,
        "latency_model": {"full": lat.full, "prefix": lat.prefix, "cached": lat.cached, "samples": samples,
                          "timed_lengths": lengths, "samples_from": str(timings) if timings else "timed in this run"},
        "settings": {"budget_ms": budget, "delay_ms": delay, "instances": inst, "n_cands": N,
                     "rate_sweep_per_s": rate_a, "requests_per_run": n_req, "tail_frac": 0.1, "p_return": 0.1,
                     "hbm_bytes_per_instance": cfg.hbm_bytes, "dram_bytes_per_instance": cfg.dram_bytes,
                     "ttl_s": cfg.ttl_s, "dram_window_s": cfg.dram_window_s, "trigger": asdict(cfg.trigger),
                     "quick": quick},
        "simulated": "p99_ms_vs_tail_len, longest_len_meeting_p99 and slo_throughput_per_s come from the cascade "
                     "simulator driven by the latency model timed on this machine",
        "p99_ms_vs_tail_len": {m: {str(k): v for k, v in c.items()} for m, c in curves.items()},
        "relay_detail": {str(k): v for k, v in detail.items()},
        "longest_len_meeting_p99": best,
        "seq_len_ratio": best["relay"] / best["baseline"] if best["baseline"] else None,
        "throughput_len": L_ref,
        "slo_throughput_per_s": thr,
        "throughput_ratio": thr["relay"] / thr["baseline"] if thr["baseline"] else None,
        "goodput_where_lost": lost,
        "paper": PAPER,
    }
    if live:
        # 6. real processes at a rate this machine holds (25 % of the live instances' baseline capacity),
        # each instance pinned to its own core with one thread, the client on another; and the
        # simulator's prediction for the very same requests and settings
        L_live = (512 if shape == "production" else 1024) if quick else L_ref
        n_live = 24 if quick else (40 if shape == "production" else 60)
        client_core, inst_cpus = live_cores()
        cfg_live = SimConfig(**{**asdict(cfg), "instances": len(inst_cpus), "trigger": cfg.trigger})
        svc = 0.5 * lat.full_ms(L_live, N) + 0.5 * lat.full_ms(int(mean_real), N)
        rate_live = 0.25 * cfg_live.instances / (svc / 1e3)
        reqs, hist, cands = live_requests(data, np.random.default_rng(3), rate_live, n_live, L_live, N)
        os.sched_setaffinity(0, {client_core})       # the client (this process) on its own core
        res["live"] = asyncio.run(_live(data, ck, lat_path, cfg_live, reqs, hist, cands, log, inst_cpus))
        os.sched_setaffinity(0, all_cores)
        res["live"]["workload"] = {"requests": n_live, "rate_per_s": rate_live, "tail_len": L_live, "tail_frac": 0.5,
                                   "instances": cfg_live.instances, "client_core": client_core,
                                   "instance_cores": inst_cpus, "threads_per_instance": 1}
        runs = {name: {m: Simulator(lm, cfg_live).run(reqs, m) for m in ("baseline", "relay")}
                for name, lm in (("sim_min_fit", lat), ("sim_median_fit", lat_med))}
        # the machine is shared: compute seconds the instances really spent vs the simulator's, per mode;
        # the simulator re-run with the latency curves scaled by that slowdown separates queueing from it
        slow = {m: sum(s["worker_busy_s"] for s in res["live"][m]["instances"]) / runs["sim_min_fit"][m]["busy_s"]
                for m in ("baseline", "relay")}
        res["live"]["compute_slowdown_vs_latency_model"] = slow
        # split into the latency model's error on the instances' own CPU time and the wait for a core
        # (wall busy / CPU busy > 1: other jobs ran on the instance's core)
        res["live"]["cpu_time_vs_latency_model"] = {
            m: sum(s["worker_cpu_s"] for s in res["live"][m]["instances"]) / runs["sim_min_fit"][m]["busy_s"]
            for m in ("baseline", "relay")}
        res["live"]["core_wait_factor"] = {
            m: sum(s["worker_busy_s"] for s in res["live"][m]["instances"]) /
            max(1e-9, sum(s["worker_cpu_s"] for s in res["live"][m]["instances"])) for m in ("baseline", "relay")}
        log(f"instances' CPU time / latency model: {res['live']['cpu_time_vs_latency_model']}; "
            f"wall / CPU time (waiting for a core): {res['live']['core_wait_factor']}")
        runs["sim_scaled_by_measured_slowdown"] = {m: Simulator(lat.scaled(slow[m]), cfg_live).run(reqs, m)
                                                   for m in ("baseline", "relay")}
        sims = {name: {m: r["latency_ms"] for m, r in rr.items()} for name, rr in runs.items()}
        res["live_vs_sim"] = live_vs_sim(res["live"], sims)
        log(f"compute slowdown of the real instances vs the latency model: {slow}")
        for name, v in res["live_vs_sim"].items():
            log(f"{name}: " + "; ".join(f"{m} P99 real {v[m]['p99_ms']['real']:.0f} sim {v[m]['p99_ms']['sim']:.0f} ms "
                                        f"({v[m]['p99_ms']['error']:+.0%})" for m in ("baseline", "relay")))
    res["bench_s"] = time.perf_counter() - t_start
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    plot(res, out_json.with_name(out_json.stem + "_p99.png"))
    log(table(res))
    return res


def plot(res: dict, path: Path) -> None:
    """PNG: ranking P99 (ms, log) vs tail history length per mode, with the budget line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, c in res["p99_ms_vs_tail_len"].items():
        xs = sorted(int(k) for k in c)
        ax.plot(xs, [c[str(x)] for x in xs], marker="o", label=mode)
    ax.axhline(res["settings"]["budget_ms"], color="gray", ls="--", label="P99 budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("long-tail history length (events)")
    ax.set_ylabel("ranking P99 latency (ms)")
    ax.set_title("HSTU ranking on ML-100K + long tail: P99 vs history length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(res: dict) -> str:
    """Markdown tables: benchmark ratios beside the paper's, live vs simulator, HR@10 / NDCG@10 vs popularity."""
    b, r = res["longest_len_meeting_p99"], res["slo_throughput_per_s"]
    q = res["quality"]
    sl = res["seq_len_ratio"]
    tr = res["throughput_ratio"]
    fmt = lambda x: f"{x:.2f}x" if x else "n/a"  # noqa: E731
    lines = [
        f"Timing model: {res['model']['label']} ({res['model']['layers']} layers, d={res['model']['dim']}).",
        "",
        f"| metric (P99 budget {res['settings']['budget_ms']:.0f} ms, simulated) | baseline | relay | relay / baseline | paper |",
        "|---|---|---|---|---|",
        f"| longest tail history meeting P99 (events) | {b['baseline']} | {b['relay']} | {fmt(sl)} | {PAPER['seq_len_ratio']}x |",
        f"| SLO-compliant throughput at {res['throughput_len']} events (req/s) | {r['baseline']:.2f} | {r['relay']:.2f} | "
        f"{fmt(tr)} | {PAPER['throughput_ratio']}x |",
    ]
    if "live_vs_sim" in res:
        w = res["live"]["workload"]
        sl = res["live"].get("compute_slowdown_vs_latency_model", {})
        lines += ["", f"| real processes vs simulator ({w['instances']} instances, {w['requests']} requests at "
                      f"{w['rate_per_s']:.2f} req/s, half with {w['tail_len']}-event histories) | real | sim (min fit) | error "
                      f"| sim (median fit) | error | sim x measured slowdown | error |", "|---|---|---|---|---|---|---|---|"]
        a, m = res["live_vs_sim"]["sim_min_fit"], res["live_vs_sim"]["sim_median_fit"]
        c = res["live_vs_sim"].get("sim_scaled_by_measured_slowdown", a)
        for mode in ("baseline", "relay"):
            for k in ("p50_ms", "p99_ms", "mean_ms"):
                lines.append(f"| {mode} {k[:-3].upper() if k != 'mean_ms' else 'mean'} (ms) | {a[mode][k]['real']:.0f} | "
                             f"{a[mode][k]['sim']:.0f} | {a[mode][k]['error']:+.0%} | {m[mode][k]['sim']:.0f} | "
                             f"{m[mode][k]['error']:+.0%} | {c[mode][k]['sim']:.0f} | {c[mode][k]['error']:+.0%} |")
        if sl:
            lines.append(f"\nCompute slowdown of the real instances vs the latency model (shared machine): "
                         f"baseline {sl['baseline']:.2f}x, relay {sl['relay']:.2f}x.")
    if not isinstance(q, dict):
        return "\n".join(lines)
    lines += [
        "",
        "| ML-100K, leave-last-out, full sort | HR@10 | NDCG@10 |",
        "|---|---|---|",
        f"| HSTU (shipped default checkpoint) | {q['hr']:.4f} | {q['ndcg']:.4f} |",
        f"| popularity | {q['pop_hr']:.4f} | {q['pop_ndcg']:.4f} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="GR relay cascade benchmark")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: results/ beside this file, "
                   "whatever the working directory; the CLI's default is under the working directory)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-live", action="store_true")
    p.add_argument("--shape", choices=("trained", "production"), default="trained")
    p.add_argument("--reuse-timings", action="store_true", help="reuse the latency samples of the existing --out JSON")
    p.add_argument("--workload-variants", action="store_true",
                   help="only add the simulated goodput under workload variants to the existing --out JSON")
    a = p.parse_args()
    out = a.out or Path(__file__).parent / "results" / ("relay.json" if a.shape == "trained" else "relay_production.json")
    if a.workload_variants:
        res = json.loads(out.read_text())
        res["goodput_workload_variants"] = {**workload_variants(res), "command": " ".join(["bench/relay.py", *sys.argv[1:]])}
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out.resolve()}")
        sys.exit(0)
    prev = None
    if a.reuse_timings:
        prev = out.with_name(out.stem + ".timings.json")
        prev.write_text(out.read_text())
    run(out, quick=a.quick, live=not a.no_live, shape=a.shape, timings=prev)
    print(f"wrote {out.resolve()}")
