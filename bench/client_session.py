"""One session per client, measured: what keeping the websocket across `generate` calls saves,
and the KV hand-off on the batched cloud path against the per-request path.

Part 1 (handshake reuse): the same chitchat prompt N times in cloud-only mode (the cloud's first
token is the TTFT; no device work in the way) through (a) one `Client` for all N calls (its one
websocket, opened by call 1) and (b) a new `Client` per call (a websocket, upgrade and Hello/Welcome
each), on loopback and through the LTE link profile (`sdk.linkem`, RTT ~60-80 ms, 15/5 Mbit/s).
Reported: TTFT of calls 2..N (median, mean), the saving per call, and the websockets the cloud
handshook (`relayinfer_sessions_total`).

Part 2 (KV hand-off): chitchat prompts of ~256 and ~512 tokens with `kv_handoff=True` and
`cloud_budget=None` against a cloud with the batching engine (`AsyncLLMEngine`: the KV is copied
out of the paged cache, the request stays in the batch) and one without it (per-request path),
loopback: the device's prompt time (Generate to KV imported, `device_prompt_ms`), TTFT, the
greedy tokens of the two paths (equal), and the batching engine's export time per hand-off; then
four ~256-token hand-offs at once from one Client (the batch prefills them together; the
per-request path runs them step by step on its one worker thread).

Cloud (torch, 1 thread) and device (ONNX Runtime, 1 thread) share this machine; compare ratios
within one run.

    python bench/client_session.py [--calls 6] [--out bench/results/client-session.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 1), "mean": round(statistics.fmean(xs), 1),
            "min": round(min(xs), 1), "max": round(max(xs), 1), "n": len(xs)}


def handshake_reuse(cloud, engine, ids, calls: int, profile: str) -> dict:
    from relayinfer.sdk import Client
    from relayinfer.sdk.linkem import PROFILES, LinkProxyThread

    def handshakes():
        return cloud.metrics.registry.get_sample_value("relayinfer_sessions_total") or 0.0

    out = {}
    with LinkProxyThread(cloud.url, PROFILES[profile], seed=7) as link:
        for how in ("one-client", "client-per-call"):
            h0, ttft = handshakes(), []
            kw = dict(cloud_url=link.url, engine=engine, mode="cloud-only")
            if how == "one-client":
                with Client(**kw) as c:
                    for _ in range(calls):
                        ttft.append(c.complete(ids, max_new_tokens=4).ttft_ms)
            else:
                for _ in range(calls):
                    with Client(**kw) as c:
                        ttft.append(c.complete(ids, max_new_tokens=4).ttft_ms)
            out[how] = {"ttft_ms_calls": [round(t, 1) for t in ttft], "ttft_ms_2_to_n": _stats(ttft[1:]),
                        "handshakes": handshakes() - h0}
    a, b = out["one-client"]["ttft_ms_2_to_n"], out["client-per-call"]["ttft_ms_2_to_n"]
    out["saving_ms_per_call_median"] = round(b["median"] - a["median"], 1)
    out["saving_ms_per_call_mean"] = round(b["mean"] - a["mean"], 1)
    out["ratio_median"] = round(b["median"] / a["median"], 2)
    return out


def _concurrent(client, prompts) -> dict:
    """All `prompts` at once from threads on one client (multiplexed over its websocket)."""
    import threading

    out = [None] * len(prompts)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, client.complete(prompts[i], max_new_tokens=16)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = (time.perf_counter() - t0) * 1e3
    return {"requests": len(prompts), "wall_ms": round(wall, 1),
            "device_prompt_ms": _stats([r.device_prompt_ms for r in out]),
            "kv_imported": [r.kv_imported_tokens for r in out], "faults": [r.fault for r in out]}, \
        [r.token_ids for r in out]


def kv_paths(torch_engine, engine, prompts, together) -> dict:
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.sdk import Client

    res, tokens = {}, {}
    for path in ("batched", "per-request"):
        llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=128 << 20)) if path == "batched" else None
        exports = []
        if llm is not None:  # time the engine-thread copy of each hand-off
            runner = llm.engine.runner
            orig = runner.export_kv

            def timed(*a, _orig=orig, **k):
                t = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    exports.append((time.perf_counter() - t) * 1e3)
            runner.export_kv = timed
        svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, max_queue_wait_ms=1e6)
        rows = []
        with ServiceThread(svc, http_port=None), Client(cloud_url=svc.url, engine=engine, kv_handoff=True,
                                                        cloud_budget=None) as c:
            c.complete(prompts[0][:64], max_new_tokens=2)  # warm the path
            exports.clear()
            for ids in prompts:
                r = c.complete(ids, max_new_tokens=16)
                rows.append({"prompt_tokens": len(ids), "kv_imported_tokens": r.kv_imported_tokens,
                             "device_prompt_ms": round(r.device_prompt_ms, 1), "ttft_ms": round(r.ttft_ms, 1),
                             "fault": r.fault, "mode": r.mode})
                tokens.setdefault(len(ids), []).append(r.token_ids)
            conc, conc_tokens = _concurrent(c, together)
            tokens.setdefault("concurrent", []).append(conc_tokens)
        res[path] = {"requests": rows, "concurrent": conc,
                     **({"export_ms": [round(x, 1) for x in exports]} if llm else {})}
    res["same_greedy_tokens"] = all(len(v) == 2 and v[0] == v[1] for v in tokens.values())
    res["device_prompt_ms_ratio_batched_over_per_request"] = [
        round(a["device_prompt_ms"] / b["device_prompt_ms"], 2)
        for a, b in zip(res["batched"]["requests"], res["per-request"]["requests"])]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--out", default=str(OUT / "client-session.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.protocol.model.model_file import default_model_path
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    path = default_model_path()
    torch_engine = TorchEngine(path, device="cpu", threads=1)
    engine = OnnxEngine(ensure_device_model(path), threads=1)
    tok = Tokenizer.from_gguf(path)
    load_before = Path("/proc/loadavg").read_text().strip()
    short = chitchat_prompts_by_length(tok, [64], seed=11)[0]
    report = {"command": " ".join(["python", "bench/client_session.py"] + (argv if argv is not None else sys.argv[1:])),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_before": load_before},
              "handshake_reuse": {}}
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=64 << 20))
    with ServiceThread(CloudService(torch_engine, torch_engine.fingerprint, llm=llm, max_queue_wait_ms=1e6),
                       http_port=None) as cloud:
        for profile in ("loopback", "lte"):
            report["handshake_reuse"][profile] = handshake_reuse(cloud, engine, short, args.calls, profile)
            print(profile, json.dumps(report["handshake_reuse"][profile]), flush=True)
    report["handshake_reuse"]["prompt_tokens"] = len(short)
    prompts = chitchat_prompts_by_length(tok, [256, 512], seed=11)
    together = chitchat_prompts_by_length(tok, [256] * 4, seed=12)
    report["kv_handoff"] = kv_paths(torch_engine, engine, prompts, together)
    print(json.dumps(report["kv_handoff"]), flush=True)
    report["machine"]["loadavg_after"] = Path("/proc/loadavg").read_text().strip()
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def markdown(r: dict) -> str:
    h, k = r["handshake_reuse"], r["kv_handoff"]
    lines = ["# One session per client: handshake reuse and the KV hand-off from the batch", "",
             f"Command: `{r['command']}`  ", f"Machine: {r['machine']['platform']}, {r['machine']['cpus']} CPUs; "
             f"load average before `{r['machine']['loadavg_before']}`, after `{r['machine']['loadavg_after']}` "
             "(a shared machine: compare within this run).", "",
             f"## TTFT of calls 2..N, cloud-only, a {h['prompt_tokens']}-token chitchat prompt (ms)", "",
             "| link | one Client (median / mean) | new Client per call (median / mean) | saving per call (median) | "
             "ratio | websockets (one / per call) |", "|---|---|---|---|---|---|"]
    for p in ("loopback", "lte"):
        a, b = h[p]["one-client"], h[p]["client-per-call"]
        lines.append(f"| {p} | {a['ttft_ms_2_to_n']['median']} / {a['ttft_ms_2_to_n']['mean']} | "
                     f"{b['ttft_ms_2_to_n']['median']} / {b['ttft_ms_2_to_n']['mean']} | "
                     f"{h[p]['saving_ms_per_call_median']} | {h[p]['ratio_median']}x | "
                     f"{a['handshakes']:.0f} / {b['handshakes']:.0f} |")
    lines += ["", "## KV hand-off: batched path vs per-request path (loopback, `kv_handoff=True`)", "",
              "| prompt tokens | path | KV imported | device prompt ms (Generate to KV imported) | TTFT ms |",
              "|---|---|---|---|---|"]
    for i, row in enumerate(k["batched"]["requests"]):
        other = k["per-request"]["requests"][i]
        for name, x in (("batched", row), ("per-request", other)):
            lines.append(f"| {x['prompt_tokens']} | {name} | {x['kv_imported_tokens']} | {x['device_prompt_ms']} | "
                         f"{x['ttft_ms']} |")
    lines += ["", "Four ~256-token hand-offs at once on one Client (multiplexed over its websocket):", "",
              "| path | wall ms (all four) | device prompt ms median / max | KV imported |", "|---|---|---|---|"]
    for name in ("batched", "per-request"):
        cc = k[name]["concurrent"]
        lines.append(f"| {name} | {cc['wall_ms']} | {cc['device_prompt_ms']['median']} / {cc['device_prompt_ms']['max']} "
                     f"| {cc['kv_imported']} |")
    lines += ["", f"Same greedy tokens on both paths: {k['same_greedy_tokens']}. Engine-thread export per hand-off "
              f"(batched path, ms): {k['batched'].get('export_ms')}. Device prompt time ratio batched / per-request: "
              f"{k['device_prompt_ms_ratio_batched_over_per_request']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
