"""Device ONNX model formats compared in one run: 1-thread prefill and decode tokens/s,
file sizes and export time.

Variants (rows):
  v1-fp32      the previous export (torch.onnx trace, decomposed attention, KV concatenated each
               step), `model_cache_dir(model)/model.fp32.onnx`, when an old export is present
               (run with the v1 engine logic copied below; skipped otherwise).
  fp32         `cloud/onnx_graph.py`, dequantized fp32 weights, GroupQueryAttention, shared KV buffer.
  gguf         the same graph on the GGUF's own Q4_1/Q8_0 blocks (MatMulNBits, accuracy_level 0).
  gguf-acc4    gguf with MatMulNBits accuracy_level 4 (int8 activations; the Q8_0 head as 8-bit
               MatMulNBits), written to a temporary directory here.

Prompts are token ids of real text (chitchat-dataset) cut to N tokens; decode runs greedy steps
after a prefill of the context length. Each prompt length runs every variant back to back and
repeats `--reps` times (median), so ratios are paired within one run. Pinned to one core.

    .venv/bin/python bench/onnx_export.py                 # writes bench/results/onnx_export.json
    .venv/bin/python bench/onnx_export.py --quick         # 128-token sizes only, under /tmp
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent


class V1Engine:
    """The previous device engine (past/present concatenated by the graph), for comparison only."""

    def __init__(self, onnx_file: Path, n_layers: int, kv_heads: int, head_dim: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        self.session = ort.InferenceSession(str(onnx_file), so, providers=["CPUExecutionProvider"])
        self.names_in = [i.name for i in self.session.get_inputs()]
        self.names_out = [o.name for o in self.session.get_outputs()]
        self.empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, 0, head_dim), np.float32))
        self.n = 2 * n_layers

    def prefill(self, ids, kv=None):
        kv = kv or [self.empty] * self.n
        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", np.asarray([list(ids)], np.int64))
        for name, v in zip(self.names_in[1:], kv):
            b.bind_ortvalue_input(name, v)
        for name in self.names_out:
            b.bind_output(name, "cpu")
        self.session.run_with_iobinding(b)
        outs = b.get_outputs()
        return outs[0].numpy()[0], list(outs[1:])

    def decode(self, tok, kv):
        return self.prefill([tok], kv)


def markdown(res: dict) -> str:
    """A markdown table of a results JSON, with ratios to v1-fp32 and to the fp32 variant."""
    names = list(res["file_bytes"])
    order = [n for n in ("v1-fp32", "fp32", "gguf", "gguf-acc4") if n in res["prefill_tok_s"]["128"] or n in names]
    rows = ["| variant | file MB | " + " | ".join(f"prefill {n} tok/s" for n in res["prefill_tok_s"])
            + " | " + " | ".join(f"decode @{n} tok/s" for n in res["decode_tok_s"]) + " |"]
    rows.append("|" + "---|" * (2 + len(res["prefill_tok_s"]) + len(res["decode_tok_s"])))
    for v in order:
        mb = res["file_bytes"].get(v)
        cells = [f"{res['prefill_tok_s'][n].get(v)}" for n in res["prefill_tok_s"]]
        cells += [f"{res['decode_tok_s'][n].get(v)}" for n in res["decode_tok_s"]]
        rows.append(f"| {v} | {mb / 1e6:.0f} | " if mb else f"| {v} | - | ")
        rows[-1] += " | ".join(cells) + " |"
    return (f"`{res['command']}` (1 thread, pinned; medians of {res['reps']} paired repetitions; "
            "see the JSON for the load caveat)\n\n" + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "results" / "onnx_export.json"))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md of an existing --out JSON")
    args = ap.parse_args(argv)
    if args.markdown_only:
        Path(args.out).with_suffix(".md").write_text(markdown(json.loads(Path(args.out).read_text())))
        return 0
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.cloud.onnx_graph import write_model
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.protocol.model.model_file import default_model_path, model_cache_dir

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    load0 = round(os.getloadavg()[0], 1)  # the machine is shared: ratios within a run only
    path = default_model_path()
    export_s = {}
    for w in ("gguf", "fp32"):
        t = time.perf_counter()
        d = ensure_device_model(path, w)
        export_s[w] = round(time.perf_counter() - t, 1)  # ~0 when already cached
    engines = {"fp32": OnnxEngine(d, "fp32"), "gguf": OnnxEngine(d, "gguf")}
    tmp = Path(tempfile.mkdtemp(prefix="onnx_acc4_"))
    try:
        for f in ("config.json", "tokenizer.json", "tokenizer_meta.json"):
            shutil.copy(d / f, tmp / f)
        write_model(path, tmp / "model.gguf.onnx", "gguf", accuracy_level=4)
        engines["gguf-acc4"] = OnnxEngine(tmp, "gguf")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cfg = engines["fp32"].cfg
    old = model_cache_dir(path) / "model.fp32.onnx"
    sizes = {"fp32": (d / "model.fp32.onnx").stat().st_size, "gguf": (d / "model.gguf.onnx").stat().st_size}
    if old.is_file():
        engines = {"v1-fp32": V1Engine(old, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), **engines}
        sizes["v1-fp32"] = old.stat().st_size
    tok = engines["gguf"].tokenizer()
    lengths = [128] if args.quick else [128, 512, 2048]
    sys.path.insert(0, str(ROOT))
    from runtimes import chitchat_ids  # the prompts of bench/runtimes.py

    ids = chitchat_ids(tok, max(lengths))
    prefill = {n: {k: [] for k in engines} for n in lengths}
    decode = {n: {k: [] for k in engines} for n in lengths if n in (128, 2048)}
    first_tokens = {}
    deadline = time.monotonic() + 3600
    for rep in range(args.reps):
        for n in lengths:
            for name, eng in engines.items():
                if time.monotonic() > deadline:
                    break
                t = time.perf_counter()
                logits, kv = eng.prefill(ids[:n])
                prefill[n][name].append(n / (time.perf_counter() - t))
                if n in decode:
                    tok_id, toks = int(np.argmax(logits)), []
                    t = time.perf_counter()
                    for _ in range(args.decode_steps):
                        logits, kv = eng.decode(tok_id, kv)
                        tok_id = int(np.argmax(logits))
                        toks.append(tok_id)
                    decode[n][name].append(args.decode_steps / (time.perf_counter() - t))
                    first_tokens.setdefault(f"{name}@{n}", toks)
                print(f"rep {rep} n={n} {name}: prefill {prefill[n][name][-1]:.0f} tok/s"
                      + (f", decode {decode[n][name][-1]:.1f} tok/s" if n in decode else ""), flush=True)
    med = lambda xs: round(statistics.median(xs), 1) if xs else None  # noqa: E731
    res = {
        "command": "python bench/onnx_export.py" + (" --quick" if args.quick else "") + f" --reps {args.reps}",
        "threads": 1, "pinned_core": sorted(os.sched_getaffinity(0)),
        "loadavg_1min_start_end": [load0, round(os.getloadavg()[0], 1)],
        "model": path.name, "reps": args.reps, "decode_steps": args.decode_steps,
        "file_bytes": sizes, "export_s": export_s,
        "prefill_tok_s": {n: {k: med(v) for k, v in row.items()} for n, row in prefill.items()},
        "decode_tok_s": {n: {k: med(v) for k, v in row.items()} for n, row in decode.items()},
        "greedy_decode_equal_to_fp32": {k: first_tokens[k] == first_tokens[f"fp32@{k.split('@')[1]}"]
                                        for k in first_tokens},
        "reference_llamacpp_1thread": {"decode_tok_s": 28.5, "prefill_512_tok_s": 82,
                                       "source": "bench/results/runtimes.md (earlier run, not this one)"},
    }
    out = Path("/tmp/onnx_export.json" if args.quick else args.out)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(markdown(res))
    print(json.dumps({k: res[k] for k in ("prefill_tok_s", "decode_tok_s", "file_bytes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
