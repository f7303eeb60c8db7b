"""The cloud engine's linears on oneDNN pre-packed weights (`llama.PackedLinear`) against `F.linear`,
and the engine in bfloat16 (`TorchEngine(dtype="bfloat16")`) beside both.

Two figures, one process, one thread pinned to one core, the variants alternated per repeat:

* all 211 linear layers of the model (real SmolLM2 weights) at M rows (1 = one decode token,
  4-16 = a decode batch, 64-256 = prefill chunks): ms per pass, median of `--reps`, for fp32
  `F.linear` (MKL), fp32 packed (oneDNN) and bf16 `F.linear` (oneDNN's AMX / AVX512-BF16 kernels
  where the CPU has them, else a slower conversion path);
* one decode-only step of the batching engine (`LLMEngine.step`) with N chitchat requests in
  flight, on a `TorchEngine` dense fp32, packed fp32 (as the engine runs it: `F.linear` below
  the row count `llama.kernel_min_rows` measured at load, reported as `packed_min_rows`) and bf16 (same weights), median over `--steps`.

    .venv/bin/python bench/packed_linear.py [--rows 1,2,4,8,16,64,256] [--batches 1,4,16] [--reps 7] [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from machine import describe  # bench/machine.py, beside this script
from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.cloud.models.llama import PackedLinear, load_llama, pack_linears
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.sdk.datasets import chitchat_prompts_by_length


def linears_ms(dense: list[torch.Tensor], packed: list[PackedLinear], half: list[torch.Tensor], m: int,
               reps: int) -> tuple[float, float, float]:
    """(F.linear fp32 ms, packed ms, F.linear bf16 ms) for one pass over every linear at `m` rows
    (median of `reps`)."""
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(1, m, k, generator=g) * 0.1 for k in {w.shape[1] for w in dense}}
    xh = {k: x.to(torch.bfloat16) for k, x in xs.items()}
    a, b, c = [], [], []
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            for w in dense:
                F.linear(xs[w.shape[1]], w)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            for lin in packed:  # the packed kernel itself (the module runs F.linear below PACKED_MIN_ROWS rows)
                torch.ops.mkldnn._linear_pointwise(xs[lin.in_features], lin.packed, lin.bias, "none", [], "")
            b.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in half:
                F.linear(xh[w.shape[1]], w)
            c.append(time.perf_counter() - t)
    return tuple(1e3 * float(np.median(v)) for v in (a, b, c))


def step_ms(engines: dict[str, TorchEngine], prompts: list[list[int]], n: int, steps: int) -> dict[str, float]:
    """Median decode-only step (ms) of an `LLMEngine` on each engine with `n` requests in flight,
    the engines' steps interleaved."""
    runs = {}
    for name, te in engines.items():
        e = LLMEngine(te, kv_cache_bytes=256 << 20, max_num_batched_tokens=4096, enable_prefix_caching=False)
        for i, p in enumerate(prompts[:n]):
            e.add_request(f"r{i}", p, SamplingParams(max_new_tokens=steps + 8), ignore_eos=True)
        e.step()
        e.step()
        runs[name] = (e, [])
    for _ in range(steps):
        for e, ts in runs.values():
            t = time.perf_counter()
            e.step()
            ts.append(time.perf_counter() - t)
    return {name: 1e3 * float(np.median(ts)) for name, (_, ts) in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cpu", type=int, default=0, help="the core to pin to")
    ap.add_argument("--out", default="bench/results/packed_linear")
    a = ap.parse_args(argv)
    try:
        rows = [int(x) for x in a.rows.split(",")]
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        print("--rows and --batches take comma-separated integers", file=sys.stderr)
        return 2
    if min(rows + batches) < 1 or a.reps < 1 or a.steps < 1:
        print("--rows, --batches, --reps and --steps must be >= 1", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {a.cpu})
    torch.set_num_threads(1)
    model = load_llama()
    dense = [mod.weight.detach() for mod in model.modules() if type(mod) is torch.nn.Linear]
    packed_model = pack_linears(load_llama())
    packed = [mod for mod in packed_model.modules() if isinstance(mod, PackedLinear)]
    if len(packed) != len(dense):
        print("this torch build cannot pack linears (no oneDNN): nothing to compare", file=sys.stderr)
        return 1
    half = [w.to(torch.bfloat16) for w in dense]
    lin_rows = []
    for m in rows:
        d, p, h = linears_ms(dense, packed, half, m, a.reps)
        lin_rows.append({"rows": m, "f_linear_ms": round(d, 2), "packed_ms": round(p, 2), "bf16_ms": round(h, 2),
                         "speedup": round(d / p, 2), "bf16_speedup": round(d / h, 2)})
        print(lin_rows[-1], flush=True)
    del half
    engines = {"dense": TorchEngine(model=model, pack_weights=False), "packed": TorchEngine(model=packed_model),
               "bf16": TorchEngine(dtype="bfloat16")}
    from relayinfer.protocol.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(engines["dense"].model_path)
    prompts = chitchat_prompts_by_length(tok, [32, 64, 96, 128], per_length=-(-max(batches) // 4), seed=0)
    step_rows = []
    for n in batches:
        s = step_ms(engines, prompts, n, a.steps)
        step_rows.append({"requests": n, "dense_step_ms": round(s["dense"], 1), "packed_step_ms": round(s["packed"], 1),
                          "bf16_step_ms": round(s["bf16"], 1), "speedup": round(s["dense"] / s["packed"], 2),
                          "bf16_speedup": round(s["dense"] / s["bf16"], 2)})
        print(step_rows[-1], flush=True)
    cmd = "python bench/packed_linear.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"command": cmd.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpu": describe(),
           "load_avg_before": os.getloadavg(), "torch": torch.__version__, "packed_min_rows": packed[0].min_rows,
           "bf16_mv_min_rows": engines["bf16"].model.layers[0].up.min_rows,
           "linears": lin_rows, "engine_steps": step_rows}
    Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    md = [f"# Cloud engine linears: oneDNN pre-packed fp32 weights and bf16 vs F.linear fp32 (SmolLM2-135M)\n",
          f"Command: `{res['command']}` ({res['date']}, {res['cpu']}, 1 thread pinned to core {a.cpu}, "
          f"torch {torch.__version__}).\n",
          "All 211 linear layers at M rows, ms per pass (median):\n",
          "| rows | F.linear fp32 (MKL) ms | packed fp32 (oneDNN) ms | F.linear bf16 ms | packed speedup | bf16 speedup |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['rows']} | {r['f_linear_ms']} | {r['packed_ms']} | {r['bf16_ms']} | {r['speedup']}x | {r['bf16_speedup']}x |"
           for r in lin_rows]
    md += ["", f"One decode-only `LLMEngine.step` with N requests in flight (chitchat prompts 32-128 tokens), ms (median); "
           f"the packed engine runs the packed kernel from {res['packed_min_rows']} row(s) on (measured at load, "
           "`llama.kernel_min_rows`), F.linear below; the bf16 engine's one-row calls run "
           + ("torch.mv" if res["bf16_mv_min_rows"] == 1 else "F.linear (torch.mv measured slower)") + ":\n",
           "| N | dense fp32 step ms | packed fp32 step ms | bf16 step ms | packed speedup | bf16 speedup |",
           "|---|---|---|---|---|---|"]
    md += [f"| {r['requests']} | {r['dense_step_ms']} | {r['packed_step_ms']} | {r['bf16_step_ms']} | {r['speedup']}x | "
           f"{r['bf16_speedup']}x |" for r in step_rows]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
