"""`relayinfer bench refine`: prompt refinement scored on the refined prompt alone.

For each chitchat prompt (`sdk.datasets.chitchat_prompts_by_length`, SmolLM2's chat template) the
full prompt's greedy answer (`answer_tokens` tokens, TorchEngine) is the reference. Each selection
method keeps `keep` of the prompt (`protocol.refine.refine_indices`: forced system turn, last
`WINDOW` tokens, whole-header scaffold charged to the budget only for turns with kept content):

* ``attention``: SnapKV-style observation-window scores (`TorchEngine.prefill_scored`; Li et al.
  2024, arXiv 2404.14469, sec. 4), max-pooled (width 7);
* ``recency``: the newest tokens (scores = position, no pooling), no attention at all;
* ``random``: uniform random scores (seeded), no pooling;
* ``attention+pos`` (keep 0.5 only): the attention selection prefilled at its original RoPE
  positions (torch only; the ONNX device model has no position input, so the device cannot do this).

Scored on the refined prompt alone (nothing from the cloud's full-prompt answer is used):
``ll_delta`` = mean log-prob per answer token of the reference answer under the refined prompt minus
under the full prompt (nats/token, teacher-forced; 0 = no loss, negative = worse); ``agree32`` =
fraction of the first 32 positions where the refined prompt's own greedy answer equals the reference;
``rouge_l`` = ROUGE-L F1 of the two answers' texts (`rouge-score`, else token LCS);
``saved`` = device prefill tokens saved, 1 - kept / n. Rows of one keep ratio run as one left-padded
batch (explicit positions and masks, `Llama.forward`). Summaries: mean and standard error over
prompts, per length bucket (below / from `MIN_REFINE_TOKENS`), per method and keep ratio; the
attention-minus-recency difference is paired per prompt.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RATIOS = (0.25, 0.5, 0.75)
METHODS = ("attention", "recency", "random")
LENGTHS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def _rouge_l(a: str, b: str, ids_a, ids_b) -> float:
    try:
        from rouge_score import rouge_scorer
        return rouge_scorer.RougeScorer(["rougeL"]).score(a, b)["rougeL"].fmeasure
    except ImportError:  # token-level LCS F1
        from relayinfer.sdk.bench_split import rouge_l
        return rouge_l(list(ids_a), list(ids_b))


def _batch_eval(model, cfg, rows, answer, n_new):
    """Score each row (prompt ids, RoPE positions) as one left-padded batch.

    Returns per row: mean log-prob per token of `answer` (teacher-forced, nats) and the row's own
    greedy answer of `n_new` tokens (list[int])."""
    import torch

    from relayinfer.cloud.models.llama import StaticKV

    b, L, m = len(rows), max(len(r[0]) for r in rows), len(answer)
    x = torch.zeros(b, L, dtype=torch.long)
    pos = torch.zeros(b, L, dtype=torch.long)
    valid = torch.zeros(b, L, dtype=torch.bool)
    for i, (ids, p) in enumerate(rows):
        x[i, L - len(ids):] = torch.tensor(ids)
        pos[i, L - len(ids):] = torch.tensor(p)
        valid[i, L - len(ids):] = True
    last = pos[:, -1]
    kv = StaticKV(cfg, batch=b, capacity=L + max(m, n_new) + 2)
    ar = torch.arange(L)
    causal = ar[None, :] <= ar[:, None]
    mask = (causal[None] & (valid[:, None, :] | torch.eye(L, dtype=torch.bool)[None]))[:, None]  # pads see themselves
    with torch.inference_mode():
        kv.reserve(L)
        first = model(x, kv, 0, last_only=True, positions=pos, mask=mask).float()
        kv.commit()
        lp0 = first.log_softmax(-1)[:, answer[0]]
        ll = lp0.clone()
        if m > 1:
            a = torch.tensor([answer[:-1]] * b)
            s = m - 1
            ap = last[:, None] + 1 + torch.arange(s)[None]
            am = torch.cat([valid[:, None, :].expand(b, s, L), (torch.arange(s)[None, :] <= torch.arange(s)[:, None])[None].expand(b, s, s)], -1)[:, None]
            kv.reserve(s)
            lg = model(a, kv, L, last_only=False, positions=ap, mask=am).float().log_softmax(-1)
            kv.commit()
            ll += lg.gather(-1, torch.tensor([answer[1:]] * b)[..., None])[..., 0].sum(1)
        ll = (ll / m).tolist()
        kv.length = L  # free-running greedy from the prompt alone
        tok = first.argmax(-1)
        outs = [tok]
        for t in range(n_new - 1):
            km = torch.cat([valid, torch.ones(b, t + 1, dtype=torch.bool)], -1)[:, None, None, :]
            kv.reserve(1)
            lg = model(tok[:, None], kv, L + t, last_only=True, positions=(last + 1 + t)[:, None], mask=km)
            kv.commit()
            tok = lg.argmax(-1)
            outs.append(tok)
    gen = torch.stack(outs, 1).tolist()
    return ll, gen


def _stats(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None
    se = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None
    return {"mean": round(float(np.mean(xs)), 4), "se": None if se is None else round(se, 4), "n": len(xs)}


def summarize(rows: list[dict], threshold: int) -> dict:
    """Mean ± SE per bucket / method / keep ratio, and paired attention − recency differences."""
    out = {}
    for bucket, sel in ((f"<{threshold}", lambda n: n < threshold), (f">={threshold}", lambda n: n >= threshold),
                        ("all", lambda n: True)):
        rs = [r for r in rows if sel(r["n"])]
        b = {}
        for r in sorted({(r["method"], r["keep"]) for r in rs}):
            xs = [x for x in rs if (x["method"], x["keep"]) == r]
            b[f"{r[0]}@{r[1]}"] = {k: _stats([x[k] for x in xs]) for k in ("ll_delta", "agree32", "rouge_l", "saved")}
        for keep in RATIOS:
            by = {(x["prompt"], x["method"]): x["ll_delta"] for x in rs if x["keep"] == keep}
            d = [by[(p, "attention")] - by[(p, "recency")] for (p, mth) in by if mth == "attention" and (p, "recency") in by]
            b[f"attention-recency@{keep}"] = _stats(d)
        out[bucket] = b
    return out


def _score_prompts(work, answer_tokens: int, seed: int, threads: int) -> list[dict]:
    """Rows for the (prompt index, prompt ids) pairs in `work` (one process; own engine)."""
    import torch

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.protocol.refine import WINDOW, TemplateMarkers, refine_indices
    from relayinfer.protocol.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    tok = Tokenizer.from_gguf()
    markers = TemplateMarkers.from_tokenizer(tok)
    eng = TorchEngine(threads=threads)
    rows, t0 = [], time.time()
    for pi, ids in work:
        n, rng = len(ids), np.random.default_rng(seed + pi)
        logits, kv, scores = eng.prefill_scored(ids, WINDOW)
        ref, full_lp = [], []
        for i in range(answer_tokens):  # the full prompt's greedy answer and its log-probs
            lp = logits - logits.max()
            lp = lp - np.log(np.exp(lp).sum())
            t = int(np.argmax(logits))
            ref.append(t)
            full_lp.append(float(lp[t]))
            if i + 1 < answer_tokens:
                logits, kv = eng.decode(t, kv)
        full_ll = float(np.mean(full_lp))
        ref_text = tok.decode(ref, skip_special=True)
        sel = {"attention": (scores, 7), "recency": (np.arange(n, dtype=np.float64), 1),
               "random": (rng.random(n), 1)}
        for keep in RATIOS:
            todo = []
            for mth in METHODS:
                s, pool = sel[mth]
                kept = refine_indices(s, ids, keep, markers, WINDOW, pool)
                todo.append((mth, kept, list(range(len(kept)))))
                if mth == "attention" and keep == 0.5:
                    todo.append(("attention+pos", kept, kept))
            ll, gen = _batch_eval(eng.model, eng.cfg, [([ids[i] for i in k], p) for _, k, p in todo], ref, answer_tokens)
            for (mth, kept, _), l, g in zip(todo, ll, gen):
                rows.append({"prompt": pi, "n": n, "method": mth, "keep": keep, "kept": len(kept),
                             "saved": round(1 - len(kept) / n, 4), "ll_delta": round(l - full_ll, 4),
                             "agree32": round(float(np.mean([a == b for a, b in zip(g[:32], ref[:32])])), 4),
                             "rouge_l": round(_rouge_l(tok.decode(g, skip_special=True), ref_text, g, ref), 4)})
        print(f"prompt {pi} ({n} tokens) done at {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def bench_refine(lengths=LENGTHS, per_length: int = 1, answer_tokens: int = 32, seed: int = 0,
                 out: str | Path = "bench/results/refine.json", plot: str | Path | None = "bench/results/refine.png",
                 threads: int = 1, workers: int = 1, command: str | None = None) -> dict:
    """Run the benchmark (see the module docstring) over `per_length` chitchat prompts near each of
    `lengths` tokens, in `workers` processes of `threads` torch threads each (prompts dealt out by
    length); writes `out` (JSON: command, commit, summary, per-prompt rows) and `plot` (PNG)."""
    from relayinfer.protocol.refine import MIN_REFINE_TOKENS
    from relayinfer.protocol.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    t0 = time.time()
    prompts = [p for p in chitchat_prompts_by_length(Tokenizer.from_gguf(), list(lengths), per_length, seed) if p]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    shards = [[(i, prompts[i]) for i in order[w::workers]] for w in range(workers)]
    if workers == 1:
        rows = _score_prompts(shards[0], answer_tokens, seed, threads)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            rows = [r for rs in ex.map(_score_prompts, shards, [answer_tokens] * workers, [seed] * workers,
                                       [threads] * workers) for r in rs]
    rows.sort(key=lambda r: (r["prompt"], r["keep"], r["method"]))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    res = {"command": command or " ".join(sys.argv), "commit": commit, "answer_tokens": answer_tokens,
           "lengths": list(lengths), "per_length": per_length, "seed": seed, "workers": workers,
           "prompt_tokens": [len(p) for p in prompts], "wall_s": round(time.time() - t0, 1),
           "threshold": MIN_REFINE_TOKENS, "summary": summarize(rows, MIN_REFINE_TOKENS), "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    if plot:
        _plot(rows, plot, MIN_REFINE_TOKENS)
    return res


def _plot(rows, path, threshold):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (name, sel) in zip(axes, ((f"prompts < {threshold} tokens", lambda n: n < threshold),
                                      (f"prompts >= {threshold} tokens", lambda n: n >= threshold))):
        for mth in METHODS + ("attention+pos",):
            pts = []
            for keep in RATIOS:
                st = _stats([r["ll_delta"] for r in rows if r["method"] == mth and r["keep"] == keep and sel(r["n"])])
                if st:
                    pts.append((keep, st["mean"], st["se"] or 0))
            if pts:
                k, m, e = zip(*pts)
                ax.errorbar(k, m, yerr=e, marker="o", capsize=3, label=mth)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(name)
        ax.set_xlabel("keep ratio")
    axes[0].set_ylabel("log-likelihood change of the full-prompt answer (nats/token)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
