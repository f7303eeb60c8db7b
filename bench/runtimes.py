"""Prefill and batch-1 decode tokens/s of the runtimes a user could pick for the same GGUF, in one run.

Engines (rows are engine x intra-op threads, 1 and 2): `transformers` generate on the GGUF (dequantized
to fp32, the baseline), the torch engine (fp32), ONNX Runtime with fp32 weights (`onnx-fp32`) and with
the GGUF file's own blocks (`onnx-gguf`, MatMulNBits; the device engine's default; `onnx-gguf-q8`, its
MLP blocks, 8-bit blocks and head on int8 activations, only when asked for), and
llama.cpp on the GGUF as stored, through the `llama-bench` binary built by `bench/llamacpp.sh`
(a subprocess per measurement; its own timer, random token ids of the same count). Prefill at 128,
512, 2048 and 8192 tokens; decode (64 greedy steps at batch 1) at contexts 128 and 4096 (the context
is prefilled untimed first). Prompts are real text (concatenated `chitchat-dataset` conversations)
cut to exactly N tokens. Every repetition runs all engines back to back per measurement, so the
goal ratios are paired within one run; figures are medians over repetitions.

Beside each decode figure: bytes read per decoded token (weights + the KV cache at that context) and
the memory-bandwidth bound, those bytes / numpy-measured read bandwidth (a 1 GiB buffer).

    bench/llamacpp.sh                               # llama.cpp rows (skipped with a note if not built)
    .venv/bin/python bench/runtimes.py              # full run (~30+ min on 2 busy cores)
    .venv/bin/python bench/runtimes.py --quick      # smoke check, writes under /tmp
    .venv/bin/python bench/runtimes.py --engines torch,onnx-gguf:1,llama.cpp
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from machine import cpu_isa, cpu_name  # bench/machine.py, beside this script

ROOT = Path(__file__).resolve().parent
FAMILIES = ("transformers", "torch", "onnx-fp32", "onnx-gguf", "onnx-gguf-q8", "llama.cpp")
ROWS = [(f, t) for f in FAMILIES if f != "onnx-gguf-q8" for t in (1, 2)]  # the default rows
LENGTHS = [128, 512, 2048, 8192]
CONTEXTS = [128, 4096]
LONG = 2048  # prefill lengths and decode contexts from here on get --long-reps repetitions


# --- inputs ----------------------------------------------------------------------------------

def chitchat_ids(tokenizer, n: int) -> list[int]:
    """The first `n` token ids of concatenated chitchat-dataset conversations (one message a line)."""
    dist = importlib.metadata.distribution("chitchat-dataset")
    path = next(dist.locate_file(f) for f in dist.files if str(f).endswith("dataset.json"))
    lines = []
    for conv in json.loads(Path(path).read_text()).values():
        lines += [m["text"] for turn in conv["messages"] for m in turn]
        if len(lines) > n:  # a token per line at least
            ids = tokenizer.encode("\n".join(lines))
            if len(ids) >= n:
                return ids[:n]
    raise RuntimeError(f"chitchat-dataset has fewer than {n} tokens")


def bandwidth_gbs(nbytes: int, threads: int, reps: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): best of `reps` float32 sums over an `nbytes` buffer split
    among `threads` Python threads (numpy releases the GIL). Best-of, so the bound stays an upper one."""
    a = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(a, threads)
    a.sum()  # touch every page first
    best = 0.0
    for _ in range(reps):
        ts = [threading.Thread(target=p.sum) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


# --- engines: each row offers prefill(ids) and decode(ids, steps, budget_s), both in tokens/s --

class Row:
    """One engine at one thread count. `weights`: what it computes with; `bytes_per_token`: weight
    bytes read per decode step; `kv_bytes_per_token`: KV cache bytes per context token (read once per
    decode step); `decode_method`: how decode seconds are obtained."""

    decode_method = "prefill untimed, then `steps` timed decode calls (fewer past the time budget), each fed the argmax token"

    def __init__(self, family: str, threads: int, weights: str, bytes_per_token: int, kv_bytes_per_token: int):
        self.family, self.threads, self.weights, self.bytes_per_token = family, threads, weights, bytes_per_token
        self.kv_bytes_per_token = kv_bytes_per_token
        self.name = f"{family}:{threads}"

    def prepare(self):
        """Called before every timed call (sets torch's global intra-op threads)."""

    def prefill(self, ids: list[int]) -> float:
        """Prefill tokens/s: len(ids) over the wall seconds of a prefill on an empty cache (to the last
        position's logits)."""
        self.prepare()
        t0 = time.perf_counter()
        self._prefill(ids)
        return len(ids) / (time.perf_counter() - t0)

    def decode(self, ids: list[int], steps: int, budget_s: float) -> float:
        """Decode tokens/s: greedy batch-1 steps after prefilling `ids` (the context), `steps` of them
        or as many as fit in `budget_s` wall seconds (so a row starved by other jobs cannot stall the run)."""
        self.prepare()
        logits, kv = self._prefill(ids)
        t0 = time.perf_counter()
        for i in range(steps):
            logits, kv = self._decode(int(np.argmax(logits)), kv)
            if time.perf_counter() - t0 > budget_s:
                break
        return (i + 1) / (time.perf_counter() - t0)

    def close(self):
        """Free what the row holds."""


class EngineRow(Row):
    """The torch engine or the ONNX engine (`prefill(ids, kv)` / `decode(token, kv)`)."""

    def __init__(self, family, threads, weights, bytes_per_token, kv_bytes_per_token, engine):
        super().__init__(family, threads, weights, bytes_per_token, kv_bytes_per_token)
        self.engine = engine
        self._prefill, self._decode = engine.prefill, engine.decode

    def prepare(self):
        if self.family == "torch":
            import torch
            torch.set_num_threads(self.threads)


class TransformersRow(Row):
    """`model.generate` (greedy, min_new_tokens = max_new_tokens so EOS cannot end it early)."""

    decode_method = ("(generated - 1) tokens over [time of generate(max_new_tokens=1+steps, max_time=budget) minus "
                     "time of generate(max_new_tokens=1)] on the same prompt, back to back; "
                     "prefill = generate(max_new_tokens=1)")

    def __init__(self, threads, bytes_per_token, kv_bytes_per_token, model, eos_id):
        super().__init__("transformers", threads, "fp32 (GGUF dequantized by transformers)", bytes_per_token,
                         kv_bytes_per_token)
        self.model, self.eos_id = model, eos_id

    def prepare(self):
        import torch
        torch.set_num_threads(self.threads)

    def _generate(self, ids, n, max_time=None) -> int:
        import torch
        x = torch.tensor([ids])
        y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=self.eos_id, eos_token_id=self.eos_id,
                                max_time=max_time)
        return y.shape[1] - x.shape[1]

    def _prefill(self, ids):
        self._generate(ids, 1)

    def decode(self, ids, steps, budget_s):
        self.prepare()
        t0 = time.perf_counter()
        self._generate(ids, 1)
        t1 = time.perf_counter()
        n = self._generate(ids, 1 + steps, max_time=budget_s + (t1 - t0))
        return (n - 1) / ((time.perf_counter() - t1) - (t1 - t0))


class LlamaBenchRow(Row):
    """llama.cpp through its `llama-bench` binary (one subprocess per measurement, `-r 1`, its own
    timer; n_batch 2048 / n_ubatch 512, its defaults; F16 KV cache). Prefill: `-p N -n 0`; decode at
    context C: `-p 0 -n steps -d C` (the C-token depth is prefilled untimed). llama-bench feeds random
    token ids, so only the token count matches the other rows' prompts."""

    decode_method = "llama-bench -p 0 -n <steps> -d <context> -r 1 (depth prefilled untimed), its avg_ts"

    def __init__(self, threads, bytes_per_token, kv_bytes_per_token, weights, model_path, bench_bin, timeout_s):
        super().__init__("llama.cpp", threads, weights, bytes_per_token, kv_bytes_per_token)
        self.model_path, self.bin, self.timeout_s = model_path, bench_bin, timeout_s

    def _run(self, p: int, n: int, d: int) -> float:
        argv = [str(self.bin), "-m", str(self.model_path), "-p", str(p), "-n", str(n), "-d", str(d),
                "-t", str(self.threads), "-r", "1", "-o", "json"]
        if p >= 2048 or d >= 2048:
            argv.append("--no-warmup")  # a warm-up run would double the long measurements
        r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr[-500:]}")
        return float(json.loads(r.stdout)[0]["avg_ts"])

    def prefill(self, ids):
        return self._run(len(ids), 0, 0)

    def decode(self, ids, steps, budget_s):
        return self._run(0, steps, len(ids))


def onnx_weight_bytes(onnx_file: Path) -> int:
    """Bytes of an ONNX graph's initializers read per decode step: all of them except tables only
    consumed by Gather (an embedding: one row is read per token)."""
    import onnx
    g = onnx.load(str(onnx_file), load_external_data=False).graph
    gather_only = {i for n in g.node if n.op_type in ("Gather", "GatherBlockQuantized") for i in n.input[:1]}
    gather_only -= {i for n in g.node if n.op_type not in ("Gather", "GatherBlockQuantized") for i in n.input}
    return sum(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
               for t in g.initializer if t.name not in gather_only)


# The engine constructors of each variant, in one place: the ONNX export and the torch model are
# differ between variants; only these functions know their APIs.

def make_torch(model_path, threads, shared):
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    eng = TorchEngine(model_path, device="cpu", threads=threads, model=shared.get("torch"))
    shared["torch"] = eng.model
    return eng


def make_onnx(model_path, weights: str, threads: int, log):
    """The device engine with `weights` 'fp32', 'gguf' or 'gguf-q8' (MatMulNBits over the GGUF blocks); returns
    (engine, its ONNX file)."""
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine
    eng = OnnxEngine(ensure_device_model(model_path, quantize=weights, progress=log), quantize=weights,
                     threads=threads)
    return eng, eng.onnx_file


def make_transformers(model_path):
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32).eval()


def llama_bench_binary(isa: str = "avx2") -> Path | None:
    """llama-bench of `bench/llamacpp.sh`'s `isa` build (avx2: build/llamacpp/bin, avx512:
    build/llamacpp-avx512/bin) when it was built, else None."""
    r = subprocess.run([str(ROOT / "llamacpp.sh"), "--print"], capture_output=True, text=True,
                       env={**os.environ, "LLAMACPP_ISA": isa})
    if r.returncode != 0:
        return None
    b = Path(r.stdout.strip().splitlines()[-1]) / "llama-bench"
    return b if b.is_file() else None


def build_rows(wanted, model_path, log, llama_isa: str = "avx2") -> tuple[list[Row], dict]:
    """Load the asked engines (rows); returns (rows, {family: note}) for engines that could not load
    (plus '_model': facts about the GGUF)."""
    from relayinfer.protocol.model.model_file import open_gguf, read_config
    rows, notes, shared = [], {}, {}
    reader = open_gguf(model_path)
    cfg = read_config(reader)
    n_params = sum(int(t.n_elements) for t in reader.tensors)  # tied: embedding stored once
    gguf_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    gguf_types = sorted({t.tensor_type.name for t in reader.tensors})
    fp32_bytes = 4 * n_params
    kv32 = cfg.kv_bytes_per_token  # fp32 K+V of all layers per token
    for family, threads in wanted:
        if family in notes:
            continue
        log(f"loading {family}:{threads}")
        try:
            if family == "transformers":
                if "hf" not in shared:
                    shared["hf"] = make_transformers(model_path)
                rows.append(TransformersRow(threads, fp32_bytes, kv32, shared["hf"], cfg.eos_id))
            elif family == "torch":
                rows.append(EngineRow(family, threads, "fp32", fp32_bytes, kv32, make_torch(model_path, threads, shared)))
            elif family in ("onnx-fp32", "onnx-gguf", "onnx-gguf-q8"):
                w = family.split("-", 1)[1]
                eng, f = make_onnx(model_path, w, threads, log)
                nbytes = fp32_bytes if w == "fp32" else onnx_weight_bytes(f)
                desc = "fp32" if w == "fp32" else (f"GGUF blocks ({'/'.join(gguf_types)}) as MatMulNBits, "
                                                   + ("the MLP's, the 8-bit ones and the head on int8 activations (level 4)"
                                                      if w == "gguf-q8" else "fp32 activations"))
                rows.append(EngineRow(family, threads, desc, nbytes, kv32, eng))
            elif family == "llama.cpp":
                b = llama_bench_binary(llama_isa)
                if b is None:
                    notes[family] = f"not built (run LLAMACPP_ISA={llama_isa} bench/llamacpp.sh)"
                    log(f"llama.cpp: {notes[family]}")
                    continue
                src = ROOT.parent / "build" / "llamacpp" / "SOURCE"
                ver = src.read_text().strip() if src.is_file() else "vendored source"
                rows.append(LlamaBenchRow(threads, gguf_bytes, kv32 // 2, f"GGUF as stored ({'/'.join(gguf_types)}), "
                                          f"llama-bench from {ver} ({llama_isa} build), F16 KV", model_path, b, timeout_s=1200))
            else:
                raise SystemExit(f"unknown engine {family!r}; choose from {', '.join(FAMILIES)}")
        except (ImportError, ValueError, RuntimeError, OSError) as e:
            notes[family] = f"could not load: {type(e).__name__}: {str(e)[:200]}"
            log(f"{family}: {notes[family]}")
    model = {"path": str(model_path), "gguf_types": gguf_types, "parameters": n_params,
             "fp32_bytes": fp32_bytes, "gguf_tensor_bytes": gguf_bytes, "kv_fp32_bytes_per_token": kv32}
    return rows, notes | {"_model": model}


# --- reporting -------------------------------------------------------------------------------

def paired_ratio(res, a, b, key) -> float | None:
    """Median over repetitions of a/b tokens/s for one metric (`key`: 'p<N>' prefill or 'd<C>' decode)."""
    if a not in res or b not in res:
        return None
    r = [x / y for x, y in zip(res[a]["samples"].get(key, []), res[b]["samples"].get(key, []))
         if x is not None and y is not None]
    return statistics.median(r) if r else None


def goals(res, serve: dict | None) -> list[dict]:
    """The issue's goals as paired ratios (median over repetitions) with met/missed per thread count."""
    spec = [("ONNX GGUF-blocks decode >= 1.0x llama.cpp (aim 1.3x)", "onnx-gguf", "llama.cpp", 1.0, ["d128", "d4096"]),
            ("ONNX GGUF-blocks prefill >= 2x llama.cpp at 512", "onnx-gguf", "llama.cpp", 2.0, ["p512"]),
            ("ONNX gguf-q8 decode >= 1.0x llama.cpp (aim 1.3x)", "onnx-gguf-q8", "llama.cpp", 1.0, ["d128", "d4096"]),
            ("ONNX fp32 prefill >= 1.0x torch at 2048", "onnx-fp32", "torch", 1.0, ["p2048"]),
            ("torch decode >= 1.0x transformers at context 128", "torch", "transformers", 1.0, ["d128"]),
            ("torch decode >= 1.5x transformers at context 4096", "torch", "transformers", 1.5, ["d4096"])]
    out = []
    for goal, a, b, target, metrics in spec:
        for t in (1, 2):
            g = {"goal": goal, "a": f"{a}:{t}", "b": f"{b}:{t}", "target": target,
                 "ratios": {m: paired_ratio(res, f"{a}:{t}", f"{b}:{t}", m) for m in metrics}}
            vals = [v for v in g["ratios"].values() if v is not None]
            g["status"] = ("met" if min(vals) >= target else "missed") if vals else "not measured"
            if f"{a}:{t}" in res and f"{b}:{t}" in res:  # both engines of the goal in this run
                out.append(g)
    if serve and serve.get("goal"):
        sg = serve["goal"]
        out.append({"goal": "cloud engine >= 1.0x llama-server on F32 at 16 concurrent (bench/serve_compare.py)",
                    "a": "relayinfer", "b": "llama-f32", "target": 1.0, "ratios": {"N=16": sg["ratio"]},
                    "status": sg["status"], "source": f"bench/results/serve_compare.json ({serve.get('date')})"})
    return out


def fmt(x, nd=1):
    return "–" if x is None else f"{x:.{nd}f}"


def write_markdown(path: Path, report: dict) -> None:
    """The table and the goal ratios; keeps a hand-written `## Notes` section if present."""
    st = report["settings"]
    lengths, contexts = st["lengths"], st["contexts"]
    old = path.read_text() if path.is_file() else ""
    notes = old[old.index("## Notes"):] if "## Notes" in old else "## Notes\n\n(to be written)\n"
    bw = report["bandwidth_gbs"]
    lines = [f"# Runtime benchmark: {Path(report['model']['path']).name}", "",
             f"Command: `{report['command']}` ({report['date']}, {report['machine']['cpu']}, "
             f"{report['machine']['cores']} cores shared with other jobs, load avg before "
             f"{report['machine']['loadavg_before']}, wall {report['wall_s']:.0f} s).", "",
             f"Tokens/s, median of {st['reps']} interleaved repetitions ({st['long_reps']} for prefill/context "
             f">= {LONG} tokens, measured at {st['long_threads']} thread(s) only); prompts are chitchat-dataset text cut to exactly N tokens (llama.cpp: llama-bench, "
             f"random ids of the same count); decode = {st['decode_steps']} greedy steps at batch 1 after a "
             f"C-token context (fewer if past {st['decode_budget_s']:.0f} s). MB/token = weights + KV cache at the "
             f"context read per decoded token; bound = those bytes / numpy read bandwidth (1 GiB buffer, best over "
             "repetitions: " + ", ".join(f"{v:.1f} GB/s at {t} thread(s)" for t, v in bw.items()) + ").", "",
             "| engine | threads | " + " | ".join(f"prefill {n}" for n in lengths) + " | "
             + " | ".join(f"decode @{c} | MB/token @{c} | % of bound @{c}" for c in contexts) + " |",
             "|---|---|" + "---|" * len(lengths) + "---|---|---|" * len(contexts)]
    for r in report["engines"]:
        cells = [fmt(r["prefill_tok_s"].get(str(n))) for n in lengths]
        for c in contexts:
            d = r["decode"][str(c)]
            cells += [fmt(d["tok_s"]), f"{d['bytes_per_token'] / 1e6:.0f}",
                      "–" if d["share_of_bound"] is None else f"{100 * d['share_of_bound']:.0f} %"]
        lines.append(f"| {r['family']} | {r['threads']} | " + " | ".join(cells) + " |")
    for fam, note in report["not_run"].items():
        lines.append(f"| {fam} | – | {note} |" + " |" * (len(lengths) + 3 * len(contexts) - 1))
    lines += ["", "Goals (paired ratios a/b of tokens/s, median over repetitions):", "",
              "| goal | a / b | ratio | status |", "|---|---|---|---|"]
    for g in report["goals"]:
        rs = ", ".join(f"{m}: {fmt(v, 2)}" for m, v in g["ratios"].items())
        lines.append(f"| {g['goal']} | {g['a']} / {g['b']} | {rs} | **{g['status']}** (target {g['target']}) |")
    skipped = report.get("skipped")
    if skipped:
        lines += ["", "Not measured (over the wall-time budget or failed): " + "; ".join(skipped)]
    path.write_text("\n".join(lines) + "\n\n" + notes)


# --- main ------------------------------------------------------------------------------------

def parse_engines(spec: str | None) -> list[tuple[str, int]]:
    """'torch,onnx-gguf:1' -> [(family, threads)]: a bare family means both thread counts."""
    if not spec:
        return list(ROWS)
    out = []
    for e in (x.strip() for x in spec.split(",") if x.strip()):
        fam, _, t = e.partition(":")
        if fam not in FAMILIES:
            raise SystemExit(f"unknown engine {fam!r}; choose from {', '.join(FAMILIES)}")
        try:
            ts = [int(t)] if t else [1, 2]
        except ValueError:
            raise SystemExit(f"bad thread count in {e!r}") from None
        out += [(fam, n) for n in ts if (fam, n) not in out]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="prefill 128/512, decode at 128, 1 repetition, 16 steps")
    ap.add_argument("--out", type=Path, help="JSON path; the .md goes beside it "
                    "(default bench/results/runtimes.json, or under /tmp with --quick)")
    ap.add_argument("--engines", help="comma list of families or family:threads, e.g. torch,onnx-gguf:1,llama.cpp "
                    f"(default all: {','.join(FAMILIES)} at 1 and 2 threads)")
    ap.add_argument("--lengths", help=f"prefill lengths (default {','.join(map(str, LENGTHS))})")
    ap.add_argument("--contexts", help=f"decode contexts (default {','.join(map(str, CONTEXTS))})")
    ap.add_argument("--reps", type=int, default=2, help="repetitions (default 2, 1 with --quick)")
    ap.add_argument("--long-reps", type=int, default=1, help=f"repetitions of prefill lengths and decode contexts "
                    f">= {LONG} (at most --reps; default 1)")
    ap.add_argument("--long-threads", default="1,2", help=f"thread counts measured at prefill lengths and decode "
                    f"contexts >= {LONG} (default 1,2; rows at other counts skip them)")
    ap.add_argument("--decode-budget", type=float, default=5.0, help="wall seconds per decode measurement")
    ap.add_argument("--max-wall-s", type=float, default=3600.0, help="no new measurement after this (s)")
    ap.add_argument("--model", help="GGUF file or installed model name, e.g. gemma3-270m (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--llama-isa", default="avx2", choices=("avx2", "avx512"),
                    help="which bench/llamacpp.sh build is the anchor (avx512: LLAMACPP_ISA=avx512, for hosts with AVX512)")
    args = ap.parse_args(argv)
    try:
        lengths = [128, 512] if args.quick else [int(x) for x in (args.lengths or ",".join(map(str, LENGTHS))).split(",")]
        contexts = [128] if args.quick else [int(x) for x in (args.contexts or ",".join(map(str, CONTEXTS))).split(",")]
    except ValueError as e:
        print(f"runtimes: bad --lengths/--contexts: {e}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.long_reps < 1 or min(lengths + contexts) < 1:
        print("runtimes: --reps, --long-reps, lengths and contexts must be positive", file=sys.stderr)
        return 2
    reps = 1 if args.quick else args.reps
    steps, budget = (16 if args.quick else 64), args.decode_budget
    out = args.out or (Path(tempfile.gettempdir()) / "relayinfer-runtimes-quick.json" if args.quick
                       else ROOT / "results" / "runtimes.json")
    wanted = parse_engines(args.engines)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    loadavg = os.getloadavg()

    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.protocol.model.tokenizer import Tokenizer
    model_path = resolve_model_path(args.model)
    tok = Tokenizer.from_gguf(model_path)
    prompt = chitchat_ids(tok, max(lengths + contexts))
    rows, notes = build_rows(wanted, model_path, log, args.llama_isa)
    model_info = notes.pop("_model")
    threads = sorted({r.threads for r in rows} | {1})

    log("warm-up")
    for r in rows:
        if not isinstance(r, LlamaBenchRow):
            r.prefill(prompt[:32])
            r.decode(prompt[:32], 2, budget)
    keys = sorted([f"p{n}" for n in lengths] + [f"d{c}" for c in contexts], key=lambda k: (int(k[1:]), k))
    long_threads = {int(x) for x in args.long_threads.split(",") if x.strip()}  # smallest first: a budget cut drops the largest
    samples = {r.name: {k: [] for k in keys} for r in rows}
    errors: dict[str, str] = {}
    skipped: list[str] = []
    bw = {str(t): 0.0 for t in threads}

    def measure(r: Row, key: str) -> float | None:
        n = int(key[1:])
        try:
            v = r.prefill(prompt[:n]) if key[0] == "p" else r.decode(prompt[:n], steps, budget)
        except (MemoryError, RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            errors[f"{r.name} {key}"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"{r.name} {key} failed: {errors[f'{r.name} {key}']}")
            v = None
        gc.collect()
        return v

    for rep in range(reps):
        bw = {str(t): max(bw[str(t)], bandwidth_gbs(1 << 30, t)) for t in threads}
        log(f"rep {rep + 1}/{reps} bandwidth GB/s: " + ", ".join(f"{t} threads {v:.1f}" for t, v in bw.items()))
        for key in keys:
            if int(key[1:]) >= LONG and rep >= args.long_reps:
                continue
            order = rows[rep % len(rows):] + rows[:rep % len(rows)]  # back to back, order rotated per rep
            for r in order[::-1] if rep % 2 else order:
                if int(key[1:]) >= LONG and r.threads not in long_threads:
                    continue
                if time.perf_counter() - t_start > args.max_wall_s:
                    skipped.append(f"{r.name} {key} rep {rep + 1} (past --max-wall-s {args.max_wall_s:.0f})")
                    continue
                samples[r.name][key].append(measure(r, key))
            log(f"rep {rep + 1}/{reps} {key}: " + ", ".join(f"{r.name} {fmt(samples[r.name][key][-1])}" for r in rows
                                                             if samples[r.name][key]))

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    res = {}
    for r in rows:
        s = samples[r.name]
        dec = {}
        for c in contexts:
            nbytes = r.bytes_per_token + r.kv_bytes_per_token * c
            bound = bw[str(r.threads)] * 1e9 / nbytes
            v = med(s[f"d{c}"])
            dec[str(c)] = {"tok_s": v, "bytes_per_token": nbytes, "bound_tok_s": bound,
                           "share_of_bound": None if v is None else v / bound}
        res[r.name] = {"family": r.family, "threads": r.threads, "weights": r.weights,
                       "weight_bytes_per_token": r.bytes_per_token, "kv_bytes_per_context_token": r.kv_bytes_per_token,
                       "prefill_tok_s": {str(n): med(s[f"p{n}"]) for n in lengths}, "decode": dec,
                       "decode_method": r.decode_method, "samples": s}
    for r in rows:
        r.close()
    rows.clear()
    gc.collect()
    serve_json = ROOT / "results" / "serve_compare.json"
    serve = json.loads(serve_json.read_text()) if serve_json.is_file() and not args.quick else None
    if serve and Path(serve.get("model", {}).get("q4_1", "")).name != Path(model_path).name:
        serve = None  # that serving comparison ran another model

    report = {
        "command": " ".join([".venv/bin/python", "bench/runtimes.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": cpu_name() or platform.machine(), "isa": cpu_isa(), "cores": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in loadavg], "python": platform.python_version(),
                    "versions": {p: _version(p) for p in ("torch", "onnxruntime", "transformers", "numpy")}},
        "model": model_info,
        "settings": {"lengths": lengths, "contexts": contexts, "long_threads": sorted(long_threads), "reps": reps, "long_reps": min(reps, args.long_reps),
                     "decode_steps": steps, "decode_budget_s": budget,
                     "prompt_source": "chitchat-dataset messages joined by newlines, Tokenizer.from_gguf",
                     "units": "tokens/s (samples too, one per repetition, null = failed); bandwidth in GB/s (1e9 B/s)"},
        "bandwidth_gbs": bw,
        "engines": list(res.values()),
        "not_run": notes,
        "errors": errors,
        "skipped": skipped,
        "goals": goals(res, serve),
        "wall_s": time.perf_counter() - t_start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), report)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    print(out.with_suffix(".md").read_text().split("## Notes")[0])
    return 0


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
