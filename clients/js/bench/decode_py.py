"""The Python device's decode tok/s on the same model and prompt (OnnxEngine, 1 thread), for bench/decode.ts.
   .venv/bin/python clients/js/bench/decode_py.py MODEL_DIR [tokens] [reps]"""
import json
import sys
import time

import numpy as np

from relayinfer.device.onnx_engine import OnnxEngine

d, n, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128, int(sys.argv[3]) if len(sys.argv) > 3 else 3
eng = OnnxEngine(d, threads=1)
ids = eng.tokenizer().encode_chat("Tell me a short story about a robot who learns to paint.")
rates = []
for _ in range(reps):
    logits, kv = eng.prefill(ids)
    t0 = time.perf_counter()
    for _ in range(n):
        logits, kv = eng.decode(int(np.argmax(logits)), kv)
    rates.append(n / (time.perf_counter() - t0))
rates.sort()
print(json.dumps({"runtime": "onnxruntime (python)", "tokens": n, "reps": reps, "prompt_tokens": len(ids),
                  "tok_s_median": rates[reps // 2], "tok_s": rates}))
