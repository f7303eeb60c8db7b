"""transformers' batched `generate` on the cloud-engine benchmark's workload (the baseline a user
would reach for), against our LLMEngine on the same 16 prompts, in one run.

Same prompts as bench/cloud_engine.py (chitchat, lengths mixed 32/64/96/128, seed 0), greedy,
96 new tokens with EOS ignored (min_new_tokens = max_new_tokens), 1 thread, all 16 at once
(static batch, left padding). Output tokens/s = 16 * 96 / wall s.

    .venv/bin/python bench/transformers_batched.py   # -> bench/results/transformers_batched.json
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.torch_engine import TorchEngine
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.sdk.datasets import chitchat_prompts_by_length

REQUESTS, NEW, LENGTHS, SEED = 16, 96, [32, 64, 96, 128], 0


def main() -> None:
    import transformers

    torch.set_num_threads(1)
    te = TorchEngine(device="cpu", threads=1)
    tok = Tokenizer.from_gguf(te.model_path)
    pool = chitchat_prompts_by_length(tok, LENGTHS, per_length=math.ceil(REQUESTS / len(LENGTHS)), seed=SEED)
    prompts = [pool[i] for i in np.random.default_rng(SEED).permutation(len(pool))[:REQUESTS]]
    path = Path(te.model_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = te.eos_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False, pad_token_id=pad)
        t = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=pad)
        hf_s = time.perf_counter() - t
    engine = LLMEngine(te, kv_cache_bytes=512 << 20)
    engine.generate([prompts[0][:16]], SamplingParams(max_new_tokens=2))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW), ignore_eos=True)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    ours_s = time.perf_counter() - t
    out = {"requests": REQUESTS, "new_tokens": NEW, "prompt_tokens": [len(p) for p in prompts], "threads": 1,
           "transformers_batched_s": hf_s, "transformers_out_tok_s": REQUESTS * NEW / hf_s,
           "llm_engine_s": ours_s, "llm_engine_out_tok_s": REQUESTS * NEW / ours_s,
           "ratio_llm_engine_over_transformers": hf_s / ours_s, "transformers": transformers.__version__}
    Path("bench/results/transformers_batched.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
