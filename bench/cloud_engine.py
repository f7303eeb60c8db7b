"""Serving benchmark of the continuous-batching engine against one-request-at-a-time.

Conventions of vLLM's `benchmarks/benchmark_serving.py`: requests arrive as a Poisson process at
several request rates (rate `inf` = all at t=0, here 16 concurrent requests), prompts are real
chat prompts (`chitchat-dataset`, chat template applied, mixed lengths), and per request we measure
TTFT (arrival -> first token), TPOT ((last token - first token) / (output tokens - 1)) and report
output tokens/s, p50/p99 of both, and goodput = requests/s whose TTFT <= 1 s and TPOT <= 100 ms
(per-request SLOs, vLLM's `--goodput` definition).

Engine side: `LLMEngine` stepped on this thread, requests added at their arrival times (real
clock). Baseline: `TorchEngine` serving one request at a time in FIFO order. Its service time does
not depend on the load, so each request's token timeline is measured served back to back (twice,
around the engine's rate-inf run, keeping each request's faster timeline: the machine is shared)
and the single FIFO server is replayed for every rate's arrival times (exact for a FIFO queue;
saves minutes of idle waiting). Greedy sampling, so both sides produce the same tokens (checked).

    python bench/cloud_engine.py [--requests 16] [--max-new-tokens 96] [--lengths 32,64,96,128]
                                 [--rates 1,2,inf] [--threads 1] [--stop-at-eos]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import platform
import time
from pathlib import Path

import numpy as np
import torch

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.metrics import EngineMetrics
from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.protocol.model.decoding import SamplingParams, finish_reason, sample
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.sdk.datasets import chitchat_prompts_by_length

TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.100
OUT = Path(__file__).parent / "results"
IGNORE_EOS = True  # fixed output lengths, as vLLM's benchmark (--ignore-eos); set by --stop-at-eos


def summarize(name: str, rate: float, arrivals, first, last, ntok, span_s: float) -> dict:
    ttft = np.array([f - a for a, f in zip(arrivals, first)])
    tpot = np.array([(l - f) / (n - 1) if n > 1 else 0.0 for f, l, n in zip(first, last, ntok)])
    good = int(np.sum((ttft <= TTFT_SLO_S) & (tpot <= TPOT_SLO_S)))
    return {"system": name, "rate": rate, "requests": len(arrivals), "output_tokens": int(sum(ntok)),
            "duration_s": round(float(span_s), 3), "output_tok_s": round(float(sum(ntok) / span_s), 2),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)) * 1e3, 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1e3, 1),
            "tpot_p50_ms": round(float(np.percentile(tpot, 50)) * 1e3, 1),
            "tpot_p99_ms": round(float(np.percentile(tpot, 99)) * 1e3, 1),
            "goodput_req_s": round(float(good / span_s), 3), "good_requests": good}


def baseline_profiles(te: TorchEngine, prompts, params) -> list[dict]:
    """Serve each prompt alone; token times relative to the request's start (s)."""
    out = []
    for ids in prompts:
        t0 = time.perf_counter()
        logits, kv = te.prefill(ids)
        toks, times = [], []
        for i in range(params.max_new_tokens):
            tok = sample(logits, params, i)
            toks.append(tok)
            times.append(time.perf_counter() - t0)
            if finish_reason(tok, i + 1, params, -1 if IGNORE_EOS else te.eos_id):
                break
            logits, kv = te.decode(tok, kv)
        out.append({"tokens": toks, "times": times})
    return out


def replay_fifo(profiles, arrivals):
    """One FIFO server: request i starts when it has arrived and request i-1 is done."""
    free_at, first, last = 0.0, [], []
    for p, a in zip(profiles, arrivals):
        start = max(a, free_at)
        first.append(start + p["times"][0])
        last.append(start + p["times"][-1])
        free_at = last[-1]
    return first, last


def run_engine(engine: LLMEngine, metrics: EngineMetrics, prompts, params, arrivals, tag: str):
    """Add request i at arrivals[i] (s after start) and step until all finish (`metrics` observes
    each step)."""
    n = len(prompts)
    first, last, toks = [None] * n, [None] * n, [[] for _ in range(n)]
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(f"{tag}-{nxt}", prompts[nxt], params, ignore_eos=IGNORE_EOS)
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        metrics.observe(outs, engine.last_stats)
        for o in outs:
            i = int(o.request_id.rsplit("-", 1)[1])
            t = time.perf_counter() - t0
            if first[i] is None:
                first[i] = t
            last[i] = t
            toks[i].append(o.token_id)
    return first, last, toks, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rates", default="1,2,inf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="32,64,96,128", help="prompt length targets (tokens), mixed")
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-at-eos", action="store_true", help="end answers at EOS (output lengths vary)")
    args = ap.parse_args()
    global IGNORE_EOS
    IGNORE_EOS = not args.stop_at_eos
    torch.set_num_threads(args.threads)
    te = TorchEngine(device="cpu", threads=args.threads)
    tok = Tokenizer.from_gguf(te.model_path)
    lengths = [int(x) for x in args.lengths.split(",")]
    per = math.ceil(args.requests / len(lengths))
    pool = chitchat_prompts_by_length(tok, lengths, per_length=per, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = [pool[i] for i in rng.permutation(len(pool))[: args.requests]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    te.warmup()
    engine = LLMEngine(te, kv_cache_bytes=512 << 20, max_num_batched_tokens=args.max_batched_tokens,
                       max_num_seqs=64)
    metrics = EngineMetrics(engine)
    engine.generate([prompts[0][:16]], SamplingParams(max_new_tokens=2))  # warm-up
    rates = sorted((float(x) for x in args.rates.split(",")), key=lambda r: not math.isinf(r))
    # The machine is shared, so the baseline is measured twice, right before and right after the
    # engine's rate-inf run, and each request keeps its faster timeline (favours the baseline).
    t = time.perf_counter()
    prof_a = baseline_profiles(te, prompts, params)
    base_serial_s = time.perf_counter() - t
    runs, prof_stats = {}, None
    for r in rates:
        arrivals = [0.0] * args.requests if math.isinf(r) else list(np.cumsum(rng.exponential(1.0 / r, args.requests)))
        prof = cProfile.Profile() if math.isinf(r) else None
        if prof:
            prof.enable()
        runs[r] = (arrivals, run_engine(engine, metrics, prompts, params, arrivals, f"r{r}"))
        if prof:
            prof.disable()
            prof_stats = pstats.Stats(prof)
            t = time.perf_counter()
            prof_b = baseline_profiles(te, prompts, params)
            base_serial_s = min(base_serial_s, time.perf_counter() - t)
            profiles = [a if a["times"][-1] <= b["times"][-1] else b for a, b in zip(prof_a, prof_b)]
    rows, mismatches = [], 0
    for r in sorted(runs):
        arrivals, (efirst, elast, etoks, span) = runs[r]
        first, last = replay_fifo(profiles, arrivals)
        ntok = [len(p["tokens"]) for p in profiles]
        rows.append(summarize("one-at-a-time (TorchEngine)", r, arrivals, first, last, ntok, max(last)))
        mismatches += sum(a != p["tokens"] for a, p in zip(etoks, profiles))
        rows.append(summarize("LLMEngine (continuous batching)", r, arrivals, efirst, elast,
                              [len(x) for x in etoks], span))
        print(rows[-2], "\n", rows[-1], flush=True)
    # where the time goes at 16 concurrent requests (rate inf), from cProfile's own times
    total = prof_stats.total_tt
    groups = [("linear", "linear (matmuls: QKV/O, SwiGLU, lm_head)"),
              ("index_select", "attention: gather K/V by block table"),
              ("scaled_dot_product_attention", "attention: SDPA"),
              ("argmax", "sampling (numpy argmax) + logits copy"), ("numpy", "sampling (numpy argmax) + logits copy")]
    prof_rows = {}
    for (fn_file, _, fn), st in prof_stats.stats.items():
        if fn_file == "~":  # C functions: torch ops, numpy, builtins
            key = next((g for sub, g in groups if sub in fn), None)
            if key is None:
                key = "other torch ops (KV write, RoPE, norms, SiLU, cat)" if "torch" in fn else \
                    "python scheduling / bookkeeping / interpreter"
        else:
            key = "python scheduling / bookkeeping / interpreter"
        prof_rows[key] = prof_rows.get(key, 0.0) + st[2]
    profile = {k: round(100 * v / total, 1) for k, v in sorted(prof_rows.items(), key=lambda kv: -kv[1])}
    # decode-only steady state: one decode alone vs one batched step of 16 decodes
    _, kv = te.prefill(prompts[0])
    eng2 = LLMEngine(te, kv_cache_bytes=256 << 20, max_num_batched_tokens=4096)
    for i in range(16):
        eng2.add_request(f"d{i}", prompts[i % len(prompts)], SamplingParams(max_new_tokens=40), ignore_eos=True)
    while any(s.num_output_tokens == 0 for s in eng2.seqs.values()) or eng2._inbox:
        eng2.step()
    singles, steps = [], []
    for _ in range(10):  # interleaved, medians: both see the same machine load
        t = time.perf_counter()
        te.decode(5, kv)
        singles.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert len(eng2.step()) == 16
        steps.append(time.perf_counter() - t)
    single_ms, step16_ms = float(np.median(singles)) * 1e3, float(np.median(steps)) * 1e3
    inf_rows = [x for x in rows if math.isinf(x["rate"])]
    ratio = inf_rows[1]["output_tok_s"] / inf_rows[0]["output_tok_s"]
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} thread(s)",
        "model": te.cfg.name, "args": vars(args), "prompt_lengths": [len(p) for p in prompts],
        "baseline_serial_s": round(base_serial_s, 2), "token_mismatches_vs_baseline": mismatches,
        "rows": rows, "ratio_output_tok_s_16_concurrent": round(ratio, 2),
        "decode_only": {"single_decode_ms": round(single_ms, 1), "batch16_decode_step_ms": round(step16_ms, 1),
                        "ratio": round(16 * single_ms / step16_ms, 2)},
        "profile_pct_at_16_concurrent": profile,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "prefix_hit_rate": metrics.registry.get_sample_value("relayinfer_engine_prefix_cache_hit_rate"),
        "preemptions": engine.scheduler.num_preemptions,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "cloud_engine.json").write_text(json.dumps(result, indent=1))
    lines = ["# Cloud engine: continuous batching vs one request at a time", "",
             f"{result['machine']}; model {result['model']}; {args.requests} requests per rate, prompts "
             f"{min(result['prompt_lengths'])}-{max(result['prompt_lengths'])} tokens (chitchat), greedy, "
             f"{'max ' if args.stop_at_eos else ''}{args.max_new_tokens} new tokens{'' if args.stop_at_eos else ' (ignore EOS)'}; token mismatches vs baseline: {mismatches}.", "",
             "| system | rate (req/s) | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | goodput (req/s) |",
             "|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['system']} | {x['rate']} | {x['output_tok_s']} | {x['ttft_p50_ms']} / {x['ttft_p99_ms']} | "
                     f"{x['tpot_p50_ms']} / {x['tpot_p99_ms']} | {x['goodput_req_s']} |")
    d = result["decode_only"]
    lines += ["", f"Output tokens/s at 16 concurrent requests (rate inf): **{ratio:.2f}x** one-at-a-time (goal 4x).",
              f"Decode only: one decode {d['single_decode_ms']} ms, one step of 16 decodes {d['batch16_decode_step_ms']} ms "
              f"-> {d['ratio']}x.", "", "Where the engine's time goes at 16 concurrent (cProfile self time, %):", ""]
    lines += [f"- {k}: {v}" for k, v in profile.items()]
    (OUT / "cloud_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
