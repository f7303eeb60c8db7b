"""Multi-turn reuse on real chitchat conversations: per turn, TTFT, cloud tokens,
cloud-cached and device-cached prompt tokens, device prompt-prefill time, with and without reuse.

Each conversation (3-6 user turns from `chitchat-dataset`) is played twice through the SDK against
one `CloudService` (TorchEngine, per-request path: the session keeps its last KV): once with
`client.conversation(reuse=True)` (one websocket; device and cloud keep their KV, turn k+1
prefills only what is new) and once with `reuse=False` (a websocket and a full prefill per turn,
as `Client.generate`). The assistant turns are the model's own greedy answers, so both plays see
the same prompts (checked: the answers are equal). Cloud and device are pinned to different cores
with one thread each; the machine is shared, so compare the ratio within this run.

    python bench/multiturn.py [--conversations 6] [--max-new-tokens 48] [--profile local|phone]
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

from relayinfer.sdk.datasets import chitchat_prompt

OUT = Path(__file__).parent / "results"
FIELDS = ("ttft_ms", "cloud_tokens", "device_tokens", "handoff_index", "mode", "device_prompt_ms",
          "device_prefill_ms", "device_prompt_tokens", "device_cached_tokens", "cloud_cached_tokens", "cloud_budget")


def conversations(n: int, min_turns: int = 3, max_turns: int = 6, start: int = 0) -> list[list[str]]:
    """The user turns of the first `n` chitchat conversations (from `start`) with at least
    `min_turns` of them (at most `max_turns` kept)."""
    out, i = [], start
    while len(out) < n and i < start + 10_000:
        users = [m["content"] for m in chitchat_prompt(i, max_turns=2 * max_turns) if m["role"] == "user"]
        if len(users) >= min_turns:
            out.append(users[:max_turns])
        i += 1
    return out


def pin(executor, cpu: int) -> None:
    """Pin the single thread of `executor` to `cpu` (Linux: the calling thread's affinity)."""
    if hasattr(os, "sched_setaffinity") and cpu < os.cpu_count():
        executor.submit(os.sched_setaffinity, 0, {cpu}).result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--profile", default=None, help="device profile pacing the engine (default: none, local speed)")
    ap.add_argument("--time-limit-s", type=float, default=1500.0, help="stop starting conversations after this")
    ap.add_argument("--cloud-budget", default="auto",
                    help="'auto' (the settings algorithm), 'none' (the cloud streams until the device takes over) or N")
    ap.add_argument("--out", default=str(OUT / "multiturn.json"))
    args = ap.parse_args(argv)
    if args.conversations < 1 or args.max_new_tokens < 1:
        print("--conversations and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        budget = {"auto": "auto", "none": None}.get(args.cloud_budget) if args.cloud_budget in ("auto", "none") \
            else int(args.cloud_budget)
    except ValueError:
        print(f"--cloud-budget must be auto, none or an int, got {args.cloud_budget!r}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.sdk.client import Client

    te = TorchEngine(device="cpu", threads=1)
    eng = OnnxEngine.for_model(threads=1)
    eng.warmup()
    svc = CloudService(te, te.fingerprint)
    pin(svc.worker, 0)
    convs = conversations(args.conversations)
    rows, t_start = [], time.perf_counter()
    with ServiceThread(svc, http_port=None) as s:
        client = Client(cloud_url=s.url, engine=eng, profile=args.profile, kv_handoff=False, cloud_budget=budget)
        pin(client._executor, 1)
        client.complete("Hello!", max_new_tokens=4)  # warm: cloud estimates, calibration
        for ci, turns in enumerate(convs):
            if time.perf_counter() - t_start > args.time_limit_s:
                break
            with client.conversation(reuse=True, max_new_tokens=args.max_new_tokens) as a, \
                    client.conversation(reuse=False, max_new_tokens=args.max_new_tokens) as b:
                for k, text in enumerate(turns):
                    ra, rb = a.send(text), b.send(text)
                    for reuse, r in ((True, ra), (False, rb)):
                        rows.append({"conversation": ci, "turn": k + 1, "reuse": reuse, "request_id": r.request_id,
                                     "prompt_tokens": len(r.prompt_ids), "fault": r.fault,
                                     **{f: getattr(r, f) for f in FIELDS}})
                    rows[-1]["same_answer"] = rows[-2]["same_answer"] = ra.token_ids == rb.token_ids
                websockets = a.link.connections
            print(f"conversation {ci}: {len(turns)} turns, reuse websockets {websockets}", flush=True)
        client.close()
        time.sleep(1.0)  # the last turns' Done records (the cloud finishes after the device took over)
        done = {d.request_id: d for d in list(s.completed)}
        for r in rows:  # the cloud's own count (the device sees it only when the cloud's first token came first)
            d = done.get(r["request_id"])
            r["cloud_cached_tokens"] = d.cached_tokens if d is not None else r["cloud_cached_tokens"]
            r["cloud_prefill_ms"] = d.prefill_ms if d is not None else None

    table = summarize(rows)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "note": "2 cores shared with other work; ratios within the run are what counts"},
              "profile": args.profile or "local", "max_new_tokens": args.max_new_tokens,
              "cloud_budget": args.cloud_budget,
              "conversations": len({r["conversation"] for r in rows}), "by_turn": table, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    md = [f"Multi-turn reuse on chitchat conversations (`{result['command']}`; profile {result['profile']}, "
          f"cloud budget {args.cloud_budget}, {result['conversations']} conversations, medians per turn; "
          "cloud cached: from the cloud's Done records).", "",
          "| turn | n | prompt tokens | device cached | cloud cached | device prompt ms, reuse | no reuse | ratio | "
          "TTFT ms, reuse | no reuse | cloud tokens, reuse | no reuse | same answers |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table:
        md.append(f"| {t['turn']} | {t['n']} | {t['prompt_tokens']:.0f} | {t['device_cached_tokens']:.0f} | "
                  f"{t['cloud_cached_tokens']:.0f} | {t['device_prompt_ms_reuse']:.0f} | {t['device_prompt_ms_fresh']:.0f} | "
                  f"{t['device_prompt_ratio']:.2f} | {t['ttft_ms_reuse']:.0f} | {t['ttft_ms_fresh']:.0f} | "
                  f"{t['cloud_tokens_reuse']:.0f} | {t['cloud_tokens_fresh']:.0f} | {t['same_answers']} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per turn; device_prompt_ratio: median over conversations of reuse / no-reuse device
    prompt time (the same conversation and turn), where the device prefilled on both plays."""
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        a = [r for r in rows if r["turn"] == turn and r["reuse"]]
        b = {r["conversation"]: r for r in rows if r["turn"] == turn and not r["reuse"]}
        pairs = [(r, b[r["conversation"]]) for r in a if r["conversation"] in b]
        ratios = [x["device_prompt_ms"] / y["device_prompt_ms"] for x, y in pairs
                  if x["device_prompt_ms"] > 0 and y["device_prompt_ms"] > 0]
        med = lambda key, rs: float(np.median([r[key] or 0 for r in rs])) if rs else float("nan")  # noqa: E731
        out.append({"turn": turn, "n": len(pairs), "prompt_tokens": med("prompt_tokens", a),
                    "device_cached_tokens": med("device_cached_tokens", a),
                    "cloud_cached_tokens": med("cloud_cached_tokens", a),
                    "device_prompt_ms_reuse": med("device_prompt_ms", [x for x, _ in pairs]),
                    "device_prompt_ms_fresh": med("device_prompt_ms", [y for _, y in pairs]),
                    "device_prompt_ratio": float(np.median(ratios)) if ratios else float("nan"),
                    "ttft_ms_reuse": med("ttft_ms", [x for x, _ in pairs]),
                    "ttft_ms_fresh": med("ttft_ms", [y for _, y in pairs]),
                    "cloud_tokens_reuse": med("cloud_tokens", [x for x, _ in pairs]),
                    "cloud_tokens_fresh": med("cloud_tokens", [y for _, y in pairs]),
                    "same_answers": f"{sum(x['same_answer'] for x, _ in pairs)}/{len(pairs)}"})
    return out


if __name__ == "__main__":
    sys.exit(main())
