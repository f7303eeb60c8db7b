"""Single-request decode speed of our torch model (`TorchEngine`) against Hugging Face transformers
on the same weights, at a short and a long context, one thread.

Both sides prefill the same real chat tokens (chitchat conversations, chat template applied,
concatenated up to the context length), then decode greedily one token per forward with their KV
cache (ours: `StaticKV`; transformers: `DynamicCache` through `model(..., past_key_values=...)`,
its default SDPA attention). Rounds of `--steps` decode steps alternate between the two (the
machine is shared; ratios are taken within one run, per round, and the median reported).

    .venv/bin/python bench/torch_decode.py [--contexts 128,4096] [--steps 16] [--rounds 3] [--threads 1]
        [--out bench/results/torch_decode.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.sdk.datasets import chitchat_prompts_by_length


def context_ids(tok: Tokenizer, n: int) -> list[int]:
    """`n` real chat tokens: chitchat prompts of ~128 tokens concatenated, cut to `n`."""
    ids: list[int] = []
    pool = chitchat_prompts_by_length(tok, [128], per_length=max(1, n // 100 + 1), seed=1)
    for p in pool:
        ids.extend(p)
    while len(ids) < n:
        ids.extend(ids)
    return ids[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round (tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/torch_decode.json")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.rounds < 1 or a.threads < 1:
        print("--steps, --rounds and --threads must be >= 1", file=sys.stderr)
        return 2
    import transformers
    from transformers import DynamicCache

    torch.set_num_threads(a.threads)
    te = TorchEngine(device="cpu", threads=a.threads)
    tok = Tokenizer.from_gguf(te.model_path)
    path = Path(te.model_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        ids = context_ids(tok, ctx)
        with torch.inference_mode():
            t = time.perf_counter()
            logits, kv = te.prefill(ids, te.new_cache(ctx + a.steps * a.rounds + 8))
            ours_prefill = time.perf_counter() - t
            ours_tok = int(logits.argmax())
            t = time.perf_counter()
            cache = DynamicCache()
            out = hf(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            hf_prefill = time.perf_counter() - t
            hf_tok = int(out.logits[0, -1].argmax())
            ours_ms, hf_ms, same = [], [], ours_tok == hf_tok
            for _ in range(a.rounds):
                t = time.perf_counter()
                for _ in range(a.steps):
                    logits, kv = te.decode(ours_tok, kv)
                    ours_tok = int(logits.argmax())
                ours_ms.append((time.perf_counter() - t) * 1e3 / a.steps)
                t = time.perf_counter()
                for _ in range(a.steps):
                    out = hf(input_ids=torch.tensor([[hf_tok]]), past_key_values=cache, use_cache=True)
                    hf_tok = int(out.logits[0, -1].argmax())
                hf_ms.append((time.perf_counter() - t) * 1e3 / a.steps)
                same = same and ours_tok == hf_tok
        ratios = [h / o for h, o in zip(hf_ms, ours_ms)]
        row = {"context": ctx, "ours_decode_ms": [round(x, 2) for x in ours_ms],
               "transformers_decode_ms": [round(x, 2) for x in hf_ms],
               "speedup_median": round(statistics.median(ratios), 3),
               "ours_prefill_s": round(ours_prefill, 2), "transformers_prefill_s": round(hf_prefill, 2),
               "same_greedy_tokens": same}
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = {"command": "python bench/torch_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()} {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
                      f"transformers {transformers.__version__}, attn {hf.config._attn_implementation}",
           "steps_per_round": a.steps, "rounds": a.rounds, "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
