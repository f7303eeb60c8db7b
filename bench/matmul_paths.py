"""Which matmul path could run the cloud engine's linear layers faster than fp32: the model's 30 blocks'
matrices (Q/K/V/O, gate, up, down; 210 matmuls, the file's Q4_1 blocks), one pass = every matrix
once, so the weights come from DRAM as in a decode step, at M = 1..64 rows (the step's tokens).

Paths, each over the same GGUF tensors:

* ``torch-fp32``: `F.linear` on the dequantized weights (what the engine runs; 412 MB per pass);
* ``torch-int4``: torch's weight-only int4 kernel (`aten._weight_int4pack_mm_for_cpu`, group 32) on
  the file's own Q4_1 blocks: Q4_1's `w = d q + m` is the kernel's `(q - 8) scale + zero` with
  scale d and zero m + 8 d (`cloud.ggml_blocks`), exact in the algebra (checked: max abs error
  against the fp32 product printed);
* ``torch-int4-bf16``: the same kernel on bf16 activations and bf16 scales (its fast path, AVX512-BF16
  / AMX where the CPU has them): what the engine's `weights='gguf'` runs (`llama.BlockLinear`);
* ``torch-bf16``: `F.linear` on bf16 copies (not the file's numbers; rounding of 8 bits of mantissa);
* ``ort-nbits-L0`` / ``ort-nbits-L4``: ONNX Runtime's `MatMulNBits` (the device graph's kernel) on the
  same blocks at accuracy level 0 (fp32 activations) and 4 (int8 activations), one session holding
  all 210 nodes, timed without Q4_1's offset term (the device graph adds it as a [M, K/32] x [K/32, N]
  matmul per node);
* ``ort-L0-per-linear``: what an engine would call per linear layer: one session per matrix at level
  0 with Q4_1's offset term in the graph (ReduceSum of x's blocks, MatMul with the offsets, Add),
  210 `run` calls per pass (their Python and session overhead included).

One thread everywhere; each figure the fastest of `--reps` passes (the machine is shared: compare
within one run).

    .venv/bin/python bench/matmul_paths.py [--rows 1,4,16,64] [--reps 5] [--out bench/results/matmul_paths.json]
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
import torch
import torch.nn.functional as F

from machine import describe  # bench/machine.py, beside this script
from relayinfer.cloud.ggml_blocks import decompose
from relayinfer.protocol.model.model_file import default_model_path

MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def load_blocks(model_path):
    """[(Blocks, dense float32 [N, K])] of every block matrix of the file, in layer order."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(model_path)).tensors}
    out = []
    for i in range(10_000):
        if f"blk.{i}.attn_q.weight" not in tensors:
            break
        for m in MATS:
            t = tensors[f"blk.{i}.{m}.weight"]
            raw, k = np.asarray(t.data), int(t.shape[0])
            b = decompose(raw, t.tensor_type.name, k)
            if b is None or b.bits != 4 or b.offset is None:
                raise SystemExit(f"{t.name} is {t.tensor_type.name}: this benchmark reads Q4_1 blocks")
            out.append((b, gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32)))
    return out


def _session(graph):
    """A one-thread CPU ONNX Runtime session of `graph` (opset 17 + com.microsoft)."""
    import onnxruntime as ort
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_session(mats, level: int):
    from onnx import TensorProto, helper, numpy_helper

    ks = sorted({d.shape[1] for _, d in mats})
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in ks]
    nodes, inits, outputs = [], [], []
    for j, (b, d) in enumerate(mats):
        n, k = d.shape
        inits += [numpy_helper.from_array(b.packed(), f"b{j}"), numpy_helper.from_array(b.scale.reshape(-1), f"s{j}")]
        nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"b{j}", f"s{j}"], [f"y{j}"], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=32, accuracy_level=level))
        outputs.append(helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, ["M", n]))
    g = helper.make_graph(nodes, "matmuls", inputs, outputs, inits)
    return _session(g), ks


def per_linear_session(b, d):
    """One ORT session y [M, N] = x [M, K] w.T over Q4_1 blocks `b` (offset term included)."""
    from onnx import TensorProto, helper, numpy_helper

    n, k = d.shape
    inits = [numpy_helper.from_array(b.packed(), "B"), numpy_helper.from_array(b.scale.reshape(-1), "S"),
             numpy_helper.from_array(np.ascontiguousarray(b.offset.T), "O"),
             numpy_helper.from_array(np.array([-1, k // b.block, b.block], np.int64), "shape"),
             numpy_helper.from_array(np.array([2], np.int64), "axis")]
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S"], ["y0"], domain="com.microsoft", K=k, N=n, bits=4,
                              block_size=b.block, accuracy_level=0),
             helper.make_node("Reshape", ["x", "shape"], ["xr"]),
             helper.make_node("ReduceSum", ["xr", "axis"], ["xs"], keepdims=0),
             helper.make_node("MatMul", ["xs", "O"], ["y1"]), helper.make_node("Add", ["y0", "y1"], ["y"])]
    g = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    return _session(g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/matmul_paths.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    mats = load_blocks(a.model or default_model_path())
    dense = [torch.from_numpy(d) for _, d in mats]
    bf16 = [w.bfloat16() for w in dense]
    int4 = []
    for b, d in mats:
        n, k = d.shape
        q = torch.from_numpy(b.q.reshape(n, k).astype(np.int32))
        sz = torch.from_numpy(np.stack([b.scale, b.offset], -1).transpose(1, 0, 2).copy())  # [K/32, N, 2]
        int4.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz, sz.bfloat16()))
    sessions = {lvl: ort_session(mats, lvl) for lvl in (0, 4)}
    linear_sessions = [per_linear_session(b, d) for b, d in mats]
    rows = [int(r) for r in a.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    results, errors = [], {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in sorted({w.shape[1] for w in dense})}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        paths = {
            "torch-fp32": lambda: [F.linear(xs[w.shape[1]], w) for w in dense],
            "torch-int4": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[d.shape[1]], p, 32, sz)
                                   for (p, sz, _), d in zip(int4, dense)],
            "torch-int4-bf16": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb[d.shape[1]], p, 32, szb)
                                        for (p, _, szb), d in zip(int4, dense)],
            "torch-bf16": lambda: [F.linear(xb[w.shape[1]], w) for w in bf16],
        }
        for lvl, (sess, ks) in sessions.items():
            feed = {f"x{k}": xs[k].numpy() for k in ks}
            paths[f"ort-nbits-L{lvl}"] = (lambda s=sess, f=feed: s.run(None, f))
        paths["ort-L0-per-linear"] = lambda: [torch.from_numpy(s.run(None, {"x": xs[w.shape[1]].numpy()})[0])
                                              for s, w in zip(linear_sessions, dense)]
        best = {}
        for _ in range(a.reps):  # interleaved: each rep runs every path once
            for name, f in paths.items():
                t0 = time.perf_counter()
                f()
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) * 1e3)
        if m == rows[0]:  # exactness of the int4 path on the file's blocks (Q4_1 offsets included)
            ref, got = paths["torch-fp32"](), paths["torch-int4"]()
            errors["torch-int4 max abs error vs fp32"] = max(float((r - g).abs().max()) for r, g in zip(ref, got))
            errors["ort-L0-per-linear max abs error vs fp32"] = max(
                float((r - g).abs().max()) for r, g in zip(ref, paths["ort-L0-per-linear"]()))
            errors["fp32 output max abs"] = max(float(r.abs().max()) for r in ref)
        results.append({"rows": m, "ms_per_pass": {k: round(v, 2) for k, v in best.items()}})
        print(m, {k: round(v, 2) for k, v in best.items()}, flush=True)
    wbytes = sum(w.numel() * 4 for w in dense)
    doc = {"command": "python bench/matmul_paths.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
           "cpu_model": describe(),
           "torch": torch.__version__, "onnxruntime": __import__("onnxruntime").__version__,
           "matrices": len(dense), "fp32_weight_mb": round(wbytes / 1e6, 1), "int4_weight_mb": round(wbytes / 8 / 1e6 * 1.25, 1),
           "exactness": errors, "results": results}
    out = Path(a.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    names = list(results[0]["ms_per_pass"])
    md = [f"# Matmul paths for the cloud engine's linear layers ({len(dense)} matrices of the file, one pass each)", "",
          f"Command: `{doc['command']}`; {doc['cpu_model']}, torch {doc['torch']}, onnxruntime {doc['onnxruntime']}, 1 thread; "
          f"fastest of {a.reps} interleaved passes. fp32 weights {doc['fp32_weight_mb']} MB per pass.", "",
          "| rows M | " + " | ".join(f"{n} (ms)" for n in names) + " | best / torch-fp32 |",
          "|---|" + "---|" * (len(names) + 1)]
    for r in results:
        v = r["ms_per_pass"]
        fastest = min(v, key=v.get)
        md.append(f"| {r['rows']} | " + " | ".join(f"{v[n]:.1f}" for n in names)
                  + f" | {fastest} {v['torch-fp32'] / v[fastest]:.2f}x |")
    md += ["", f"On the file's blocks, max abs error against the fp32 product (outputs up to {errors['fp32 output max abs']:.1f}): "
           f"torch-int4 {errors['torch-int4 max abs error vs fp32']:.2e}, ort-L0-per-linear "
           f"{errors['ort-L0-per-linear max abs error vs fp32']:.2e}."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
