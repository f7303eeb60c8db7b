"""KV hand-off: when does sending the prompt's KV beat the device's own prefill?

The device imports the cloud's KV iff (protocol.kvhandoff.kv_handoff_pays)

    T + L x bytes_per_token / bandwidth + overhead(L) + a + b  <  a + b x (L + 1)

(T: cloud TTFT, the KV leaves after the first token; a + b x n: the device's prefill fit; the
device prefills the last prompt token itself). The crossover bandwidth is where both sides meet:
L x bytes_per_token / (b x L - T - overhead). This driver measures, in one run on this machine:

* bytes per token from the model config (fp16 on the wire);
* the device prefill fit (a, b) of the local ONNX engine (prefills of 64..512 real chat-prompt
  tokens), the phone profile's (device/profiles/phone.json, a simulation's numbers, no measurement);
* the hand-off overhead on loopback: packing the KV into KVTransfer frames, encoding, decoding and
  importing it into the ONNX engine (ms, by prompt length), and the loopback websocket bandwidth
  (a real split request with the KV hand-off vs the same request re-prefilling, on a CloudService
  with the TorchEngine, cloud and device pinned to different cores, one thread each);
* the crossover bandwidth for both devices at several prompt lengths.

    python bench/kv_handoff.py [--lengths 128,256,512,1024] [--out bench/results/kv_handoff.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from relayinfer.device.onnx_engine import OnnxEngine
from relayinfer.device.profiles import load_profile
from relayinfer.device.settings import cost_line
from relayinfer.protocol.kvhandoff import crossover_bandwidth, kv_bytes_per_token, kv_layers, kv_messages
from relayinfer.protocol.messages import decode, encode
from relayinfer.sdk.datasets import chitchat_prompts_by_length

OUT = Path(__file__).parent / "results"


def pin(executor, cpu: int) -> None:
    """Pin the (single) thread of `executor` to `cpu` (Linux: affinity of the calling thread)."""
    if hasattr(os, "sched_setaffinity") and cpu < os.cpu_count():
        executor.submit(os.sched_setaffinity, 0, {cpu}).result()


def best_of(fn, repeat: int = 3) -> float:
    """Fastest wall time of `repeat` calls (ms): the machine is shared, the minimum is the least disturbed."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return min(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,256,512,1024", help="prompt lengths (tokens)")
    ap.add_argument("--e2e-lengths", default="128,512", help="prompt lengths of the loopback split requests")
    ap.add_argument("--out", default=str(OUT / "kv_handoff.json"))
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown table from --out's JSON")
    args = ap.parse_args(argv)
    if args.render:
        render(json.loads(Path(args.out).read_text()), args.out)
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    e2e_lengths = [int(x) for x in args.e2e_lengths.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    eng = OnnxEngine.for_model(threads=1)
    eng.warmup()
    tok = eng.tokenizer()
    c = eng.cfg
    bpt = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)
    prompts = chitchat_prompts_by_length(tok, sorted(set(lengths + e2e_lengths)), seed=3)
    by_len = dict(zip(sorted(set(lengths + e2e_lengths)), prompts))

    # device prefill fit and hand-off overhead by prompt length (this thread, one ORT thread)
    rows, xs, ys = [], [], []
    for n in lengths:
        ids = by_len[n]
        prefill_ms = best_of(lambda: eng.prefill(ids))
        _, kv = eng.prefill(ids[:-1])
        arr = np.stack([np.stack([k[0], v[0]]) for k, v in eng.kv_export(kv)]).astype(np.float16)

        def handoff():  # cloud side: pack + encode; device side: decode + import + prefill of the last token
            frames = [encode(m) for m in kv_messages("r", arr, 0)]
            start, layers = kv_layers([decode(f) for f in frames])
            eng.prefill(ids[-1:], eng.kv_import(layers, len(ids) - 1))
        overhead_ms = best_of(handoff)
        xs.append(len(ids))
        ys.append(prefill_ms)
        rows.append({"prompt_tokens": len(ids), "device_prefill_ms": round(prefill_ms, 1),
                     "kv_bytes": (len(ids) - 1) * bpt, "handoff_overhead_ms": round(overhead_ms, 1)})
    a, b = cost_line(xs, ys)
    local = {"prefill_ms_base": round(float(a), 2), "prefill_ms_per_token": round(float(b), 3)}
    phone_p = load_profile("phone")
    phone = {"prefill_ms_base": phone_p.prefill_ms_base, "prefill_ms_per_token": phone_p.prefill_ms_per_token}

    e2e, cloud_ttft = loopback(eng, [by_len[n] for n in e2e_lengths], bpt)
    ttft = float(np.median([r["cloud_ttft_ms"] for r in e2e])) if e2e else NOMINAL_TTFT_MS
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "note": "2 cores shared with "
                    "other work: absolute times are noisy, ratios within the run are what counts"},
        "kv_bytes_per_token": bpt,
        "device_fit": {"local (measured)": local, "phone (profile, simulated device)": phone},
        "asymptotic_crossover_MB_s": {"local": round(bpt / b * 1e3 / 1e6, 2) if b > 0 else None,
                                      "phone": round(bpt / phone["prefill_ms_per_token"] * 1e3 / 1e6, 2)},
        "by_length": rows, "loopback_requests": e2e, "measured_cloud_ttft_ms": round(ttft, 1),
    }
    render(result, args.out)
    return 0


NOMINAL_TTFT_MS = 150.0  # a cloud TTFT (round trip included) of an unloaded GPU cloud: CloudEstimate's default


def render(result: dict, out: str) -> dict:
    """Crossover bandwidths from the measured fits and overheads, at the measured cloud TTFT
    (this loaded loopback run) and at a nominal 150 ms; writes the JSON and the markdown."""
    bpt, fits = result["kv_bytes_per_token"], result["device_fit"]
    local, phone = fits["local (measured)"], fits["phone (profile, simulated device)"]
    ttft, e2e = result["measured_cloud_ttft_ms"], result["loopback_requests"]
    cross = []
    for r in result["by_length"]:
        for name, fit in (("local", local), ("phone", phone)):
            for t in (ttft, NOMINAL_TTFT_MS):
                bw = crossover_bandwidth(r["prompt_tokens"] - 1, bpt, t, fit["prefill_ms_per_token"],
                                         r["handoff_overhead_ms"])
                cross.append({"device": name, "prompt_tokens": r["prompt_tokens"], "cloud_ttft_ms": t,
                              "overhead_ms": r["handoff_overhead_ms"],
                              "crossover_MB_s": None if bw == float("inf") else round(bw / 1e6, 2)})
    result["crossover"] = cross
    Path(out).write_text(json.dumps(result, indent=1))
    fmt = lambda v: "never" if v is None else v  # noqa: E731
    md = [f"KV hand-off crossover (`{result['command']}`); KV {bpt} bytes/token (fp16). Send the KV iff the "
          f"link is faster than the crossover. Cloud TTFT: {ttft:.0f} ms measured here (CPU cloud on a loaded "
          f"shared core) and a nominal {NOMINAL_TTFT_MS:.0f} ms (not measured). Phone: the profile's numbers "
          "(a simulated device); local: this machine's ONNX engine, measured.", "",
          "| prompt tokens | device | device prefill ms/token | hand-off overhead ms (measured) | "
          f"crossover MB/s, TTFT {ttft:.0f} ms | crossover MB/s, TTFT {NOMINAL_TTFT_MS:.0f} ms |",
          "|---:|---|---:|---:|---:|---:|"]
    for i in range(0, len(cross), 2):
        a, b = cross[i], cross[i + 1]
        fit = local if a["device"] == "local" else phone
        md.append(f"| {a['prompt_tokens']} | {a['device']} | {fit['prefill_ms_per_token']:.2f} | {a['overhead_ms']} | "
                  f"{fmt(a['crossover_MB_s'])} | {fmt(b['crossover_MB_s'])} |")
    md += ["", f"Asymptote (long prompts, bytes per token / prefill ms per token): local "
           f"{result['asymptotic_crossover_MB_s']['local']} MB/s, phone {result['asymptotic_crossover_MB_s']['phone']} MB/s.",
           "", "Loopback split requests (greedy, the same tokens both ways):", "",
           "| prompt tokens | KV MB | device prompt ms, own prefill | device prompt ms, KV hand-off (incl. the "
           "wait for the cloud's first token) | effective MB/s (KV bytes / (KV imported - first token shown)) | "
           "HTTP probe MB/s (`Client.measure_link`) | same tokens |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in e2e:
        md.append(f"| {r['prompt_tokens']} | {r['kv_bytes'] / 1e6:.2f} | {r['own_prompt_ms']:.0f} | "
                  f"{r['kv_prompt_ms']:.0f} | {r['effective_MB_s']} | {r['http_probe_MB_s']} | {r['same_tokens']} |")
    Path(out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return result


def loopback(eng, prompts, bpt):
    """Split requests on loopback, each with the KV hand-off and with the device's own prefill.
    Returns (rows, None); device_prompt_ms of the hand-off includes waiting for the cloud's
    first token and the transfer."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.sdk.client import Client

    te = TorchEngine(device="cpu", threads=1)
    svc = CloudService(te, te.fingerprint, device_model_dir=eng.model_dir)  # serves the files measure_link fetches
    pin(svc.worker, 0)
    rows = []
    with ServiceThread(svc, http_port=0) as s:
        common = dict(cloud_url=s.url, engine=eng, cloud_budget=None, cloud_http_url=s.http_url)
        kvc, own = Client(kv_handoff=True, **common), Client(kv_handoff=False, **common)
        pin(kvc._executor, 1)
        pin(own._executor, 1)
        measured = kvc.measure_link()
        for ids in prompts:
            kvc.complete(ids, max_new_tokens=4)  # warm: the cloud estimates and allocations
            a = kvc.complete(ids, max_new_tokens=16)
            b = own.complete(ids, max_new_tokens=16)
            first_cloud = a.ttft_ms  # the shown first token is the cloud's
            transfer_ms = max(a.device_prompt_ms - first_cloud, 1e-3)
            rows.append({"prompt_tokens": len(ids), "kv_bytes": (len(ids) - 1) * bpt,
                         "kv_imported_tokens": a.kv_imported_tokens, "cloud_ttft_ms": round(first_cloud, 1),
                         "kv_prompt_ms": round(a.device_prompt_ms, 1), "own_prompt_ms": round(b.device_prompt_ms, 1),
                         "effective_MB_s": round((len(ids) - 1) * bpt / transfer_ms * 1e3 / 1e6, 1),
                         "http_probe_MB_s": round(measured / 1e6, 1),
                         "same_tokens": a.token_ids == b.token_ids})
    return rows, None


if __name__ == "__main__":
    sys.exit(main())
