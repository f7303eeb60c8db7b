"""Where one decode step of the batching engine spends its time (torch.profiler, CPU, 1 thread).

`--concurrency` chitchat requests (bench/cloud_engine.py's prompt mix) are prefilled, then
`--steps` decode-only steps run under `torch.profiler`; self CPU time is grouped by operator
(matmuls, SDPA, the K/V gather, the K/V write, the rest) and the per-step wall time is printed with
the time outside torch ops (Python: scheduling, bookkeeping, sampling loop).

    .venv/bin/python bench/engine_profile.py [--concurrency 16] [--steps 8] [--out bench/results/engine_profile.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.sdk.datasets import chitchat_prompts_by_length

GROUPS = {"aten::addmm": "matmul", "aten::mm": "matmul", "aten::linear": "matmul", "aten::matmul": "matmul",
          "aten::bmm": "matmul",
          "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
          "aten::_scaled_dot_product_attention_math": "attention (SDPA)",
          "aten::index_select": "K/V gather (index_select)", "aten::index_copy_": "K/V write (index_copy_)",
          "aten::stack": "K/V write (index_copy_)", "aten::cat": "K/V write (index_copy_)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/engine_profile.json")
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.steps < 1:
        print("--concurrency and --steps must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    te = TorchEngine(device="cpu", threads=1)
    tok = Tokenizer.from_gguf(te.model_path)
    pool = chitchat_prompts_by_length(tok, [32, 64, 96, 128], per_length=math.ceil(a.concurrency / 4), seed=0)
    prompts = [pool[i] for i in np.random.default_rng(0).permutation(len(pool))[:a.concurrency]]
    engine = LLMEngine(te, kv_cache_bytes=512 << 20, max_num_batched_tokens=4096)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=a.steps + 4), ignore_eos=True)
    engine.step()  # prefill all
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        wall = time.perf_counter() - t
    groups: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        groups[GROUPS.get(ev.key, "other torch ops")] += ev.self_cpu_time_total / 1e3  # ms
    torch_ms = sum(groups.values())
    total_ms = wall * 1e3
    groups["python (outside torch ops)"] = max(0.0, total_ms - torch_ms)
    res = {"command": "python bench/engine_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "concurrency": a.concurrency, "step_ms": round(total_ms / a.steps, 2),
           "pct": {k: round(100 * v / total_ms, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}
    print(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
