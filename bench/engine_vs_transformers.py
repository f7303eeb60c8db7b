"""The continuous-batching engine (`LLMEngine`) against transformers' batched `generate` at several
concurrency levels, in one run, plus the engine's token identity with each request served alone.

Workload of bench/cloud_engine.py / bench/transformers_batched.py: chitchat prompts (chat template,
lengths mixed 32/64/96/128, seed 0), greedy, `--new` new tokens with EOS ignored (transformers:
min_new_tokens = max_new_tokens, left padding; engine: ignore_eos), all n requests at t = 0, one
thread. For each n the two systems run back to back (transformers first, then the engine), twice,
and each keeps its faster run (the machine is shared). Output tokens/s = n * new / wall s. Token
identity: the engine's answers to the first `--check-alone` prompts (in every batch) against
`TorchEngine` greedy decoding of that prompt alone (up to its EOS: the engine ignores EOS).

    .venv/bin/python bench/engine_vs_transformers.py [--concurrency 1,4,16] [--new 96] [--repeats 2]
        [--out bench/results/engine_vs_transformers.json]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.sdk.datasets import chitchat_prompts_by_length

LENGTHS, SEED = [32, 64, 96, 128], 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--new", type=int, default=96, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check-alone", type=int, default=4, help="token identity checked for the first N prompts")
    ap.add_argument("--out", default="bench/results/engine_vs_transformers.json")
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    if a.new < 1 or a.repeats < 1 or min(levels) < 1:
        print("--new, --repeats and every --concurrency level must be >= 1", file=sys.stderr)
        return 2
    import transformers

    torch.set_num_threads(1)
    te = TorchEngine(device="cpu", threads=1)
    tok = Tokenizer.from_gguf(te.model_path)
    nmax = max(levels)
    pool = chitchat_prompts_by_length(tok, LENGTHS, per_length=math.ceil(nmax / len(LENGTHS)), seed=SEED)
    prompts = [pool[i] for i in np.random.default_rng(SEED).permutation(len(pool))[:nmax]]
    path = Path(te.model_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    pad = te.eos_id
    greedy = SamplingParams(max_new_tokens=a.new)
    alone = [te.generate(p, greedy).token_ids for p in prompts[:a.check_alone]]

    def run_hf(ps):
        width = max(map(len, ps))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            t = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                        pad_token_id=pad)
            return time.perf_counter() - t

    def run_engine(ps):
        engine = LLMEngine(te, kv_cache_bytes=512 << 20)
        out = {f"r{i}": [] for i in range(len(ps))}
        t = time.perf_counter()
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, greedy, ignore_eos=True)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].append(o.token_id)
        return time.perf_counter() - t, [out[f"r{i}"] for i in range(len(ps))]

    run_hf(prompts[:2])  # warm-up both
    run_engine([prompts[0][:16]])
    rows = []
    for n in levels:
        ps = prompts[:n]
        hf_s, eng_s, mism = [], [], 0
        for _ in range(a.repeats):
            hf_s.append(run_hf(ps))
            s, toks = run_engine(ps)
            eng_s.append(s)
            # alone: TorchEngine stops at EOS; compare the tokens it produced
            mism += sum(t[:len(r)] != r for t, r in zip(toks, alone))
        row = {"concurrency": n, "transformers_s": [round(x, 2) for x in hf_s], "engine_s": [round(x, 2) for x in eng_s],
               "transformers_out_tok_s": round(n * a.new / min(hf_s), 2),
               "engine_out_tok_s": round(n * a.new / min(eng_s), 2),
               "ratio_engine_over_transformers": round(min(hf_s) / min(eng_s), 3),
               "token_mismatches_vs_alone": int(mism)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = {"command": "python bench/engine_vs_transformers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()} {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
                      f"transformers {transformers.__version__}",
           "new_tokens": a.new, "prompt_tokens": [len(p) for p in prompts], "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
