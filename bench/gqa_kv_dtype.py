"""Whether the device graph's attention would gain from a float16 KV cache: ONNX Runtime's CPU
`com.microsoft.GroupQueryAttention` (the op the device graph runs per layer) in float32 against
float16 (its query, new keys/values and cache all in that type: the op takes one type T), for one
decode token over L cached keys, at SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64),
the cache a shared buffer bound in place as the device runtime binds it.

Figure: ms per call (one layer), the fastest of `--reps` rounds of 50 calls, 1 thread.

    .venv/bin/python bench/gqa_kv_dtype.py [--lengths 128,1024,4096] [--reps 3] [--out bench/results/gqa_kv_dtype.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from machine import describe  # bench/machine.py, beside this script

H, KVH, HD = 9, 3, 64


def session(dtype, capacity: int):
    """A one-thread CPU session of one GroupQueryAttention node in `dtype` (float32 / float16)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    t = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    cache = [1, KVH, capacity, HD]
    vi = helper.make_tensor_value_info
    ins = [vi("q", t, [1, 1, H * HD]), vi("k", t, [1, 1, KVH * HD]), vi("v", t, [1, 1, KVH * HD]), vi("pk", t, cache),
           vi("pv", t, cache), vi("seqlens_k", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])]
    outs = [vi("o", t, [1, 1, H * HD]), vi("ok", t, cache), vi("ov", t, cache)]
    node = helper.make_node("GroupQueryAttention", [i.name for i in ins], [o.name for o in outs], domain="com.microsoft",
                            num_heads=H, kv_num_heads=KVH)
    model = helper.make_model(helper.make_graph([node], "gqa", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def time_call(dtype, length: int, reps: int) -> float:
    """ms per decode-token call over `length` cached keys (cache capacity length + 128)."""
    import onnxruntime as ort

    cap, rng = length + 128, np.random.default_rng(0)
    s = session(dtype, cap)
    io = s.io_binding()
    for name, shape in (("q", (1, 1, H * HD)), ("k", (1, 1, KVH * HD)), ("v", (1, 1, KVH * HD))):
        io.bind_cpu_input(name, rng.standard_normal(shape).astype(dtype))
    io.bind_cpu_input("seqlens_k", np.array([length], np.int32))
    io.bind_cpu_input("total", np.array(length + 1, np.int32))
    for past, present in (("pk", "ok"), ("pv", "ov")):
        buf = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, KVH, cap, HD)).astype(dtype))
        io.bind_ortvalue_input(past, buf)
        io.bind_ortvalue_output(present, buf)  # in place: past_present_share_buffer
    io.bind_output("o")
    best = float("inf")
    for _ in range(reps):
        s.run_with_iobinding(io)
        t0 = time.perf_counter()
        for _ in range(50):
            s.run_with_iobinding(io)
        best = min(best, (time.perf_counter() - t0) / 50 * 1e3)
    return best


def main(argv=None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/gqa_kv_dtype.json")
    a = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        f32, f16 = time_call(np.float32, n, a.reps), time_call(np.float16, n, a.reps)
        rows.append({"keys": n, "float32_ms": round(f32, 4), "float16_ms": round(f16, 4), "float16_over_float32": round(f16 / f32, 3)})
    doc = {"command": " ".join(["python bench/gqa_kv_dtype.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": describe(), "onnxruntime": ort.__version__, "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    md = [f"# GroupQueryAttention on the CPU: float32 against float16 KV (ms per layer call, 1 thread, ORT {ort.__version__})",
          "", f"`{doc['command']}`; {doc['machine']}.", "", "| cached keys | float32 | float16 | float16 / float32 |",
          "|---|---|---|---|"]
    md += [f"| {r['keys']} | {r['float32_ms']:.3f} | {r['float16_ms']:.3f} | {r['float16_over_float32']:.2f}x |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
