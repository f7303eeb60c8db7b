"""`relayinfer bench relay`: baseline vs relay under one ranking P99 budget, measured in one run.

Steps (all on this machine):
1. the trained HSTU checkpoint (trained first if missing) and its HR@10 / NDCG@10 vs popularity;
2. the latency model: the real HSTU timed at several history lengths (full, prefix, cached rank);
3. workload: Poisson arrivals of ML-100K users; 90 % keep their real history (20-737 events), 10 % form
   a long-history tail whose real history is extended to L events (L swept over 256..8192) with earlier
   events of other real users (`data.extend_history`); N candidates per request;
4. sweep L at a fixed arrival rate: ranking P99 per mode -> the longest L meeting the budget per mode;
5. at the baseline's longest L, bisect the arrival rate: the highest rate whose P99 meets the budget
   (SLO-compliant throughput) per mode;
6. a live check: the same kind of requests through real instance processes (router + protocol),
   baseline then relay, with measured latencies and prefix sources;
7. bench/results/relay.json, relay_p99.png, and the Markdown table (printed, and in RELAY.md).
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from relayinfer.cloud.models.hstu import kv_bytes_per_token
from relayinfer.cloud.relay.data import extend_history, load_ml100k
from relayinfer.cloud.relay.latency import LatencyModel, measure
from relayinfer.cloud.relay.sim import SimConfig, Simulator, p99, poisson_requests
from relayinfer.cloud.relay.train import checkpoint_path, ensure_checkpoint, load
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


async def _live(data, ck, lat_path, cfg: SimConfig, L, n, rate, seed, log):
    """Real requests through two spawned instance processes per mode (router + protocol + model)."""
    from relayinfer.cloud.relay.client import RelayClient, spawn_instance
    rng = np.random.default_rng(seed)
    reqs, tail = workload(data, rng, rate, n, L, tail_frac=0.5)
    hist = {u: (extend_history(data, u, L, np.random.default_rng(u)) if u in tail else (data.items[u], data.ts[u]))
            for u in {r.user for r in reqs}}
    cands = {i: rng.integers(1, data.num_items + 1, cfg.n_cands) for i in range(len(reqs))}
    out = {}
    icfg = {"hbm_bytes": cfg.hbm_bytes, "dram_bytes": cfg.dram_bytes, "ttl_s": cfg.ttl_s,
            "dram_window_s": cfg.dram_window_s, "trigger": asdict(cfg.trigger)}
    for mode in ("baseline", "relay"):
        procs = [spawn_instance(f"i{k}", str(ck), str(lat_path), icfg, baseline=mode == "baseline", lifetime_s=600)
                 for k in range(2)]
        try:
            client = await RelayClient.connect({p.name: p.url for p in procs}, procs[0].fingerprint)
            wu = extend_history(data, data.users[0], L, np.random.default_rng(0))
            await client.warm_up(wu[0], wu[1], cands[0])
            lat_ms, sources, t_start = [], [], time.monotonic()

            async def one(i, r):
                await asyncio.sleep(max(0.0, t_start + r.t0 - time.monotonic()))
                it, ts = hist[r.user]
                if mode == "relay":
                    await client.pre_infer(r.user, it, ts)
                await asyncio.sleep(cfg.delay_ms / 1e3)
                t = time.monotonic()
                _, src, _ = await client.rank(r.user, it, ts, cands[i])
                lat_ms.append((time.monotonic() - t) * 1e3)
                sources.append(src)
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
            stats = [p.stats() for p in procs]
            await client.close()
        finally:
            for p in procs:
                p.stop()
        a = np.array(lat_ms)
        by = {s: np.array([x for x, y in zip(lat_ms, sources) if y == s]) for s in set(sources)}
        out[mode] = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                     "max_ms": float(a.max()), "sources": {s: len(v) for s, v in by.items()},
                     "p50_ms_by_source": {s: float(np.percentile(v, 50)) for s, v in by.items()},
                     "max_ms_by_source": {s: float(v.max()) for s, v in by.items()},
                     "instances": stats}
        log(f"live {mode}: P50 {out[mode]['p50_ms']:.0f} ms  P99 {out[mode]['p99_ms']:.0f} ms  {out[mode]['sources']}  "
            f"max by source {({k: round(v) for k, v in out[mode]['max_ms_by_source'].items()})}")
    out["workload"] = {"requests": n, "rate_per_s": rate, "tail_len": L, "tail_frac": 0.5}
    return out


def run(out_json: Path, quick: bool = False, live: bool = True, log=print) -> dict:
    """Run the whole benchmark; writes out_json, the plot next to it, and returns the results dict."""
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    ck = ensure_checkpoint(quick=True, log=log)
    model, metrics = load(ck)
    data = load_ml100k()
    log(f"checkpoint {ck}: HR@10 {metrics.get('hr', float('nan')):.4f} NDCG@10 {metrics.get('ndcg', float('nan')):.4f} "
        f"(popularity {metrics.get('pop_hr', float('nan')):.4f} / {metrics.get('pop_ndcg', float('nan')):.4f})")

    # 2. latency model on this machine
    lengths = [128, 256, 512, 1024, 1536, 2048] + ([] if quick else [3072, 4096])
    samples = measure(model, lengths, [100], repeats=2 if quick else 3, repeats_short=3 if quick else 5)
    lat = LatencyModel.fit(samples)
    lat_path = checkpoint_path().with_name("latency.json")
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
    # pre-inference load budget: at most 50 % of an instance's time spent on prefixes of 2k events
    token_rate = 0.5 * 2048 / (lat.prefix_ms(2048) / 1e3)
    cfg = SimConfig(instances=inst, delay_ms=delay, n_cands=N, hbm_bytes=64 << 20, dram_bytes=512 << 20,
                    chunk=model.cfg.query_chunk, layers=model.cfg.layers,
                    bytes_per_token=kv_bytes_per_token(model.cfg) + 8,
                    trigger=TriggerConfig(budget_ms=budget, risk_fraction=0.5, n_cands=N,
                                          token_rate=token_rate, token_burst=2 * token_rate))
    sim = Simulator(lat, cfg)
    n_req = 1500 if quick else 4000
    # light fixed load for the length sweep (10 % of the baseline's capacity with 1k-event tails), so
    # that the longest length reflects latency; capacity is what the throughput step measures
    mean_real = float(np.mean([len(data.items[u]) for u in data.users]))
    svc_1k = 0.9 * lat.full_ms(int(mean_real), N) + 0.1 * lat.full_ms(1024, N)
    rate_a = 0.1 * inst / (svc_1k / 1e3)
    log(f"budget {budget:.0f} ms, retrieval+pre-processing {delay:.0f} ms, {inst} instances, N={N}, "
        f"rate {rate_a:.1f} req/s, pre-infer budget {token_rate:.0f} tokens/s/instance")

    # 4. length sweep
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

    # 5. SLO-compliant throughput at the baseline's longest length
    L_ref = best["baseline"] or grid[0]
    thr = {m: max_rate(sim, data, m, L_ref, budget, n_req, seed=2) for m in curves}
    log(f"longest tail meeting P99: {best}; max rate at L={L_ref}: {thr}")

    res = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1,
                    "cpus": os.cpu_count()},
        "model": {**model.describe(), "checkpoint": str(ck)},
        "quality": {k: metrics.get(k) for k in ("hr", "ndcg", "pop_hr", "pop_ndcg", "users")},
        "latency_model": {"full": lat.full, "prefix": lat.prefix, "cached": lat.cached, "samples": samples},
        "settings": {"budget_ms": budget, "delay_ms": delay, "instances": inst, "n_cands": N,
                     "rate_sweep_per_s": rate_a, "requests_per_run": n_req, "tail_frac": 0.1, "p_return": 0.1,
                     "hbm_bytes_per_instance": cfg.hbm_bytes, "dram_bytes_per_instance": cfg.dram_bytes,
                     "ttl_s": cfg.ttl_s, "dram_window_s": cfg.dram_window_s, "trigger": asdict(cfg.trigger),
                     "quick": quick},
        "p99_ms_vs_tail_len": {m: {str(k): v for k, v in c.items()} for m, c in curves.items()},
        "relay_detail": {str(k): v for k, v in detail.items()},
        "longest_len_meeting_p99": best,
        "seq_len_ratio": best["relay"] / best["baseline"] if best["baseline"] else None,
        "throughput_len": L_ref,
        "slo_throughput_per_s": thr,
        "throughput_ratio": thr["relay"] / thr["baseline"] if thr["baseline"] else None,
        "paper": PAPER,
    }
    if live:
        L_live = 1024 if quick else L_ref
        res["live"] = asyncio.run(_live(data, ck, lat_path, cfg, L_live, 24 if quick else 60, 2.0, 3, log))
    res["bench_s"] = time.perf_counter() - t_start
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    plot(res, out_json.with_name("relay_p99.png"))
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
    """Markdown tables: benchmark ratios beside the paper's, and HR@10 / NDCG@10 vs popularity."""
    b, r = res["longest_len_meeting_p99"], res["slo_throughput_per_s"]
    q = res["quality"]
    sl = res["seq_len_ratio"]
    tr = res["throughput_ratio"]
    fmt = lambda x: f"{x:.2f}x" if x else "n/a"  # noqa: E731
    return "\n".join([
        f"| metric (P99 budget {res['settings']['budget_ms']:.0f} ms) | baseline | relay | relay / baseline | paper |",
        "|---|---|---|---|---|",
        f"| longest tail history meeting P99 (events) | {b['baseline']} | {b['relay']} | {fmt(sl)} | {PAPER['seq_len_ratio']}x |",
        f"| SLO-compliant throughput at {res['throughput_len']} events (req/s) | {r['baseline']:.2f} | {r['relay']:.2f} | "
        f"{fmt(tr)} | {PAPER['throughput_ratio']}x |",
        "",
        f"| ML-100K, leave-last-out, full sort | HR@10 | NDCG@10 |",
        "|---|---|---|",
        f"| HSTU (this checkpoint) | {q['hr']:.4f} | {q['ndcg']:.4f} |",
        f"| popularity | {q['pop_hr']:.4f} | {q['pop_ndcg']:.4f} |",
    ])
