"""Prefill and batch-1 decode tokens/s of the runtimes a user could pick for the same GGUF, in one run.

Engines (rows are engine x intra-op threads): `transformers` generate on the GGUF (dequantized to
fp32, the baseline), the torch engine (fp32), ONNX Runtime fp32 and int8 (the device engine) and
llama.cpp through `llama-cpp-python` on the GGUF's own quantized weights, when installed (imported
lazily; it is not a dependency). Prompts are real text (concatenated `chitchat-dataset`
conversations) cut to exactly N tokens. Every repetition runs all engines back to back per prompt
length, so the goal ratios are paired within one run; figures are medians over repetitions.

Beside each decode figure: the memory-bandwidth bound of batch-1 decode, weight bytes read per
token / numpy-measured bandwidth (a 1 GiB buffer: DRAM; and a buffer of the weights' own size,
which may sit in the 300 MiB L3 cache for the quantized models).

    .venv/bin/python bench/runtimes.py            # full run (~15 min on 2 cores)
    .venv/bin/python bench/runtimes.py --quick    # smoke check, writes under /tmp
    .venv/bin/python bench/runtimes.py --engines torch,onnx:1,llama.cpp
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
ROWS = [("transformers", 1), ("transformers", 2), ("torch", 1), ("torch", 2), ("onnx", 1), ("onnx", 2),
        ("onnx-int8", 1), ("llama.cpp", 1), ("llama.cpp", 2)]
AGREEMENT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                     "Explain in two sentences why the sky is blue.", "Give me three tips for learning to cook.",
                     "Who wrote Romeo and Juliet, and when?", "How do I reverse a list in Python?"]


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
    bytes read per decode step; `decode_method`: how decode seconds are obtained."""

    decode_method = "prefill untimed, then `steps` timed decode calls (fewer past the time budget), each fed the argmax token"

    def __init__(self, family: str, threads: int, weights: str, bytes_per_token: int):
        self.family, self.threads, self.weights, self.bytes_per_token = family, threads, weights, bytes_per_token
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
        """Decode tokens/s: greedy batch-1 steps after prefilling `ids`, `steps` of them or as many as
        fit in `budget_s` wall seconds (so a row starved by other jobs cannot stall the run)."""
        self.prepare()
        logits, kv = self._prefill(ids)
        t0 = time.perf_counter()
        for i in range(steps):
            logits, kv = self._decode(int(np.argmax(logits)), kv)
            if time.perf_counter() - t0 > budget_s:
                break
        return (i + 1) / (time.perf_counter() - t0)


class EngineRow(Row):
    """The torch engine or the ONNX engine (`prefill(ids, kv)` / `decode(token, kv)`)."""

    def __init__(self, family, threads, weights, bytes_per_token, engine):
        super().__init__(family, threads, weights, bytes_per_token)
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

    def __init__(self, threads, bytes_per_token, model, eos_id):
        super().__init__("transformers", threads, "fp32 (GGUF dequantized by transformers)", bytes_per_token)
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


class LlamaCppRow(Row):
    """llama.cpp (`llama_cpp.Llama`, n_batch 2048, default n_ubatch) on the GGUF's own weights."""

    def __init__(self, threads, bytes_per_token, weights, model_path, n_ctx):
        from llama_cpp import Llama
        super().__init__("llama.cpp", threads, weights, bytes_per_token)
        self.llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=2048, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def _prefill(self, ids):
        self.llm.reset()  # eval() drops cached tokens past n_tokens
        self.llm.eval(ids)
        return self.llm.scores[self.llm.n_tokens - 1], None

    def _decode(self, tok, kv):
        self.llm.eval([tok])
        return self.llm.scores[self.llm.n_tokens - 1], None


def int8_weight_bytes(onnx_file: Path) -> int:
    """Bytes of the int8 graph's initializers read per decode step: all of them except tables only
    consumed by Gather (the fp32 embedding: one row is read per token)."""
    import onnx
    g = onnx.load(str(onnx_file), load_external_data=False).graph
    gather_only = {i for n in g.node if n.op_type == "Gather" for i in n.input[:1]}
    gather_only -= {i for n in g.node if n.op_type != "Gather" for i in n.input}
    return sum(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
               for t in g.initializer if t.name not in gather_only)


def build_rows(wanted, model_path, max_len, log) -> tuple[list[Row], dict]:
    """Load the asked engines (rows); returns (rows, {family: note}) for engines that could not load."""
    from relayinfer.protocol.model_file import open_gguf
    families = {f for f, _ in wanted}
    rows, notes, shared = [], {}, {}
    reader = open_gguf(model_path)
    n_params = sum(int(t.n_elements) for t in reader.tensors)  # tied: embedding stored once
    gguf_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    gguf_types = sorted({t.tensor_type.name for t in reader.tensors})
    fp32_bytes = 4 * n_params
    for family, threads in wanted:
        log(f"loading {family}:{threads}")
        if family == "transformers":
            if "hf" not in shared:
                import torch
                import transformers
                transformers.utils.logging.disable_progress_bar()
                shared["hf"] = transformers.AutoModelForCausalLM.from_pretrained(
                    str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32).eval()
            from relayinfer.protocol.model_file import read_config
            rows.append(TransformersRow(threads, fp32_bytes, shared["hf"], read_config(reader).eos_id))
        elif family == "torch":
            from relayinfer.cloud.engine.torch_engine import TorchEngine
            eng = TorchEngine(model_path, device="cpu", threads=threads, model=shared.get("torch"))
            shared["torch"] = eng.model
            rows.append(EngineRow(family, threads, "fp32", fp32_bytes, eng))
        elif family in ("onnx", "onnx-int8"):
            from relayinfer.cloud.export import ensure_device_model
            from relayinfer.device.onnx_engine import OnnxEngine
            q = "int8" if family == "onnx-int8" else None
            eng = OnnxEngine(ensure_device_model(model_path, quantize=q, progress=log), quantize=q, threads=threads)
            nbytes = int8_weight_bytes(eng.onnx_file) if q else fp32_bytes
            weights = "int8 per-channel MatMul weights (quantize_dynamic), fp32 activations" if q else "fp32"
            rows.append(EngineRow(family, threads, weights, nbytes, eng))
        elif family == "llama.cpp":
            try:
                ver = importlib.metadata.version("llama-cpp-python")
                rows.append(LlamaCppRow(threads, gguf_bytes, f"GGUF as stored ({'/'.join(gguf_types)}), "
                                        f"llama-cpp-python {ver}", model_path, max_len + 128))
            except ImportError as e:
                notes[family] = f"not installed ({e})"
                log(f"llama.cpp: {notes[family]}")
        else:
            raise SystemExit(f"unknown engine {family!r}; choose from {sorted({f for f, _ in ROWS})}")
    model = {"path": str(model_path), "gguf_types": gguf_types, "parameters": n_params,
             "fp32_bytes": fp32_bytes, "gguf_tensor_bytes": gguf_bytes}
    return rows, notes | {"_model": model}


def int8_agreement(tokenizer, prompts, n_tokens: int, threads: int = 1) -> dict:
    """Greedy tokens of ONNX int8 vs ONNX fp32 on chat prompts (EOS ends a sequence): the share of
    positions (over the longer sequence) where both drew the same token, and where they first differ."""
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.protocol.decoding import SamplingParams, generate
    params = SamplingParams(max_new_tokens=n_tokens)
    seqs = {}
    for q in (None, "int8"):
        eng = OnnxEngine(ensure_device_model(None, quantize=q), quantize=q, threads=threads)
        seqs[q] = [generate(eng, tokenizer.encode_chat(p), params).token_ids for p in prompts]
        del eng
    same = total = 0
    first_diff = []
    for a, b in zip(seqs[None], seqs["int8"]):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"prompts": len(prompts), "max_tokens": n_tokens, "position_agreement": same / total,
            "identical_sequences": sum(a == b for a, b in zip(seqs[None], seqs["int8"])),
            "first_divergence": first_diff}


# --- reporting -------------------------------------------------------------------------------

def paired_ratio(res, a, b, key) -> float | None:
    """Median over repetitions of a/b tokens/s for one metric (`key`: 'decode' or a prompt length)."""
    if a not in res or b not in res:
        return None
    r = [x / y for x, y in zip(res[a]["samples"].get(key, []), res[b]["samples"].get(key, []))]
    return statistics.median(r) if r else None


def goals(res, lengths) -> list[dict]:
    """The issue's three goals as paired ratios with pass/miss."""
    metrics = [str(n) for n in lengths] + ["decode"]
    out = [{"goal": "torch engine >= 1.5x transformers, decode tok/s", "a": f"torch:{t}", "b": f"transformers:{t}",
            "target": 1.5, "metrics": ["decode"]} for t in (1, 2)]
    out += [{"goal": "ONNX fp32 >= torch engine at equal threads", "a": f"onnx:{t}", "b": f"torch:{t}",
             "target": 1.0, "metrics": metrics} for t in (1, 2)]
    out += [{"goal": "ONNX int8 (1 thread) >= llama.cpp (1 thread), prefill and decode", "a": "onnx-int8:1",
             "b": "llama.cpp:1", "target": 1.0, "metrics": metrics}]
    for g in out:
        g["ratios"] = {m: paired_ratio(res, g["a"], g["b"], m) for m in g["metrics"]}
        vals = [v for v in g["ratios"].values() if v is not None]
        g["status"] = ("pass" if min(vals) >= g["target"] else "miss") if vals else "not measured"
    return out


def fmt(x, nd=1):
    return "–" if x is None else f"{x:.{nd}f}"


def write_markdown(path: Path, report: dict) -> None:
    """The table, goal ratios and int8 agreement; keeps a hand-written `## Notes` section if present."""
    lengths = report["settings"]["lengths"]
    old = path.read_text() if path.is_file() else ""
    notes = old[old.index("## Notes"):] if "## Notes" in old else "## Notes\n\n(to be written)\n"
    bw = report["bandwidth_gbs"]
    lines = [f"# Runtime benchmark: {Path(report['model']['path']).name}", "",
             f"Command: `{report['command']}` ({report['date']}, {report['machine']['cpu']}, "
             f"{report['machine']['cores']} cores shared with other jobs, load avg before "
             f"{report['machine']['loadavg_before']}, wall {report['wall_s']:.0f} s).", "",
             f"Tokens/s, median of {report['settings']['reps']} interleaved repetitions "
             f"({report['settings'].get('reps_2048', report['settings']['reps'])} at 2048 tokens); prompts are chitchat-dataset "
             f"text cut to exactly N tokens; decode = {report['settings']['decode_steps']} greedy steps at batch 1 "
             f"after a {report['settings']['decode_prompt']}-token prompt (fewer if past "
             f"{report['settings']['decode_budget_s']:.0f} s). Bound = weight bytes per token / "
             f"numpy read bandwidth at the row's threads (best over repetitions; DRAM: 1 GiB buffer, "
             + ", ".join(f"{v:.1f} GB/s at {t} thread(s)" for t, v in bw["dram"].items()) + "; 'same-size': a buffer as large as the weights, "
             f"which may stay in the 300 MiB L3).", "",
             "| engine | threads | weights MB/token | " + " | ".join(f"prefill {n}" for n in lengths)
             + " | decode | bound DRAM | decode / bound DRAM | bound same-size |",
             "|---|---|---|" + "---|" * len(lengths) + "---|---|---|---|"]
    for r in report["engines"]:
        lines.append(f"| {r['family']} | {r['threads']} | {r['bytes_per_token'] / 1e6:.0f} | "
                     + " | ".join(fmt(r["prefill_tok_s"].get(str(n))) for n in lengths)
                     + f" | {fmt(r['decode_tok_s'])} | {fmt(r['bound_dram_tok_s'])} | {100 * r['decode_share_of_dram_bound']:.0f} % "
                     f"| {fmt(r['bound_same_size_tok_s'])} |")
    for fam, note in report["not_run"].items():
        lines.append(f"| {fam} | – | – | " + " | ".join("–" for _ in lengths) + f" | {note} | – | – | – |")
    lines += ["", "Goals (paired ratios a/b of tokens/s, median over repetitions):", "",
              "| goal | a / b | " + " | ".join(f"prefill {n}" for n in lengths) + " | decode | status |",
              "|---|---|" + "---|" * len(lengths) + "---|---|"]
    for g in report["goals"]:
        cells = [fmt(g["ratios"].get(str(n)), 2) if str(n) in g["ratios"] else "" for n in lengths]
        lines.append(f"| {g['goal']} | {g['a']} / {g['b']} | " + " | ".join(cells)
                     + f" | {fmt(g['ratios'].get('decode'), 2)} | **{g['status']}** (target {g['target']}) |")
    ag = report.get("int8_agreement")
    if ag:
        lines += ["", f"int8 vs fp32 (ONNX) greedy agreement, first {ag['max_tokens']} tokens on {ag['prompts']} chat "
                  f"prompts: {100 * ag['position_agreement']:.0f} % of positions, {ag['identical_sequences']}/"
                  f"{ag['prompts']} identical sequences, first divergence at {ag['first_divergence']} (not gated)."]
    path.write_text("\n".join(lines) + "\n\n" + notes)


# --- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="lengths 128/512, 1 repetition, 16 decode steps")
    ap.add_argument("--out", type=Path, help="JSON path; the .md goes beside it "
                    "(default bench/results/runtimes.json, or under /tmp with --quick)")
    ap.add_argument("--engines", help="comma list of families or family:threads, e.g. torch,onnx:1,llama.cpp "
                    f"(default all: {','.join(f'{f}:{t}' for f, t in ROWS)})")
    ap.add_argument("--reps", type=int, help="repetitions (default 3, 1 with --quick)")
    ap.add_argument("--long-reps", type=int, default=2, help="repetitions of the 2048-token prefill (at most --reps; "
                    "default 2, to keep the full run near 15 min on 2 busy cores)")
    ap.add_argument("--decode-budget", type=float, default=5.0, help="wall seconds per decode measurement")
    ap.add_argument("--model", type=Path, help="GGUF file (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    lengths = [128, 512] if args.quick else [128, 512, 2048]
    reps = args.reps or (1 if args.quick else 3)
    steps, decode_prompt, budget = (16 if args.quick else 64), 128, args.decode_budget
    out = args.out or (Path(tempfile.gettempdir()) / "relayinfer-runtimes-quick.json" if args.quick
                       else ROOT / "results" / "runtimes.json")
    wanted = ROWS
    if args.engines:
        sel = [e.strip() for e in args.engines.split(",") if e.strip()]
        wanted = [(f, t) for f, t in ROWS if f in sel or f"{f}:{t}" in sel]
        wanted += [(s.split(":")[0], int(s.split(":")[1])) for s in sel if ":" in s and
                   (s.split(":")[0], int(s.split(":")[1])) not in wanted]
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    loadavg = os.getloadavg()

    from relayinfer.protocol.model_file import resolve_model_path
    from relayinfer.protocol.tokenizer import Tokenizer
    model_path = resolve_model_path(args.model)
    tok = Tokenizer.from_gguf(model_path)
    prompt = chitchat_ids(tok, max(lengths))
    rows, notes = build_rows(wanted, model_path, max(lengths), log)
    model_info = notes.pop("_model")
    threads = sorted({r.threads for r in rows} | {1})

    log("warm-up")
    for r in rows:
        r.prefill(prompt[:32])
        r.decode(prompt[:32], 2, budget)
    samples = {r.name: {str(n): [] for n in lengths} | {"decode": []} for r in rows}
    bw = {"dram": {str(t): 0.0 for t in threads}, "same_size": {r.name: 0.0 for r in rows}}
    for rep in range(reps):  # bandwidth: best over repetitions (a 1 GiB buffer; each row's weight size)
        bw["dram"] = {str(t): max(bw["dram"][str(t)], bandwidth_gbs(1 << 30, t)) for t in threads}
        bw["same_size"] = {r.name: max(bw["same_size"][r.name], bandwidth_gbs(r.bytes_per_token, r.threads))
                           for r in rows}
        log(f"rep {rep + 1}/{reps} bandwidth GB/s: " + ", ".join(f"{t} threads {v:.1f}" for t, v in bw["dram"].items()))
        for n in [n for n in lengths if n < 2048 or rep < args.long_reps]:
            for r in rows[rep % len(rows):] + rows[:rep % len(rows)]:  # back to back, order rotated per rep
                samples[r.name][str(n)].append(r.prefill(prompt[:n]))
                gc.collect()
            log(f"rep {rep + 1}/{reps} prefill {n}: " + ", ".join(
                f"{r.name} {samples[r.name][str(n)][-1]:.0f}" for r in rows))
        for r in rows[::-1] if rep % 2 else rows:
            samples[r.name]["decode"].append(r.decode(prompt[:decode_prompt], steps, budget))
        log(f"rep {rep + 1}/{reps} decode: " + ", ".join(
            f"{r.name} {samples[r.name]['decode'][-1]:.1f}" for r in rows))

    res = {}
    for r in rows:
        s = samples[r.name]
        dec = statistics.median(s["decode"])
        res[r.name] = {
            "family": r.family, "threads": r.threads, "weights": r.weights, "bytes_per_token": r.bytes_per_token,
            "prefill_tok_s": {str(n): statistics.median(s[str(n)]) for n in lengths},
            "decode_tok_s": dec, "decode_method": r.decode_method,
            "bound_dram_tok_s": bw["dram"][str(r.threads)] * 1e9 / r.bytes_per_token,
            "bound_same_size_tok_s": bw["same_size"][r.name] * 1e9 / r.bytes_per_token,
            "decode_share_of_dram_bound": dec / (bw["dram"][str(r.threads)] * 1e9 / r.bytes_per_token),
            "samples": s}
    rows.clear()  # free the engines before the agreement run
    gc.collect()
    agreement = None
    if any(f == "onnx-int8" for f, _ in wanted):
        log("int8 agreement")
        agreement = int8_agreement(tok, AGREEMENT_PROMPTS[:3] if args.quick else AGREEMENT_PROMPTS, 32)

    report = {
        "command": " ".join([".venv/bin/python", "bench/runtimes.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": _cpu_name() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in loadavg], "python": platform.python_version(),
                    "versions": {p: _version(p) for p in ("torch", "onnxruntime", "transformers", "llama-cpp-python",
                                                          "numpy")}},
        "model": model_info,
        "settings": {"lengths": lengths, "reps": reps, "reps_2048": min(reps, args.long_reps), "decode_steps": steps, "decode_prompt": decode_prompt,
                     "decode_budget_s": budget,
                     "prompt_source": "chitchat-dataset messages joined by newlines, Tokenizer.from_gguf",
                     "units": "tokens/s (samples too, one per repetition); bandwidth in GB/s (1e9 B/s)"},
        "bandwidth_gbs": bw,
        "engines": list(res.values()),
        "not_run": notes,
        "goals": goals(res, lengths),
        "int8_agreement": agreement,
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


def _cpu_name() -> str | None:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return None


if __name__ == "__main__":
    sys.exit(main())
