"""`relayinfer bench split` (loaded by `sdk.cli.bench_module`): split vs device-only vs cloud-only (and split+refine) on real prompts.

Set-up (one process): the cloud is `CloudService` + `TorchEngine` (CPU, 1 thread) in a
`ServiceThread`; the device is the real `OnnxEngine` (1 thread) behind `Client`, paced by a device
profile (`PacedEngine`). Prompts are real chitchat-dataset conversations, chat-templated, spread
over target lengths 64..2048 tokens. Every mode runs every prompt, greedy, `max_new_tokens` tokens.

Per mode (all times ms, as shown to the user by the speed controller):
* TTFT p50/p99 over requests; TPOT p50/p99/max over all inter-token gaps of all requests pooled;
  stalls (gaps > 2x the pace in use, summed); cloud tokens per request (`cloud_streamed`: tokens the
  cloud sent, dropped ones included); cloud busy ms per request (wall time the cloud held the
  request: `Generate` received -> `Done` sent, KV cache held; measured in the service); device
  prefill ms and device prompt tokens (`GenerationResult`).
* split+refine fidelity against the full-prompt greedy answer (the cloud-only answer, token ids):
  first-32 agreement (fraction of the first 32 positions with the same token), ROUGE-L F1 (LCS on
  token ids; compact implementation, no extra dependency), and the log-likelihood ratio: mean
  per-token log-prob of the reference answer under the refined prompt minus under the full prompt
  (TorchEngine, all-position logits; 0 = refinement loses nothing, negative = worse).
* Cloud capacity: virtual devices (`device.virtual`) at increasing Poisson rates against the same
  cloud; the highest rate with TTFT p99 <= 1 s, cloud-only vs split.

Link profiles (`link=`): the device sessions reach the cloud through a `sdk.linkem.LinkProxy`
(in the hand-off bench: in a process of its own, `LinkProxyProcess`, on a third core or else the
cloud's, never the device's) emulating that link on loopback (delay, jitter, bandwidth cap, loss as retransmission stalls); the
summary then adds, per mode, TTFT ratios to device-only, result-mode and fault counts, fallbacks
(requests ended by a network fault) and the proxy's counters. `pin_cores` pins the cloud's model
thread and the device's model thread to two different cores (`os.sched_setaffinity`).

Acceptance (phone profile): split TTFT p50 <= 40% of device-only TTFT p50 on prompts of target
length >= 512, zero stalls, TPOT max <= 2x target.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from relayinfer.device.speed import release_ms

LENGTHS = (64, 128, 256, 512, 1024, 2048)
MODES = ("device-only", "cloud-only", "split", "split+refine")
LOAD_LENGTHS = (64,)  # virtual-device request mix: ~60-token chitchat prompts (SPLIT.md: on this loaded
                      # 2-core CPU a 128-token prefill alone takes ~0.8 s of the 1 s TTFT bound)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def _mean(xs):
    return float(np.mean(xs)) if len(xs) else None


def lcs_len(a, b) -> int:
    """Length of the longest common subsequence of two sequences (O(len(a)*len(b)))."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(cand, ref) -> float:
    """ROUGE-L F1 (beta = 1) of two token sequences."""
    if not cand or not ref:
        return 0.0
    lcs = lcs_len(cand, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(cand), lcs / len(ref)
    return 2 * p * r / (p + r)


def mean_logprob(engine, prompt, answer) -> float:
    """Mean per-token log-prob (nats) of `answer` after `prompt` under the torch engine."""
    import torch

    ids = list(prompt) + list(answer)
    kv = engine.new_cache(len(ids) + 8)
    logits = engine.forward(ids, kv, last_only=False)  # [S, V]
    lp = torch.log_softmax(logits[len(prompt) - 1:len(ids) - 1], dim=-1)
    return float(lp[torch.arange(len(answer)), torch.tensor(answer)].mean())


def _service_class():
    from relayinfer.cloud.serve.service import CloudService

    class TimedService(CloudService):
        """CloudService that records how long it held each request (ms, Generate -> Done sent)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.busy: dict[str, float] = {}

        async def _run(self, channel, req, session):  # every request, batched or per-request
            t = time.perf_counter()
            try:
                await super()._run(channel, req, session)
            finally:
                self.busy[req.msg.request_id] = (time.perf_counter() - t) * 1e3

    return TimedService


def _prompts(tokenizer, n: int, seed: int, lengths=LENGTHS) -> list[tuple[int, list[int]]]:
    """n (target length, ids) pairs, round-robin over `lengths`."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    per = max(1, math.ceil(n / len(lengths)))
    ids = chitchat_prompts_by_length(tokenizer, list(lengths), per, seed)
    by = [(lengths[i // per], ids[i]) for i in range(len(ids))]
    order = [by[j * per + k] for k in range(per) for j in range(len(lengths))]
    return sorted(order[:n], key=lambda x: (x[0], len(x[1])))


def _run_one(client, svc, ids, mode, max_new, refine):
    """One generation; with `svc` None (a cloud in another process) no cloud busy/prefill times."""
    if svc is None:
        stream = client.generate(ids, max_new_tokens=max_new, mode="split" if mode.startswith("split") else mode)
        events = list(stream)
        return stream.result, events, None, None
    before, before_c = len(svc.busy), len(svc.completed)
    kw = {"mode": "split" if mode.startswith("split") else mode}
    if refine:
        kw["refine"] = refine
    stream = client.generate(ids, max_new_tokens=max_new, **kw)
    events = list(stream)
    r = stream.result
    time.sleep(0.2)  # let the cloud record the request (Done crosses the client's close)
    busy = sum(list(svc.busy.values())[before:]) if len(svc.busy) > before else 0.0
    done = list(svc.completed)[before_c:]  # a bounded deque in the service
    return r, events, busy, (done[0].prefill_ms if done else None)


def _mode_summary(rows: list[dict], target: float) -> dict:
    gaps = np.concatenate([np.diff(r["shown_ms"]) for r in rows if len(r["shown_ms"]) > 1] or [np.zeros(0)])
    long = [r for r in rows if r["target_len"] >= 512]
    return {
        "requests": len(rows), "ttft_ms_p50": _pct([r["ttft_ms"] for r in rows], 50),
        "ttft_ms_p99": _pct([r["ttft_ms"] for r in rows], 99),
        "ttft_ms_p50_ge512": _pct([r["ttft_ms"] for r in long], 50),
        "tpot_ms_p50": _pct(gaps, 50), "tpot_ms_p99": _pct(gaps, 99),
        "tpot_ms_max": float(gaps.max()) if gaps.size else None, "tpot_max_over_target": (float(gaps.max()) / target) if gaps.size else None,
        "stalls": int(sum(r["stalls"] for r in rows)),
        "kv_handoffs": sum(1 for r in rows if r.get("kv_imported_tokens")),
        "cloud_tokens_per_request": float(np.mean([r["cloud_streamed"] for r in rows])),
        "cloud_tokens_shown_per_request": float(np.mean([r["cloud_tokens"] for r in rows])),
        "cloud_busy_ms_per_request": float(np.mean([r["cloud_busy_ms"] for r in rows])),
        "device_prefill_ms_mean": float(np.mean([r["device_prefill_ms"] for r in rows])),
        "device_prompt_tokens_mean": float(np.mean([r["device_prompt_tokens"] for r in rows])),
        "ttft_minus_cloud_prefill_ms_mean": _mean([r["ttft_ms"] - r["cloud_prefill_ms"] for r in rows
                                                   if r["cloud_prefill_ms"] is not None and r["cloud_tokens"]]),
        "result_modes": {m: sum(1 for r in rows if r["mode"] == m) for m in {r["mode"] for r in rows}},
        "faults": {f: sum(1 for r in rows if r["fault"] == f) for f in {r["fault"] for r in rows if r["fault"]}},
        # ended by a network/cloud/device fault; a planned cloud-to-the-end answer is not one (its fault is
        # None, or 'device-too-slow' in results made before GenerationResult.plan existed)
        "fallbacks": sum(1 for r in rows if r["fault"] not in (None, "device-too-slow")),
    }


def _refine_saving(rows: list[dict]) -> dict | None:
    """Device prefill saved by refinement, on the prompts where both split and split+refine handed
    off (device_prefill_ms is 0 when the cloud finished first): 1 - sum(refine) / sum(split), for
    the wall ms (prompt + catch-up) and for the prompt tokens prefilled."""
    sp = {r["prompt_idx"]: r for r in rows if r["bench_mode"] == "split" and r["device_prefill_ms"] > 0}
    rf = {r["prompt_idx"]: r for r in rows if r["bench_mode"] == "split+refine" and r["device_prefill_ms"] > 0}
    both = sorted(set(sp) & set(rf))
    if not both:
        return None
    tot = lambda d, k: sum(d[i][k] for i in both)  # noqa: E731
    return {"prompts": len(both), "prompt_tokens": [sp[i]["prompt_tokens"] for i in both],
            "device_prefill_ms_split": tot(sp, "device_prefill_ms"), "device_prefill_ms_refine": tot(rf, "device_prefill_ms"),
            "prefill_ms_saving": 1 - tot(rf, "device_prefill_ms") / tot(sp, "device_prefill_ms"),
            "prompt_token_saving": 1 - tot(rf, "device_prompt_tokens") / tot(sp, "device_prompt_tokens")}


def _plots(res: dict, out: Path, timeline: dict | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = out.with_suffix("")
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODES:
        rows = [r for r in res["requests"] if r["bench_mode"] == mode]
        if rows:
            ax.plot([r["prompt_tokens"] for r in rows], [r["ttft_ms"] / 1e3 for r in rows], "o-", label=mode)
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)",
           title=f"TTFT by prompt length, profile {res['profile']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    files.append(f"{stem}-ttft.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    if timeline:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for src, col in (("cloud", "tab:cyan"), ("device", "tab:green")):
            pts = [(e["index"], e["shown_at_ms"]) for e in timeline["events"] if e["source"] == src]
            if pts:
                ax.scatter([p[1] / 1e3 for p in pts], [p[0] for p in pts], s=10, c=col, label=f"{src} ({len(pts)})")
        ax.set(xlabel="shown at (s since request)", ylabel="answer token index",
               title=f"split, {timeline['prompt_tokens']}-token prompt: token timeline")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        files.append(f"{stem}-timeline.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def run_capacity(url: str, fingerprint: str, tokenizer, profile: str, max_new_tokens: int = 64,
                 target_tpot_ms: float = 50.0, seed: int = 0, quick: bool = False) -> dict:
    """Cloud capacity (rps at TTFT p99 <= 1 s) for cloud-only and split virtual devices
    (`device.virtual.capacity_sweep`; 8 prompts of ~64 tokens, 16 s windows of <= 12 requests)."""
    from relayinfer.device.virtual import capacity_sweep


    load = [ids for _, ids in _prompts(tokenizer, 2 if quick else 8, seed + 1, LOAD_LENGTHS)]
    kw = dict(rates=(0.25,) if quick else (0.25, 0.5, 1, 2, 4), duration_s=6 if quick else 16,
              max_requests=2 if quick else 12, profile=profile, max_new_tokens=max_new_tokens,
              target_tpot_ms=target_tpot_ms, timeout_s=30.0)
    cap = {}
    for mode in ("cloud-only", "split"):
        cap[mode] = asyncio.run(capacity_sweep(url, fingerprint, load, mode, **kw))
        print(f"[bench split] capacity {mode}: {cap[mode]['capacity_rps']} rps", flush=True)
    cap["load_prompt_tokens"] = [len(p) for p in load]
    c, s = cap["cloud-only"]["capacity_rps"], cap["split"]["capacity_rps"]
    cap["ratio_split_over_cloud_only"] = (s / c) if c else (None if not s else float("inf"))
    return cap


def _pin(executor, core: int) -> None:
    """Pin the (single) thread of `executor` to `core` (Linux: affinity of the calling thread)."""
    executor.submit(os.sched_setaffinity, 0, {core}).result(30)


def _link_summary(modes: dict) -> dict:
    """Per mode: TTFT p50/p99 and their ratio to device-only, stalls, TPOT p50/max, result modes,
    faults and fallbacks (see `_mode_summary`)."""
    do = modes["device-only"]
    ratio = lambda a, b: (a / b) if a is not None and b else None  # noqa: E731
    return {m: {"ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"],
                "ttft_p50_over_device_only": ratio(s["ttft_ms_p50"], do["ttft_ms_p50"]),
                "ttft_p99_over_device_only": ratio(s["ttft_ms_p99"], do["ttft_ms_p99"]),
                "stalls": s["stalls"], "tpot_ms_p50": s["tpot_ms_p50"], "tpot_ms_max": s["tpot_ms_max"],
                "result_modes": s["result_modes"], "faults": s["faults"], "fallbacks": s["fallbacks"]}
            for m, s in modes.items()}


def run_split_bench(profile: str, prompts: int, out: str, quick: bool = False, seed: int = 0,
                    target_tpot_ms: float = 50.0, max_new_tokens: int = 64, refine: float = 0.5,
                    capacity: bool = True, link: str | None = None, pin_cores: bool = False,
                    command: str | None = None, model: str | None = None, quantize: str | None = None) -> dict:
    """Run the benchmark (see the module docstring), write `out` (JSON) and the PNGs beside it,
    and return the result dict ('summary', 'modes', 'requests', 'fidelity', 'capacity', ...).

    quick: smoke run (2 prompts of 64 and 512 tokens, 16 new tokens, a one-rate capacity check).
    link: a `sdk.linkem.PROFILES` name: device sessions go through an emulated link of that kind
    (the capacity sweep, if any, stays on the direct loopback; no refinement fidelity). pin_cores: cloud model thread on
    the first core this process may use, device model thread on the second (needs >= 2).
    command: the command line recorded in the JSON.

    Raises:
        ValueError: unknown link profile."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.serve.service import ServiceThread
    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.cloud.refine import WINDOW, refine_indices
    from relayinfer.sdk import Client
    from relayinfer.sdk.engines import load_engine

    from relayinfer.sdk.linkem import LinkProxyThread, get_profile

    link_profile = get_profile(link) if link else None
    t_start = time.perf_counter()
    if quick:
        prompts, max_new_tokens = min(prompts, 2), 16
    mp = resolve_model_path(model)
    cloud_engine = TorchEngine(mp, device="cpu", threads=1)
    device_engine = load_engine("onnx", mp, quantize, threads=1)
    device_engine.warmup()
    tok = device_engine.tokenizer()
    plist = _prompts(tok, prompts, seed, (64, 512) if quick else LENGTHS)
    svc = _service_class()(cloud_engine, cloud_engine.fingerprint)
    rows, timeline, link_counters, pinned = [], None, None, None
    with contextlib.ExitStack() as stack:
        running = stack.enter_context(ServiceThread(svc, http_port=None))
        proxy = stack.enter_context(LinkProxyThread(running.url, link_profile, seed=seed)) if link_profile else None
        client = Client(cloud_url=proxy.url if proxy else running.url, engine=device_engine, profile=profile,
                        target_tpot_ms=target_tpot_ms)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if pin_cores and len(cores) >= 2:
            _pin(svc.worker, cores[0])
            _pin(client._executor, cores[1])
            pinned = {"cloud_model_thread": cores[0], "device_model_thread": cores[1]}
        client.complete(plist[0][1], max_new_tokens=8)  # warm-up: calibration + first cloud estimates
        for mode in MODES:
            for pi, (target, ids) in enumerate(plist):
                r, events, busy, cpre = _run_one(client, svc, ids, mode, max_new_tokens,
                                           refine if mode == "split+refine" else None)
                row = {"bench_mode": mode, "prompt_idx": pi, "target_len": target, "prompt_tokens": len(ids), "cloud_busy_ms": busy,
                       "cloud_prefill_ms": cpre,
                       "shown_ms": [e.shown_at_ms for e in events], "sources": "".join(e.source[0] for e in events),
                       **{k: v for k, v in r.to_dict().items() if k not in ("prompt_ids", "text")}}
                rows.append(row)
                if mode == "split" and r.mode == "split" and (timeline is None or target >= 512 > timeline["target"]):
                    timeline = {"prompt_tokens": len(ids), "target": target, "events": [e.__dict__ for e in events]}
                print(f"[bench split] {mode:12s} {len(ids):5d} tok: ttft {r.ttft_ms:8.0f} ms  mode {r.mode:11s} "
                      f"cloud {r.cloud_streamed:3d}  stalls {r.stalls}  tpot max {r.tpot_ms_max:5.0f}", flush=True)
        cap = run_capacity(running.url, cloud_engine.fingerprint, tok, profile, max_new_tokens, target_tpot_ms,
                           seed, quick) if capacity else {}
        link_counters = proxy.counters() if proxy else None
    # fidelity of split+refine against the full-prompt greedy answer (the cloud-only answer)
    fid = []
    ref_by = {r["prompt_idx"]: r["token_ids"] for r in rows if r["bench_mode"] == "cloud-only"}
    # (not on link runs: fidelity does not depend on the link, and it costs minutes on long prompts)
    for r in (x for x in rows if x["bench_mode"] == "split+refine" and not link):
        ids, ref = plist[r["prompt_idx"]][1], ref_by[r["prompt_idx"]]
        _, _, scores = cloud_engine.prefill_scored(ids, WINDOW)
        kept = [ids[i] for i in refine_indices(scores, ids, refine, svc.markers)]
        n32 = min(32, len(ref))
        fid.append({"prompt_tokens": len(ids), "kept_tokens": len(kept),
                    "first32_agreement": sum(a == b for a, b in zip(r["token_ids"][:n32], ref[:n32])) / n32,
                    "rouge_l_f1": rouge_l(r["token_ids"], ref),
                    "loglik_ratio": mean_logprob(cloud_engine, kept, ref) - mean_logprob(cloud_engine, ids, ref),
                    "handoff_index": r["handoff_index"], "result_mode": r["mode"]})
    modes = {m: _mode_summary([r for r in rows if r["bench_mode"] == m], target_tpot_ms) for m in MODES}
    sp, do = modes["split"], modes["device-only"]
    ratio = sp["ttft_ms_p50_ge512"] / do["ttft_ms_p50_ge512"] if do["ttft_ms_p50_ge512"] else None
    summary = {
        "profile": profile, "prompts": len(plist), "max_new_tokens": max_new_tokens, "target_tpot_ms": target_tpot_ms,
        **{f"{m}": {k: modes[m][k] for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_max", "stalls",
                                              "cloud_tokens_per_request", "cloud_busy_ms_per_request")} for m in MODES},
        "split_ttft_p50_over_device_only_ge512": ratio,
        "acceptance": {"ttft_ratio_le_0.4": ratio is not None and ratio <= 0.4, "zero_stalls": sp["stalls"] == 0,
                       "tpot_max_le_2x_target": sp["tpot_ms_max"] is not None and sp["tpot_ms_max"] <= 2 * target_tpot_ms},
        "refine_device_prefill_saving": _refine_saving(rows),
        "fidelity_mean": {k: float(np.mean([f[k] for f in fid])) for k in ("first32_agreement", "rouge_l_f1", "loglik_ratio")} if fid else None,
        "capacity_rps": {m: cap[m]["capacity_rps"] for m in ("cloud-only", "split")} if cap else None,
        "capacity_ratio_split_over_cloud_only": cap.get("ratio_split_over_cloud_only") if cap else None,
    }
    if link_profile:
        summary["link"] = {"profile": link, "emulated": "LinkProxy on loopback (sdk.linkem), not a real network",
                           "per_mode": _link_summary(modes)}
    res = {"profile": profile, "command": command, "summary": summary, "modes": modes, "fidelity": fid, "capacity": cap,
           "link": {"profile": link_profile.to_dict(), "counters": link_counters} if link_profile else None,
           "prompt_lengths": [len(ids) for _, ids in plist], "requests": rows,
           "setup": {"cloud": "CloudService+TorchEngine cpu 1 thread, in-process ServiceThread",
                     "device": f"OnnxEngine ({quantize or 'gguf'}) 1 thread via Client, PacedEngine profile {profile!r}",
                     "link": f"LinkProxy {link!r} on loopback (emulated)" if link else "direct loopback",
                     "pinned_cores": pinned,
                     "device_timing": list(client.device_timing()), "cores": os.cpu_count(),
                     "load_avg_1m": os.getloadavg()[0], "wall_s": time.perf_counter() - t_start}}
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    res["plots"] = _plots(res, outp, timeline)
    outp.write_text(json.dumps(res, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))
    return res


# -- the hand-off benchmark: batched cloud, real answer lengths, buckets, profiles --

BUCKETS = (("<256", 0, 256), ("256-511", 256, 512), (">=512", 512, None), (">=1024", 1024, None))
BUCKET_TARGETS = (160, 384, 720, 1150)  # prompt lengths drawn per bucket (<256, 256-511, 512-1023, >=1024)
CAPACITY_RATES = tuple(round(0.25 * 2 ** (k / 2), 3) for k in range(14))  # x1.41 steps, 0.25 .. 22.6 rps


def _in_bucket(n: int, lo: int, hi: int | None) -> bool:
    return n >= lo and (hi is None or n < hi)


class _GCPauses:
    """This process's garbage-collection pauses of at least `min_ms` (ms), recorded from `gc.callbacks`
    while installed (a context manager): `within(t0, t1)` gives those that overlap [t0, t1]
    (`time.perf_counter` s) as [start ms since t0, duration ms, generation]. The hand-off bench
    puts them in each row, to tell a display held by a collection from one held by something else."""

    def __init__(self, min_ms: float = 2.0):
        self.min_ms, self.pauses, self._t = min_ms, [], 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif (d := (time.perf_counter() - self._t) * 1e3) >= self.min_ms:
            self.pauses.append((self._t, d, info["generation"]))

    def __enter__(self) -> "_GCPauses":
        import gc

        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._cb)

    def within(self, t0: float, t1: float) -> list[list]:
        return [[round((t - t0) * 1e3, 1), round(d, 1), g] for t, d, g in self.pauses if t <= t1 and t + d / 1e3 >= t0]


LATE_TOL_MS = 20.0  # a cloud token shown this much later than the speed controller would have shown it: the device's loop held it


def slow_gaps(row: dict, over_ms: float, tol_ms: float = LATE_TOL_MS) -> dict:
    """Where the shown gaps over `over_ms` (ms) of one split row came from. For a cloud token (before
    the hand-off) the speed controller's release time is recomputed from the row's own arrival times
    and the previous token's real shown time (`speed.release_ms`, its interval, following the
    source): a gap the controller asks for too is 'upstream' (the cloud or the link delivered late,
    or the floor followed their pace); one whose token was shown more than `tol_ms` after that time is
    'device_loop' (the device's event loop or core held a token that was there). A row with `late_ms`
    (the device's own record: how long after the release its speed controller had set, with the pace
    in force then, each token was shown) is classified by that instead of the recomputation (which
    knows only the row's last interval, not a display the plan slowed for a while). Gaps ending at or
    after the hand-off are 'device_decode' (the device's own tokens).

    A row with `cloud_sent_ms` (the cloud's send stamp per cloud token) splits each upstream gap
    further: its arrival gap is the cloud's own gap between the two sends plus the rest, the link's
    share (the link, and the device's loop before it read the frame; the two clocks' offset cancels
    in the difference). The gap is 'upstream_cloud' when the cloud's share is the larger, else
    'upstream_link'; upstream_link_ms_max is the largest link share of a slow gap (ms). The cloud
    stamps a token when it hands it to its websocket, after the previous token's send returned: a
    send held by the link's back-pressure (a full socket buffer) therefore counts as the cloud's.
    An upstream gap without both tokens' stamps (no `cloud_sent_ms`, or one shorter than the cloud
    tokens) is 'upstream_unsplit': upstream = upstream_cloud + upstream_link + upstream_unsplit.

    Returns the counts and device_late_ms_max, the largest lateness of a device_loop or upstream
    gap's token (ms)."""
    shown, late_ms = row["shown_ms"], row.get("late_ms") or None
    h = row["handoff_index"] if row["handoff_index"] is not None else len(shown)
    ready = list(row["ready_ms"][:h])  # the cloud tokens' arrivals
    sent = row.get("cloud_sent_ms") or None
    out = {"upstream": 0, "upstream_cloud": 0, "upstream_link": 0, "upstream_unsplit": 0, "device_loop": 0,
           "device_decode": 0, "device_late_ms_max": 0.0, "upstream_link_ms_max": 0.0}
    for k in range(1, len(shown)):
        if shown[k] - shown[k - 1] <= over_ms:
            continue
        if k >= h:
            out["device_decode"] += 1
            continue
        late = late_ms[k] if late_ms else shown[k] - release_ms(k, ready, shown[k - 1], row["interval_ms"], True)
        out["device_late_ms_max"] = max(out["device_late_ms_max"], late)
        if late > tol_ms:
            out["device_loop"] += 1
            continue
        out["upstream"] += 1
        if sent and k < len(sent):
            cloud = sent[k] - sent[k - 1]
            link = ready[k] - ready[k - 1] - cloud
            out["upstream_cloud" if cloud >= link else "upstream_link"] += 1
            out["upstream_link_ms_max"] = max(out["upstream_link_ms_max"], link)
        else:
            out["upstream_unsplit"] += 1
    return out


def _gaps_cell(g: dict | None) -> str:
    """A `slow_gaps` total as a table cell."""
    if not g:
        return "-"
    unsplit = f" / {g['upstream_unsplit']} unstamped" if g.get("upstream_unsplit") else ""
    split = f" ({g.get('upstream_cloud', 0)} / {g.get('upstream_link', 0)}{unsplit})" if g["upstream"] else ""
    return f"{g['upstream']}{split} / {g['device_loop']} ({g['device_late_ms_max']:.0f} ms) / {g['device_decode']}"


def bucket_summary(rows: list[dict], target_tpot_ms: float) -> dict:
    """Per link (rows' "link", None: the direct loopback; keyed "<link> <profile> <bucket>", else
    "<profile> <bucket>"), prompt-length bucket (`BUCKETS`; >=512 includes >=1024) and profile: for the split rows,
    the fraction handed off (result mode 'split'), cloud tokens streamed per request, TTFT p50/p99,
    TPOT p50/max over all shown gaps, stalls, the result-mode mix and fallbacks (requests ended by
    a fault, counted apart, never as a split); TTFT p50/p99 of the device-only and cloud-only
    reference runs of the same prompts, and split/device-only, split/cloud-only p50 ratios;
    ended_early: split answers that ended (EOS) before the hand-off the plan had set (no hand-off
    was possible in them: counted in, not out, of handed_off_fraction)."""
    out: dict = {}
    for link, prof in sorted({(r.get("link"), r["profile"]) for r in rows}, key=lambda x: (str(x[0]), x[1])):
        for name, lo, hi in BUCKETS:
            sel = [r for r in rows if r["profile"] == prof and r.get("link") == link
                   and _in_bucket(r["prompt_tokens"], lo, hi)]
            sp = [r for r in sel if r["bench_mode"] == "split"]
            if not sp:
                continue
            ref = {m: [r["ttft_ms"] for r in sel if r["bench_mode"] == m] for m in ("device-only", "cloud-only")}
            gaps = np.concatenate([np.diff(r["shown_ms"]) for r in sp if len(r["shown_ms"]) > 1] or [np.zeros(0)])
            ttft = [r["ttft_ms"] for r in sp]
            p50 = _pct(ttft, 50)
            gs = [slow_gaps(r, 2 * target_tpot_ms) for r in sp]  # the TPOT max goal's gaps, by where they came from
            out[f"{prof} {name}" if link is None else f"{link} {prof} {name}"] = {
                "link": link, "profile": prof, "bucket": name, "requests": len(sp),
                "prompt_tokens": [r["prompt_tokens"] for r in sp],
                "answer_tokens": [len(r["token_ids"]) for r in sp],
                "handed_off": sum(1 for r in sp if r["mode"] == "split"),
                "handed_off_fraction": sum(1 for r in sp if r["mode"] == "split") / len(sp),
                "ended_early": sum(1 for r in sp if r["mode"] == "cloud-only" and r.get("finish_reason", "length") != "length"
                                   and r["plan"] == "split" and len(r["token_ids"]) <= (r.get("cloud_budget") or 0)),
                "cloud_tokens_per_request": float(np.mean([r["cloud_streamed"] for r in sp])),
                "cloud_tokens_shown_per_request": float(np.mean([r["cloud_tokens"] for r in sp])),
                "handoff_index": [r["handoff_index"] for r in sp],
                "ttft_ms_p50": p50, "ttft_ms_p99": _pct(ttft, 99),
                "device_only_ttft_ms_p50": _pct(ref["device-only"], 50), "device_only_ttft_ms_p99": _pct(ref["device-only"], 99),
                "cloud_only_ttft_ms_p50": _pct(ref["cloud-only"], 50), "cloud_only_ttft_ms_p99": _pct(ref["cloud-only"], 99),
                "ttft_p50_over_device_only": p50 / _pct(ref["device-only"], 50) if ref["device-only"] else None,
                "ttft_p50_over_cloud_only": p50 / _pct(ref["cloud-only"], 50) if ref["cloud-only"] else None,
                "tpot_ms_p50": _pct(gaps, 50), "tpot_ms_max": float(gaps.max()) if gaps.size else None,
                "tpot_max_over_target": float(gaps.max()) / target_tpot_ms if gaps.size else None,
                "interval_ms": [r["interval_ms"] for r in sp],
                "stalls": int(sum(r["stalls"] for r in sp)),
                "slow_gaps": {k: (max if k.endswith("_max") else sum)(g[k] for g in gs) for k in gs[0]},
                "result_modes": {m: sum(1 for r in sp if r["mode"] == m) for m in sorted({r["mode"] for r in sp})},
                "plans": {m: sum(1 for r in sp if r["plan"] == m) for m in sorted({r["plan"] for r in sp})},
                "replanned": sum(1 for r in sp if "re-planned" in (r.get("plan_reason") or "")),
                "fallbacks": sum(1 for r in sp if r["fault"] is not None),
                "faults": {f: sum(1 for r in sp if r["fault"] == f) for f in sorted({r["fault"] for r in sp if r["fault"]})},
            }
    return out


def _goals(buckets: dict, capacity: dict | None, target_tpot_ms: float, links=(None,)) -> dict:
    """The goals on the phone's >=512 bucket (per link: keys prefixed "<link> ") and the capacity
    ratio, with the numbers."""
    g: dict = {}
    for link in links:
        b, pre = buckets.get("phone >=512" if link is None else f"{link} phone >=512"), "" if link is None else f"{link} "
        if not b:
            continue
        g[pre + "handoff_fraction_ge512"] = {"value": b["handed_off_fraction"], "goal": ">= 0.8",
                                             "met": b["handed_off_fraction"] >= 0.8}
        r = b["ttft_p50_over_device_only"]
        g[pre + "ttft_p50_over_device_only_ge512"] = {"value": r, "goal": "<= 0.2", "met": r is not None and r <= 0.2}
        g[pre + "stalls_ge512"] = {"value": b["stalls"], "goal": "0", "met": b["stalls"] == 0}
        g[pre + "tpot_max_ge512_ms"] = {"value": b["tpot_ms_max"], "goal": f"<= {2 * target_tpot_ms:.0f}",
                                        "met": b["tpot_ms_max"] is not None and b["tpot_ms_max"] <= 2 * target_tpot_ms}
    if capacity:
        r = capacity.get("ratio_split_over_cloud_only")
        g["capacity_ratio"] = {"value": r, "goal": ">= 15 (aim 20)", "met": r is not None and r >= 15}
        if capacity.get("long_answers"):
            r = capacity["long_answers"].get("ratio_split_over_cloud_only")
            g["capacity_ratio_long_answers"] = {"value": r, "goal": ">= 15 (aim 20)", "met": r is not None and r >= 15}
    return g


def run_handoff_bench(profiles: list[str], per_bucket: int, out: str, seed: int = 0, target_tpot_ms: float = 50.0,
                      max_new_tokens: int = 256, ref_new_tokens: int = 2, capacity: bool = True,
                      capacity_rates=CAPACITY_RATES, capacity_window_s: float = 12.0, capacity_max_requests: int = 16,
                      kv_cache_mb: int = 256, time_limit_s: float = 1500.0, long_answers: bool = True,
                      command: str | None = None, links: list[str] | None = None,
                      bucket_targets=BUCKET_TARGETS, model: str | None = None, quantize: str | None = None) -> dict:
    """The hand-off split benchmark (see bench/SPLIT.md): one batched cloud
    (`CloudService(llm=AsyncLLMEngine(LLMEngine(TorchEngine)))`, as `relayinfer cloud serve`, one
    thread, in its own forked process pinned to the first core this process may use, `_CloudProcess`)
    and, per device profile,
    the real `OnnxEngine` behind `Client(profile=...)` (one thread, pinned to the second core).
    `per_bucket` chitchat prompts per target length of `bucket_targets` (default `BUCKET_TARGETS`,
    one per bucket; a subset, e.g. (720, 1150), measures the long buckets only); each prompt runs split with
    `max_new_tokens` (greedy, ends at EOS), then device-only and cloud-only with `ref_new_tokens`
    (their TTFT is the reference; their later tokens do not matter to it). Then the capacity sweep:
    virtual devices (`device.virtual.capacity_sweep`, phone profile, ~64-token prompts,
    `max_new_tokens`) at the `capacity_rates` (x1.41 steps) against the same cloud, cloud-only and
    split, each rate a window of `capacity_window_s` s and at most `capacity_max_requests` requests;
    with `long_answers`, again with every answer `max_new_tokens` long (`Generate.min_tokens`: the
    decode-heavy regime, labelled as such). `links`: `sdk.linkem.PROFILES` names; the device
    sessions then reach the cloud through a `LinkProxy` per link, all in one `LinkProxyProcess`
    pinned to the third core this process may use, or to the cloud's where there are two; a link
    that shapes nothing (`loopback`, the control) connects directly (one `Client` per link and
    profile, each prompt on every link in turn; device-only runs once per prompt and profile, it
    needs no link, and its row stands for every link; the capacity sweep stays on the loopback).
    Bounded: prompts are skipped (and counted) once `time_limit_s` has passed. Writes `out` (JSON):
    one row per request under "requests" (the `GenerationResult` fields, the shown times, and
    `gc_pauses`: this process's collections of >= 2 ms during the request, `_GCPauses`).

    Raises:
        ValueError: fewer than 2 cores to pin to, an unknown profile or link."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from relayinfer.sdk.linkem import LinkProxyProcess, get_profile

    link_names = list(links) if links else [None]
    link_profiles = {name: get_profile(name) for name in link_names if name is not None}  # unknown -> ValueError
    from relayinfer.device.calibrate import calibrated
    from relayinfer.device.profiles import load_profile
    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.sdk import Client, freeze_heap
    from relayinfer.sdk.engines import load_engine

    for p in profiles:
        load_profile(p)  # unknown -> ValueError before anything loads
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"the benchmark pins cloud and device to two cores; this process may use {cores}")
    t_start, load_start = time.perf_counter(), list(os.getloadavg())
    mp = resolve_model_path(model)
    cloud = _CloudProcess(mp, cores[0], kv_cache_mb, life_s=time_limit_s + 1800.0)
    rows, skipped, cap, link_counters = [], 0, {}, {}
    with cloud as (url, http_url, fingerprint), contextlib.ExitStack() as stack, _GCPauses() as gc_pauses:
        # the link emulator in a process of its own (forked before this one loads a model or starts a
        # thread), on a third core where there is one, else on the cloud's: its per-segment work then
        # shows up as upstream delay (cloud or link), never in the device's interpreter or on its core;
        # the device-model HTTP side goes through the same link profile (its own proxy: one more radio
        # bucket), so that each client measures its link as a real one does (`Client.measure_link`) and
        # can choose the KV hand-off where the transfer beats its own prefill. A profile that shapes
        # nothing (`loopback`, the control) connects directly: through a proxy on a shared core its
        # only effect would be the proxy's own copying of the float16 KV at loopback speed
        link_core = cores[2] if len(cores) > 2 else cores[0]
        shaped = {n: lp for n, lp in link_profiles.items() if lp.shapes}
        links_proc = LinkProxyProcess({**{("ws", n): (url, lp) for n, lp in shaped.items()},
                                       **{("http", n): (http_url, lp) for n, lp in shaped.items()}},
                                      link_core, seed=seed, life_s=time_limit_s + 1800.0)
        link_urls = {(side, n): u.replace("ws://", "http://") if side == "http" else u
                     for (side, n), u in (stack.enter_context(links_proc) if shaped else {}).items()}
        for n in link_profiles.keys() - shaped.keys():
            link_urls["ws", n], link_urls["http", n] = url, http_url
        os.sched_setaffinity(0, {cores[1]})  # this thread (clients, virtual devices) and the device's on core 1
        device_engine = load_engine("onnx", mp, quantize, threads=1)
        device_engine.warmup()
        # this run's calibration, on the device's core under the run's load (a cached one may come from
        # another load: it sets the device fit of the settings and the display interval)
        local = calibrated(device_engine, refresh=True)
        print(f"[bench split] calibration: a {local.prefill_ms_base:.0f} ms, b {local.prefill_ms_per_token:.2f} ms/token, "
              f"d {local.decode_ms_per_token:.0f} ms", flush=True)
        tok = device_engine.tokenizer()
        plist = _prompts(tok, per_bucket * len(bucket_targets), seed, tuple(bucket_targets))
        print(f"[bench split] prompts: {[len(ids) for _, ids in plist]}", flush=True)
        # round robin over the buckets (one prompt of each, then the next), so a time cut keeps every bucket
        by: dict = {}
        for t, ids in plist:
            by.setdefault(t, []).append((t, ids))
        plist = [x for k in range(per_bucket) for t in bucket_targets for x in by.get(t, [])[k:k + 1]]
        clients, link_measured = {}, {}
        for name in link_names:
            for prof in profiles:
                clients[name, prof] = client = Client(
                    cloud_url=link_urls["ws", name] if name else url, engine=device_engine, profile=prof,
                    target_tpot_ms=target_tpot_ms,
                    cloud_http_url=link_urls["http", name] if name else http_url)
                _pin(client._executor, cores[1])
                link_measured[name, prof] = bw = client.measure_link()
                print(f"[bench split] link {name or 'direct'}: measured {bw / 1e6:.2f} MB/s (device-model file)",
                      flush=True)
                client.complete(plist[0][1], max_new_tokens=8)  # warm-up: first cloud estimates
                client.complete(plist[-1][1], max_new_tokens=8, mode="cloud-only")  # a second prompt length for the fit
        frozen = freeze_heap()  # the dataset, model and clients: no full collection walks them during a request
        for pi, (target, ids) in enumerate(plist):
            for (name, prof), client in clients.items():
                if time.perf_counter() - t_start > time_limit_s:
                    skipped += 1
                    continue
                for mode in ("split", "device-only", "cloud-only"):
                    if mode == "device-only" and name != link_names[0]:  # no link in it: the first link's row
                        rows += [{**r, "link": name} for r in rows if r["bench_mode"] == mode and r["prompt_idx"] == pi
                                 and r["profile"] == prof and r["link"] == link_names[0]]
                        continue
                    t_call = time.perf_counter()
                    r, events, busy, cpre = _run_one(client, None, ids, mode,
                                                      max_new_tokens if mode == "split" else ref_new_tokens, None)
                    rows.append({"link": name, "profile": prof, "bench_mode": mode, "prompt_idx": pi, "target_len": target,
                                 "prompt_tokens": len(ids), "cloud_busy_ms": busy, "cloud_prefill_ms": cpre,
                                 "gc_pauses": gc_pauses.within(t_call, time.perf_counter()),
                                 "shown_ms": [e.shown_at_ms for e in events], "sources": "".join(e.source[0] for e in events),
                                 "device_timing": list(client.device_timing()),
                                 **{k: v for k, v in r.to_dict().items() if k not in ("prompt_ids", "text")}})
                    print(f"[bench split] {name or '':8s} {prof:6s} {mode:11s} {len(ids):5d} tok: ttft {r.ttft_ms:7.0f} ms  {r.mode:11s} "
                          f"plan {r.plan:16s} answer {len(r.token_ids):3d} cloud {r.cloud_streamed:3d} handoff "
                          f"{r.handoff_index} stalls {r.stalls} tpot max {r.tpot_ms_max:4.0f} I {r.interval_ms:3.0f} "
                          f"kv {r.kv_imported_tokens}" + (f" {r.kv_wire}" if r.kv_imported_tokens else ""), flush=True)
        if capacity:
            from relayinfer.device.virtual import capacity_sweep

            load = [ids for _, ids in _prompts(tok, 8, seed + 1, LOAD_LENGTHS)]
            kw = dict(rates=capacity_rates, duration_s=capacity_window_s, max_requests=capacity_max_requests,
                      profile="phone", max_new_tokens=max_new_tokens, target_tpot_ms=target_tpot_ms, timeout_s=40.0)
            for mode in ("cloud-only", "split"):
                cap[mode] = asyncio.run(capacity_sweep(url, fingerprint, load, mode, **kw))
                print(f"[bench split] capacity {mode}: {cap[mode]['capacity_rps']} rps", flush=True)
            cap["load_prompt_tokens"] = [len(p) for p in load]
            c, s = cap["cloud-only"]["capacity_rps"], cap["split"]["capacity_rps"]
            cap["ratio_split_over_cloud_only"] = (s / c) if c else None
            cap["rate_grid"] = list(capacity_rates)
            if long_answers and time.perf_counter() - t_start < time_limit_s + 200:
                # the decode-heavy regime of P/D-Device: every answer max_new_tokens long (min_tokens, no early EOS)
                kw.update(min_tokens=max_new_tokens, timeout_s=120.0)
                long = cap["long_answers"] = {}
                for mode in ("cloud-only", "split"):
                    long[mode] = asyncio.run(capacity_sweep(url, fingerprint, load, mode, **kw))
                    print(f"[bench split] capacity, {max_new_tokens}-token answers, {mode}: "
                          f"{long[mode]['capacity_rps']} rps", flush=True)
                c, s = long["cloud-only"]["capacity_rps"], long["split"]["capacity_rps"]
                long["ratio_split_over_cloud_only"] = (s / c) if c else None
    link_counters = {n: c for (side, n), c in links_proc.counters.items() if side == "ws"}
    buckets = bucket_summary(rows, target_tpot_ms)
    res = {"command": command, "profiles": profiles, "per_bucket": per_bucket, "bucket_targets": list(bucket_targets),
           "max_new_tokens": max_new_tokens,
           "ref_new_tokens": ref_new_tokens, "target_tpot_ms": target_tpot_ms, "skipped_prompts": skipped,
           "buckets": buckets, "capacity": cap, "goals": _goals(buckets, cap, target_tpot_ms, link_names),
           "links": {name: {"profile": lp.to_dict(), "counters": link_counters.get(name),
                            "measured_bytes_per_s": {prof: link_measured.get((name, prof)) for prof in profiles}}
                     for name, lp in link_profiles.items()} or None,
           "prompt_lengths": [len(ids) for _, ids in plist], "requests": rows,
           "setup": {"cloud": f"CloudService(llm=AsyncLLMEngine(LLMEngine(TorchEngine cpu, 1 thread), {kv_cache_mb} MiB "
                              f"KV, no prefix cache)) in its own (forked) process pinned to core {cores[0]}",
                     "device": f"OnnxEngine ({quantize or 'gguf'}) 1 thread via Client + PacedEngine(profile), pinned to core {cores[1]}",
                     "gc_frozen_objects": frozen,
                     "link": (f"LinkProxy per shaped link ({', '.join(shaped) or 'none'}) on loopback (emulated, "
                              f"sdk.linkem), in its own process pinned to core {link_core}"
                              + (" (the cloud's: no third core)" if link_core == cores[0] else "")
                              + "; a link that shapes nothing connects directly"
                              if link_profiles else "direct loopback"),
                     "calibration": {"prefill_ms_base": local.prefill_ms_base,
                                     "prefill_ms_per_token": local.prefill_ms_per_token,
                                     "decode_ms_per_token": local.decode_ms_per_token},
                     "git_commit": _git_commit(), "cores": os.cpu_count(), "load_avg_start": load_start,
                     "load_avg_end": list(os.getloadavg()),
                     "wall_s": time.perf_counter() - t_start}}
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(json.dumps(res, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))
    load = f"load average (1, 5, 15 min) {res['setup']['load_avg_start']} at the start, {res['setup']['load_avg_end']} at the end"
    outp.with_suffix(".md").write_text(f"`{command}` (commit {res['setup']['git_commit']}; {load})\n\n" + handoff_markdown(res))
    return res


def handoff_markdown(res: dict) -> str:
    """The tables of a `run_handoff_bench` result (per bucket and profile; capacity per rate; goals)."""
    f = lambda x, p=0: "-" if x is None else f"{x:,.{p}f}"  # noqa: E731
    lines = ["| profile | bucket | n | prompt tokens | answer tokens | handed off | cloud tok/req | split TTFT p50 / p99 |"
             " device-only p50 / p99 | cloud-only p50 / p99 | split / device-only p50 | split / cloud-only p50 |"
             " TPOT p50 / max | gaps > 2x target: upstream (cloud / link) / device loop (late max) / device decode | interval | stalls |"
             " result modes | plans (re-planned) | fallbacks |",
             "|" + "---|" * 19]
    for b in res["buckets"].values():
        lines.append(
            f"| {b.get('link') + ' / ' if b.get('link') else ''}{b['profile']} | {b['bucket']} | {b['requests']} | {', '.join(map(str, b['prompt_tokens']))} | "
            f"{', '.join(map(str, b['answer_tokens']))} | {b['handed_off']}/{b['requests']}"
            f"{' (' + str(b['ended_early']) + ' ended first)' if b.get('ended_early') else ''} | "
            f"{f(b['cloud_tokens_per_request'], 1)} | {f(b['ttft_ms_p50'])} / {f(b['ttft_ms_p99'])} | "
            f"{f(b['device_only_ttft_ms_p50'])} / {f(b['device_only_ttft_ms_p99'])} | "
            f"{f(b['cloud_only_ttft_ms_p50'])} / {f(b['cloud_only_ttft_ms_p99'])} | {f(b['ttft_p50_over_device_only'], 2)} | "
            f"{f(b['ttft_p50_over_cloud_only'], 2)} | {f(b['tpot_ms_p50'])} / {f(b['tpot_ms_max'])} | "
            f"{_gaps_cell(b.get('slow_gaps'))} | {', '.join(f(x) for x in b['interval_ms'])} | {b['stalls']} | "
            f"{', '.join(f'{k} {v}' for k, v in b['result_modes'].items())} | "
            f"{', '.join(f'{k} {v}' for k, v in b['plans'].items())} ({b['replanned']}) | {b['fallbacks']} |")
    cap = res.get("capacity") or {}
    if cap:
        lines += ["", "| mode | rate (rps) | requests | ok | TTFT p50 | TTFT p99 | meets 1 s | cloud tok/req | cloud busy ms/req |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for mode in ("cloud-only", "split"):
            for r in cap[mode]["runs"]:
                lines.append(f"| {mode} | {r['offered_rps']} | {r['requests']} | {r['ok']} | {f(r['ttft_ms_p50'])} | "
                             f"{f(r['ttft_ms_p99'])} | {'yes' if r['meets_slo'] else 'no'} | {f(r['cloud_tokens_mean'], 1)} | "
                             f"{f(r['cloud_busy_ms_mean'])} |")
        long = cap.get("long_answers") or {}
        for mode in ("cloud-only", "split"):
            for r in long.get(mode, {}).get("runs", []):
                lines.append(f"| {mode}, {res['max_new_tokens']}-token answers | {r['offered_rps']} | {r['requests']} | "
                             f"{r['ok']} | {f(r['ttft_ms_p50'])} | {f(r['ttft_ms_p99'])} | {'yes' if r['meets_slo'] else 'no'} | "
                             f"{f(r['cloud_tokens_mean'], 1)} | {f(r['cloud_busy_ms_mean'])} |")
        lines.append(f"\nCapacity at TTFT p99 <= 1 s, answers to EOS: cloud-only {cap['cloud-only']['capacity_rps']} rps, "
                     f"split {cap['split']['capacity_rps']} rps, ratio {f(cap.get('ratio_split_over_cloud_only'), 1)}.")
        if long:
            lines.append(f"With {res['max_new_tokens']}-token answers: cloud-only {long['cloud-only']['capacity_rps']} rps, "
                         f"split {long['split']['capacity_rps']} rps, ratio {f(long.get('ratio_split_over_cloud_only'), 1)}.")
    lines += ["", "| goal | value | target | met |", "|---|---|---|---|"]
    for k, g in res["goals"].items():
        v = g["value"]
        lines.append(f"| {k} | {f(v, 2) if isinstance(v, float) else v} | {g['goal']} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


class _CloudProcess:
    """The bench cloud in a forked child process pinned to `core` (no GIL shared with the device;
    closer to a cloud on its own machine): `CloudService(llm=AsyncLLMEngine(LLMEngine(TorchEngine,
    1 thread, kv_cache_mb MiB, no prefix cache)))` on 127.0.0.1, its HTTP side serving the device-model
    files. A context manager yielding (ws URL, HTTP URL, fingerprint); it stops the child on exit,
    and the child stops by itself after `life_s` s. Fork it before this process loads a model or
    starts a thread.

    Raises:
        RuntimeError: the child did not report its URL within 600 s, or exited first."""

    def __init__(self, model_path, core: int, kv_cache_mb: int, life_s: float):
        from relayinfer.sdk.forked import ForkedChild

        self._child = ForkedChild(self._serve, (str(model_path), core, kv_cache_mb, life_s), name="bench-cloud",
                                  start_timeout_s=600.0)

    @staticmethod
    def _serve(conn, model_path: str, core: int, kv_cache_mb: int, life_s: float) -> None:
        os.sched_setaffinity(0, {core})
        from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
        from relayinfer.cloud.engine.torch_engine import TorchEngine
        from relayinfer.cloud.serve.service import CloudService, ServiceThread
        from relayinfer.protocol.model.device_model import device_model_dir

        engine = TorchEngine(model_path, device="cpu", threads=1)
        # no prefix cache: every request is a new conversation here (a mode run after another on the same
        # prompt would reuse its KV and show a TTFT without the prefill; multi-turn reuse is measured apart)
        llm = AsyncLLMEngine(LLMEngine(engine, kv_cache_bytes=kv_cache_mb << 20, enable_prefix_caching=False))
        # the device-model files on its HTTP side (what a device measures its link with)
        svc = CloudService(engine, engine.fingerprint, llm=llm, device_model_dir=device_model_dir(model_path))
        with ServiceThread(svc, http_port=0) as running:
            conn.send((running.url, running.http_url, engine.fingerprint))
            conn.poll(life_s)  # until the parent says stop (or goes away), at most life_s

    @property
    def pid(self) -> int | None:
        """The child's process id (None before it started)."""
        return self._child.pid

    def __enter__(self) -> tuple[str, str, str]:
        return self._child.start()

    def __exit__(self, *exc) -> None:
        self._child.stop()


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
