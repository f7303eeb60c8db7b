"""Fidelity yardstick: how close each runtime's greedy tokens are to the fp32 model's, measured for
llama.cpp too, so that a device variant is judged by the same rule as the anchor it is compared with.

On `--prompts` chitchat prompts (chat-templated first turns, the conversations in order) x `--tokens`
greedy tokens, for each runtime on the same GGUF:

* `first_divergence`: the index of the first token that differs from the fp32 torch engine's
  greedy answer (the answer's length when none differs; both ending at the same EOS counts as equal);
* `logprob_gap`: per prompt, the mean log-probability (nats/token) of the fp32 model's own greedy
  answer minus that of the runtime's answer, both scored under the fp32 torch model (teacher
  forcing, one forward each); 0 for the fp32 model itself. Its mean over prompts can be negative (a
  greedy answer is not the likeliest sequence), so the distance compared is the mean of its
  absolute values (`logprob_gap_abs_mean`).

Runtimes: `onnx-gguf` (the device default: the GGUF's blocks, fp32 activations), `onnx-gguf-q8`
(the MLP blocks, 8-bit blocks and head on int8 activations), `onnx-fp32`, the cloud engine in half
precision (`torch-bf16`, `torch-fp16`: `TorchEngine(dtype=...)`, weights and KV cache rounded from
the dequantized fp32), the cloud engine on the file's 4-bit blocks (`torch-gguf`:
`TorchEngine(weights='gguf')`, torch's int4 kernel, bf16 activations into those matmuls only), and
`llama.cpp` (its `llama-server`
built by `bench/llamacpp.sh`, the same vendored source as llama-cpp-python's sdist, `/completion`
with the prompt as token ids, temperature 0, one slot, 1 thread; its Q4/Q8 matmuls quantize the
activations to Q8_1). A variant is *acceptable* when its median first divergence is at least
llama.cpp's and its mean absolute gap at most llama.cpp's.

    bench/llamacpp.sh                        # once: builds llama-server
    .venv/bin/python bench/fidelity.py       # SmolLM2, 24 x 64 (~10 min on 2 cores)
    .venv/bin/python bench/fidelity.py --model gemma3-270m --out bench/results/fidelity-gemma3-270m.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling drivers: split (mean_logprob), runtimes, serve_compare
RUNTIMES = ("onnx-gguf", "onnx-gguf-q8", "onnx-fp32", "torch-bf16", "torch-fp16", "torch-gguf", "llama.cpp")


def prompts(tok, n: int) -> list[list[int]]:
    """The first user turn of the first `n` usable chitchat conversations, chat-templated."""
    from relayinfer.sdk.datasets import chitchat_prompt

    out, i = [], 0
    while len(out) < n:
        msgs = chitchat_prompt(i, max_turns=1)
        i += 1
        out.append(tok.encode_chat(msgs))
    return out


def llama_greedy(base: str, ids: list[int], n: int, eos: int) -> list[int]:
    """`n` greedy tokens from llama-server's /completion (prompt as token ids, temperature 0)."""
    body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                       "return_tokens": True, "special": True}).encode()
    req = urllib.request.Request(base + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        toks = json.loads(r.read())["tokens"]
    if len(toks) < n and (not toks or toks[-1] != eos):
        toks = toks + [eos]  # llama-server leaves the EOS it stopped at out of `tokens`
    return toks[:n]


def first_divergence(a: list[int], ref: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, ref)) if x != y), min(len(a), len(ref)))


def write_markdown(rep: dict, path: Path) -> None:
    """The table of a report (`main`'s JSON) as Markdown at `path`."""
    n, rows, notes = rep["prompts"], rep["runtimes"], rep["notes"]
    lines = [f"# Fidelity yardstick: {Path(rep['model']).name}", "", f"Command: `{rep['command']}` ({rep['date']}, wall "
             f"{rep['wall_s']:.0f} s). {n} chitchat prompts x {rep['tokens']} greedy tokens; reference: "
             "the fp32 torch engine's greedy answer; gap: per prompt, the mean log-prob (nats/token) of the reference "
             "minus that of the runtime's answer, both under the fp32 model.", "",
             "| runtime | equal answers | first divergence median | log-prob gap: mean abs / mean / max | "
             "acceptable (vs llama.cpp) |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        ok = "-" if name == "llama.cpp" else {True: "yes", False: "no", None: "-"}[r.get("acceptable")]
        lines.append(f"| {name} | {r['equal_answers']}/{n} | {r['first_divergence_median']:g} | "
                     f"{r['logprob_gap_abs_mean']:.4f} / {r['logprob_gap_mean']:.4f} / {max(r['logprob_gap']):.3f} | {ok} |")
    for name, why in notes.items():
        lines.append(f"\n{name}: {why}")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file or installed model name (default SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma list of {', '.join(RUNTIMES)}")
    ap.add_argument("--out", type=Path, help="results JSON (.md beside it); default bench/results/fidelity.json")
    ap.add_argument("--llama-isa", default="avx2", choices=("avx2", "avx512"),
                    help="which bench/llamacpp.sh build serves llama.cpp's answers (LLAMACPP_ISA)")
    args = ap.parse_args(argv)
    wanted = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    bad = [r for r in wanted if r not in RUNTIMES]
    if bad or args.prompts < 1 or args.tokens < 1:
        print(f"fidelity: unknown runtime {bad[0]!r} (choose from {', '.join(RUNTIMES)})" if bad else
              "fidelity: --prompts and --tokens must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from split import mean_logprob

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.protocol.model.decoding import SamplingParams
    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.protocol.model.tokenizer import Tokenizer

    t_start = time.perf_counter()
    model = resolve_model_path(args.model)
    tok = Tokenizer.from_gguf(model)
    fp32 = TorchEngine(model, device="cpu", threads=1)
    eos = fp32.cfg.eos_id
    ps = prompts(tok, args.prompts)
    greedy = SamplingParams(max_new_tokens=args.tokens)  # temperature 0; EOS ends an answer (and is kept)
    ref = [fp32.generate(p, greedy).token_ids for p in ps]
    ref_lp = [mean_logprob(fp32, p, a) for p, a in zip(ps, ref)]
    answers: dict[str, list[list[int]]] = {}
    notes = {}
    for name in wanted:
        if name == "llama.cpp":
            import serve_compare
            from runtimes import llama_bench_binary

            b = llama_bench_binary(args.llama_isa)
            if b is None:
                notes[name] = f"not built (run LLAMACPP_ISA={args.llama_isa} bench/llamacpp.sh)"
                continue
            logdir = Path(os.environ.get("TMPDIR", "/tmp"))
            srv = serve_compare.start_llama("llama-fid", b.parent, model, 1, 1, 4096, set(), logdir)
            try:
                srv.wait_ready()
                answers[name] = [llama_greedy(srv.base, p, args.tokens, eos) for p in ps]
            finally:
                srv.stop()
        elif name.startswith("torch-"):
            kind = name.split("-", 1)[1]
            half = TorchEngine(model, device="cpu", threads=1, **({"weights": kind} if kind == "gguf" else {"dtype": kind}))
            answers[name] = [half.generate(p, greedy).token_ids for p in ps]
            del half
        else:
            from relayinfer.cloud.export import ensure_device_model
            from relayinfer.device.onnx_engine import OnnxEngine

            w = name.split("-", 1)[1]
            eng = OnnxEngine(ensure_device_model(model, w), quantize=w, threads=1)
            answers[name] = [eng.generate(p, greedy).token_ids for p in ps]
            del eng
        print(f"[fidelity] {name}: done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
    rows = {}
    for name, ans in answers.items():
        div = [first_divergence(a, r) for a, r in zip(ans, ref)]
        gap = [rl - mean_logprob(fp32, p, a) if a else 0.0 for p, a, rl in zip(ps, ans, ref_lp)]
        rows[name] = {"first_divergence": div, "first_divergence_median": statistics.median(div),
                      "equal_answers": sum(a == r for a, r in zip(ans, ref)),
                      "logprob_gap": gap, "logprob_gap_mean": float(np.mean(gap)),
                      "logprob_gap_abs_mean": float(np.mean(np.abs(gap)))}
    anchor = rows.get("llama.cpp")
    for name, r in rows.items():
        if anchor is not None and name != "llama.cpp":
            r["acceptable"] = (r["first_divergence_median"] >= anchor["first_divergence_median"]
                               and r["logprob_gap_abs_mean"] <= anchor["logprob_gap_abs_mean"])
    out = args.out or HERE / "results" / "fidelity.json"
    rep = {"command": " ".join([".venv/bin/python", "bench/fidelity.py", *(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(model),
           "prompts": args.prompts, "tokens": args.tokens, "reference": "fp32 torch engine, greedy",
           "reference_answer_lengths": [len(a) for a in ref], "runtimes": rows, "notes": notes,
           "wall_s": round(time.perf_counter() - t_start, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    write_markdown(rep, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
