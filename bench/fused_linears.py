"""What fusing the `weights='gguf'` engine's linears buys: Q/K/V as one `BlockLinear` and gate/up as
one (`llama.FUSED`) against the seven separate layers, in the batching engine (`LLMEngine`) on the
default model, at N concurrent greedy requests of a 100-token prompt.

Figure: decode step time (ms) = (time of 72 new tokens - time of 8) / 64, the fastest of `--reps`
interleaved rounds per engine (a shared machine: compare within one run). Both engines are in this
process, built from the same file; their tokens are checked equal (the fused layers compute the same
bits, tests/test_block_weights.py).

    .venv/bin/python bench/fused_linears.py [--n 1,4,16] [--reps 5] [--threads 2] [--out bench/results/fused_linears.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from machine import describe  # bench/machine.py, beside this script


def engines(threads: int) -> dict:
    """{'fused': LLMEngine, 'separate': LLMEngine} on weights 'gguf' (separate: `FUSED` emptied while it loads)."""
    import relayinfer.cloud.models.llama as llama
    from relayinfer.cloud.engine.llm_engine import LLMEngine
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    out = {"fused": LLMEngine(TorchEngine(threads=threads, weights="gguf"))}
    saved = dict(llama.FUSED)
    llama.FUSED.clear()
    try:
        out["separate"] = LLMEngine(TorchEngine(threads=threads, weights="gguf"))
    finally:
        llama.FUSED.update(saved)
    return out


def main(argv=None) -> int:
    from relayinfer.protocol.model.decoding import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1,4,16", help="concurrent requests, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/fused_linears.json")
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.n.split(",")]
    eng = engines(a.threads)
    prompt = list(range(100, 200))
    best = {(k, n): float("inf") for k in eng for n in ns}
    tokens = {}
    for e in eng.values():
        e.generate([prompt], SamplingParams(max_new_tokens=8))  # first steps allocate
    for _ in range(a.reps):
        for n in ns:
            for k, e in eng.items():
                t0 = time.perf_counter()
                e.generate([prompt] * n, SamplingParams(max_new_tokens=8))
                t1 = time.perf_counter()
                tokens[k, n] = e.generate([prompt] * n, SamplingParams(max_new_tokens=72))
                t2 = time.perf_counter()
                best[k, n] = min(best[k, n], ((t2 - t1) - (t1 - t0)) / 64 * 1e3)
    rows = [{"n": n, "fused_ms": round(best["fused", n], 2), "separate_ms": round(best["separate", n], 2),
             "speedup": round(best["separate", n] / best["fused", n], 3),
             "tokens_equal": tokens["fused", n] == tokens["separate", n]} for n in ns]
    doc = {"command": " ".join(["python bench/fused_linears.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": describe(), "threads": a.threads, "reps": a.reps, "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    md = ["# Fused Q/K/V and gate/up linears, weights 'gguf' (decode step ms, batching engine)", "",
          f"`{doc['command']}`; {doc['machine']}; {a.threads} torch threads, fastest of {a.reps}.", "",
          "| N | fused | separate | speedup | tokens equal |", "|---|---|---|---|---|"]
    md += [f"| {r['n']} | {r['fused_ms']:.2f} | {r['separate_ms']:.2f} | {r['speedup']:.3f}x | {r['tokens_equal']} |"
           for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
