"""`relayinfer bench refine`: prompt refinement scored on the refined prompt alone.

Prompts (SmolLM2's chat template): chitchat conversations near each of `lengths` tokens
(`sdk.datasets.chitchat_prompts_by_length`); from `MULTI_FROM` tokens on (single chitchat
conversations are shorter), multi-conversation long contexts: several random conversations
concatenated into one chat, the last one ending on its user turn (`multi_conversation_prompt`).
The full prompt's greedy answer (`answer_tokens` tokens, TorchEngine) is the reference. Each
selection method keeps `keep` of the prompt (`cloud.refine.refine_indices`: forced system turn,
last `WINDOW` tokens, whole-header scaffold charged to the budget only for turns with kept content):

* ``attention``: SnapKV observation-window scores (attention of the last 16 prompt positions summed
  over heads and layers; Li et al. 2024, arXiv 2404.14469, sec. 4), max-pooled (width 7);
* ``norm``: the same attention with every (layer, head) rank-normalised before the sum, so no head
  or attention sink dominates (per-head voting; SnapKV sec. 4 selects per head), max-pooled;
* ``turns``: chunk-level selection, a turn's content scored by its mean attention, kept whole
  (`cloud.refine.chunk_mean_scores`; ChunkKV, Liu et al. 2025, arXiv 2502.00299);
* ``mix``: attention rank mixed half and half with recency (`cloud.refine.mix_recency`; H2O's
  heavy hitters plus recent tokens, Zhang et al. 2023, arXiv 2306.14048);
* ``last``: attention with the last user turn always kept whole (`keep_last_turn`);
* ``h2o``: accumulated attention of every prompt query (H2O, Zhang et al. 2023, sec. 3), max-pooled;
  prompts up to `H2O_MAX` tokens only (it recomputes the full attention matrix);
* ``recency``: the newest tokens (scores = position, no pooling), no attention at all;
* ``random``: uniform random scores (seeded), no pooling.

Every method is prefilled at the kept tokens' original RoPE positions (what the device does with a
positions-aware engine), the answer continuing at n + k; ``attention/contig`` and
``recency/contig`` (keep 0.5 only) are prefilled at contiguous positions 0..kept-1 (a device engine
without position input).

Scored on the refined prompt alone (nothing from the cloud's full-prompt answer is used):
``ll_delta`` = mean log-prob per answer token of the reference answer under the refined prompt minus
under the full prompt (nats/token, teacher-forced; 0 = no loss, negative = worse); ``agree32`` =
fraction of the first 32 positions where the refined prompt's own greedy answer equals the reference;
``rouge_l`` = ROUGE-L F1 of the two answers' texts (`rouge-score`, else token LCS);
``saved`` = device prefill tokens saved, 1 - kept / n; ``prefill_saved`` (attention rows) = 1 -
measured prefill time of the kept tokens / of the whole prompt (TorchEngine, one thread, the same
process back to back; keep 0.5 only). Rows of one keep ratio run as left-padded batches (explicit positions and
masks, `Llama.forward`). Summaries: mean and standard error over prompts, per length bucket, per
method and keep ratio; each method-minus-recency difference is paired per prompt.
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
METHODS = ("attention", "norm", "turns", "mix", "last", "h2o", "recency", "random")
CONTIG = ("attention/contig", "recency/contig")  # keep 0.5 only
LENGTHS = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
MULTI_FROM = 1200  # from this many tokens on, prompts are multi-conversation long contexts
H2O_MAX = 1024  # h2o recomputes the full [heads, n, n] attention: only up to this many tokens
BUCKETS = ((0, 512), (512, 1200), (1200, 10 ** 9))  # prompt-length buckets of the summary (tokens)


def multi_conversation_prompt(tok, target: int, rng) -> list[int] | None:
    """A long context of about `target` tokens (chat-templated ids): whole chitchat conversations
    (`sdk.datasets.chitchat_messages`), each cut to end on an assistant turn, appended until the
    next would pass `target`, then a last conversation ending on its user turn (its first turns,
    as many as fit). None if nothing fits within 10 % of `target`."""
    from relayinfer.sdk.datasets import _chitchat, chitchat_messages

    convs, msgs = _chitchat(), []
    for _ in range(400):
        m = chitchat_messages(convs[rng.randrange(len(convs))])
        while m and m[-1]["role"] != "assistant":
            m = m[:-1] if len(m) > 1 and m[-2]["role"] == "user" else []
        if len(m) < 2 or len(tok.encode_chat(msgs + m + [{"role": "user", "content": "x"}])) > 0.8 * target:
            continue
        msgs += m
    for _ in range(400):
        last = chitchat_messages(convs[rng.randrange(len(convs))])
        for t in range(len(last), 0, -1):
            if last[t - 1]["role"] == "user":
                ids = tok.encode_chat(msgs + last[:t])
                if abs(len(ids) - target) <= 0.1 * target:
                    return ids
    return None


def _rouge_l(a: str, b: str, ids_a, ids_b) -> float:
    try:
        from rouge_score import rouge_scorer
        return rouge_scorer.RougeScorer(["rougeL"]).score(a, b)["rougeL"].fmeasure
    except ImportError:  # token-level LCS F1
        from relayinfer.sdk.cli import bench_module
        return bench_module("split").rouge_l(list(ids_a), list(ids_b))


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


def _eval_rows(model, cfg, rows, answer, n_new, cells: float = 16e6):
    """`_batch_eval` in sub-batches of at most `cells` / L^2 rows (L: the longest row), so a batch's
    [rows, heads, L, L] attention stays near 0.6 GB."""
    ll, gen, i = [], [], 0
    order = sorted(range(len(rows)), key=lambda j: -len(rows[j][0]))
    out = [None] * len(rows)
    while i < len(order):
        L = len(rows[order[i]][0])
        b = max(1, int(cells // (L * L)))
        part = order[i:i + b]
        l, g = _batch_eval(model, cfg, [rows[j] for j in part], answer, n_new)
        for j, lj, gj in zip(part, l, g):
            out[j] = (lj, gj)
        i += b
    ll, gen = zip(*out)
    return list(ll), list(gen)


class _Scores:
    """Observation-window attention (an `ObservationScores` stand-in for `Llama.forward`'s `obs`):
    ``raw`` float64 [T] = probabilities of the last `window` queries summed over heads and layers
    (SnapKV); ``norm`` float64 [T] = the same per (layer, head) turned into ranks / T before the sum."""

    def __init__(self, window: int):
        self.window, self.raw, self.norm = window, None, None

    def add(self, q, k, mask) -> None:
        import torch

        w = min(self.window, q.shape[2])
        b, h, _, hd = q.shape
        kvh = k.shape[1]
        qw = q[:, :, -w:].reshape(b, kvh, (h // kvh) * w, hd)  # grouped query heads as rows
        logits = (qw @ k.transpose(-1, -2)).view(b, h, w, -1) / hd ** 0.5
        if mask is not None:
            logits = logits.masked_fill(~mask[..., -w:, :], float("-inf"))
        p = logits.softmax(-1).sum(2)[0].double()  # [H, T]
        rank = torch.empty_like(p)
        rank.scatter_(1, p.argsort(1), torch.arange(p.shape[1], dtype=p.dtype).expand_as(p).contiguous())
        raw, norm = p.sum(0).numpy(), (rank.sum(0) / p.shape[1]).numpy()
        self.raw = raw if self.raw is None else self.raw + raw
        self.norm = norm if self.norm is None else self.norm + norm


def _stats(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None
    se = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None
    return {"mean": round(float(np.mean(xs)), 4), "se": None if se is None else round(se, 4), "n": len(xs)}


def _bucket(n: int) -> str:
    lo, hi = next((lo, hi) for lo, hi in BUCKETS if lo <= n < hi)
    return f"{lo}-{hi}" if hi < 10 ** 9 else f">={lo}"


def summarize(rows: list[dict]) -> dict:
    """Mean ± SE per length bucket (`BUCKETS`, and "all") / method / keep ratio, and each method's
    paired difference from recency (``<method>-recency@<keep>``, nats/token)."""
    out = {}
    for bucket in [_bucket(lo) for lo, _ in BUCKETS] + ["all"]:
        rs = [r for r in rows if bucket == "all" or _bucket(r["n"]) == bucket]
        b = {}
        for key in sorted({(r["method"], r["keep"]) for r in rs}):
            xs = [x for x in rs if (x["method"], x["keep"]) == key]
            b[f"{key[0]}@{key[1]}"] = {k: _stats([x.get(k) for x in xs])
                                       for k in ("ll_delta", "agree32", "rouge_l", "saved", "prefill_saved")}
        for keep in RATIOS:
            by = {(x["prompt"], x["method"]): x["ll_delta"] for x in rs if x["keep"] == keep}
            for mth in METHODS + CONTIG:
                if mth in ("recency", "recency/contig"):
                    continue
                d = [by[(p, m)] - by[(p, "recency")] for (p, m) in by if m == mth and (p, "recency") in by]
                if d:
                    b[f"{mth}-recency@{keep}"] = _stats(d)
        out[bucket] = b
    return out


def merged_summary(paths=None) -> dict:
    """`summarize` over the rows of several result files (default: bench/results/refine*.json, e.g.
    the main run and a long-context run), prompts kept apart per file."""
    root = Path(__file__).resolve().parent / "results"
    paths = sorted(root.glob("refine*.json")) if paths is None else [Path(p) for p in paths]
    rows = []
    for i, p in enumerate(paths):
        rows += [{**r, "prompt": f"{i}:{r['prompt']}"} for r in json.loads(Path(p).read_text())["rows"]]
    return summarize(rows)


def markdown_table(summary: dict) -> str:
    """Markdown: per length bucket and keep ratio, each method's log-likelihood change (mean ± SE,
    nats/token) and its paired difference from recency, plus agreement and measured prefill saved."""
    def f(st, d=3):
        return "–" if not st else f"{st['mean']:+.{d}f} ± {st['se']:.{d}f}" if st["se"] is not None else f"{st['mean']:+.{d}f}"

    cols = [m for m in METHODS + CONTIG if any(k.startswith(m + "@") for b in summary.values() for k in b)]
    out = ["| prompts (n) | keep | " + " | ".join(cols) + " | best − recency | prefill time saved (attention) |",
           "|---" * (len(cols) + 4) + "|"]
    for lo, _ in BUCKETS:
        b = summary.get(_bucket(lo), {})
        for keep in RATIOS:
            if f"recency@{keep}" not in b:
                continue
            n = b[f"recency@{keep}"]["ll_delta"]["n"]
            diffs = {m: b.get(f"{m}-recency@{keep}") for m in cols if m not in ("recency", "recency/contig")}
            best = max((m for m in diffs if diffs[m]), key=lambda m: diffs[m]["mean"], default=None)
            ps = (b.get(f"attention@{keep}") or {}).get("prefill_saved")
            out.append(f"| {_bucket(lo)} ({n}) | {keep} | " + " | ".join(f((b.get(f"{m}@{keep}") or {}).get("ll_delta"))
                                                                       for m in cols)
                       + f" | {best}: {f(diffs[best]) if best else '–'} | {f(ps, 2) if ps else '–'} |")
    return "\n".join(out) + "\n"


def refine_table(summary: dict, method: str | None = None, max_loss: float = 0.05) -> tuple:
    """`protocol.model.refine.REFINE_BY_LENGTH` from a summary: per length bucket (`BUCKETS`), the
    smallest keep ratio at which `method` (default `cloud.refine.SELECTION`, the cloud's) beat
    recency by more than its standard error (paired) and lost at most `max_loss` nats/token; None
    (off) where no ratio did."""
    from relayinfer.cloud.refine import SELECTION

    method = method or SELECTION
    table = []
    for lo, _ in BUCKETS:
        b, keep = summary.get(_bucket(lo), {}), None
        for r in RATIOS:
            d, ll = b.get(f"{method}-recency@{r}"), (b.get(f"{method}@{r}") or {}).get("ll_delta")
            if d and ll and d["se"] is not None and d["mean"] > d["se"] and ll["mean"] >= -max_loss:
                keep = r
                break
        table.append((lo, keep))
    return tuple(table)


def _score_prompts(work, answer_tokens: int, seed: int, threads: int, deadline: float,
                   methods=METHODS, ratios=RATIOS, model: str | None = None) -> list[dict]:
    """Rows for the (prompt index, prompt ids) pairs in `work` (one process; own engine); prompts
    not started before `deadline` (time.time()) are skipped (a row with method "skipped")."""
    import torch

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.refine import WINDOW, select
    from relayinfer.protocol.model.refine import TemplateMarkers
    from relayinfer.protocol.model.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    eng = TorchEngine(model, threads=threads)
    tok = Tokenizer.from_gguf(eng.model_path)
    markers = TemplateMarkers.from_tokenizer(tok)
    rows, t0 = [], time.time()
    for pi, ids in work:
        n = len(ids)
        if time.time() > deadline:
            rows.append({"prompt": pi, "n": n, "method": "skipped", "keep": None})
            print(f"prompt {pi} ({n} tokens) skipped: past the time bound", file=sys.stderr, flush=True)
            continue
        obs = _Scores(WINDOW)
        kv = eng.new_cache(n + answer_tokens + 8)
        t = time.perf_counter()
        logits = eng.forward(ids, kv, obs=obs).cpu().numpy()
        scored_s = time.perf_counter() - t
        ref, full_lp = [], []
        for i in range(answer_tokens):  # the full prompt's greedy answer and its log-probs
            lp = logits - logits.max()
            lp = lp - np.log(np.exp(lp).sum())
            tk = int(np.argmax(logits))
            ref.append(tk)
            full_lp.append(float(lp[tk]))
            if i + 1 < answer_tokens:
                logits, kv = eng.decode(tk, kv)
        del kv
        full_ll = float(np.mean(full_lp))
        ref_text = tok.decode(ref, skip_special=True)
        sel = {m: (m, obs.raw) for m in ("attention", "turns", "mix", "last", "recency", "random")}
        sel["norm"] = ("attention", obs.norm)  # rank-normalised heads, selected like attention
        if n <= H2O_MAX and "h2o" in methods:  # accumulated attention of every query (H2O)
            h2o = _Scores(n)
            eng.forward(ids, eng.new_cache(n + 8), obs=h2o)
            sel["h2o"] = ("attention", h2o.raw)
        full_ms = _prefill_ms(eng, ids)
        done = {}  # (kept, positions) -> (ll, gen): methods that keep the same tokens are run once
        for keep in ratios:
            todo = []
            for mth in methods:
                if mth not in sel:
                    continue
                kept = select(sel[mth][1], ids, keep, markers, sel[mth][0], WINDOW, seed + pi)
                todo.append((mth, kept, kept))
                if keep == 0.5 and mth + "/contig" in CONTIG:
                    todo.append((mth + "/contig", kept, list(range(len(kept)))))
            new = list(dict.fromkeys((tuple(k), tuple(p)) for _, k, p in todo if (tuple(k), tuple(p)) not in done))
            if new:
                ll, gen = _eval_rows(eng.model, eng.cfg, [([ids[i] for i in k], list(p)) for k, p in new], ref,
                                     answer_tokens)
                done.update(zip(new, zip(ll, gen)))
            att_ms = _prefill_ms(eng, [ids[i] for i in todo[0][1]]) if keep == 0.5 else None
            for mth, kept, p in todo:
                l, g = done[(tuple(kept), tuple(p))]
                rows.append({"prompt": pi, "n": n, "method": mth, "keep": keep, "kept": len(kept),
                             "saved": round(1 - len(kept) / n, 4), "ll_delta": round(l - full_ll, 4),
                             "agree32": round(float(np.mean([a == b for a, b in zip(g[:32], ref[:32])])), 4),
                             "rouge_l": round(_rouge_l(tok.decode(g, skip_special=True), ref_text, g, ref), 4),
                             **({"prefill_ms_full": round(full_ms, 1), "prefill_ms_kept": round(att_ms, 1),
                                 "prefill_saved": round(1 - att_ms / full_ms, 4)} if mth == "attention" and att_ms else {})})
        print(f"prompt {pi} ({n} tokens) done at {time.time() - t0:.0f} s (scored prefill {scored_s:.1f} s)",
              file=sys.stderr, flush=True)
    return rows


def _prefill_ms(eng, ids) -> float:
    """Wall time of one prefill of `ids` into a fresh cache (ms)."""
    t = time.perf_counter()
    eng.prefill(ids)
    return (time.perf_counter() - t) * 1e3


def make_prompts(lengths, per_length: int, seed: int, model: str | None = None) -> list[list[int]]:
    """`per_length` prompts near each length: single chitchat conversations below `MULTI_FROM`
    tokens, multi-conversation long contexts from it on (missing ones dropped)."""
    import random

    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    tok = Tokenizer.from_gguf(resolve_model_path(model))
    short = [x for x in lengths if x < MULTI_FROM]
    out = [p for p in chitchat_prompts_by_length(tok, short, per_length, seed) if p] if short else []
    rng = random.Random(seed)
    for x in lengths:
        if x >= MULTI_FROM:
            out += [p for p in (multi_conversation_prompt(tok, x, rng) for _ in range(per_length)) if p]
    return out


def bench_refine(lengths=LENGTHS, per_length: int = 1, answer_tokens: int = 32, seed: int = 0,
                 out: str | Path = "bench/results/refine.json", plot: str | Path | None = "bench/results/refine.png",
                 threads: int = 1, workers: int = 1, command: str | None = None, max_s: float = 1200.0,
                 per_length_long: int | None = None, methods=METHODS, ratios=RATIOS, model: str | None = None) -> dict:
    """Run the benchmark (see the module docstring) over `per_length` prompts near each of `lengths`
    tokens (`per_length_long` for multi-conversation lengths, default `per_length`), in `workers`
    processes of `threads` torch threads each (prompts dealt out by cost, longest first); a
    worker starts no prompt after `max_s` seconds (skipped prompts are listed); `methods`/`ratios`
    restrict the rows (long prompts on a busy machine). Writes `out` (JSON:
    command, commit, summary, per-prompt rows) and `plot` (PNG)."""
    t0 = time.time()
    prompts = make_prompts([x for x in lengths if x < MULTI_FROM], per_length, seed, model)
    prompts += make_prompts([x for x in lengths if x >= MULTI_FROM], per_length_long or per_length, seed, model)
    shards, load = [[] for _ in range(workers)], [0.0] * workers
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):  # longest first, least-loaded worker
        w = load.index(min(load))
        shards[w].append((i, prompts[i]))
        load[w] += len(prompts[i]) * (1 + len(prompts[i]) / 2048)  # attention grows with n^2
    deadline = t0 + max_s
    if workers == 1:
        rows = _score_prompts(shards[0], answer_tokens, seed, threads, deadline, methods, ratios, model)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            rows = [r for rs in ex.map(_score_prompts, shards, [answer_tokens] * workers, [seed] * workers,
                                       [threads] * workers, [deadline] * workers, [methods] * workers,
                                       [ratios] * workers, [model] * workers) for r in rs]
    skipped = sorted(r["n"] for r in rows if r["method"] == "skipped")
    rows = [r for r in rows if r["method"] != "skipped"]
    rows.sort(key=lambda r: (r["prompt"], r["keep"], r["method"]))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    res = {"command": command or " ".join(sys.argv), "commit": commit, "answer_tokens": answer_tokens,
           "lengths": list(lengths), "per_length": per_length, "per_length_long": per_length_long,
           "seed": seed, "workers": workers, "max_s": max_s, "multi_from": MULTI_FROM,
           "methods": list(methods), "ratios": list(ratios),
           "prompt_tokens": sorted({r["n"] for r in rows}), "skipped_prompt_tokens": skipped,
           "wall_s": round(time.time() - t0, 1), "summary": summarize(rows), "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    if plot:
        _plot(rows, plot)
    return res


def _plot(rows, path):
    """Log-likelihood change vs keep ratio per method (mean ± SE), one panel per length bucket."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = [b for b in (_bucket(lo) for lo, _ in BUCKETS) if any(_bucket(r["n"]) == b for r in rows)]
    fig, axes = plt.subplots(1, len(buckets), figsize=(5 * len(buckets), 4.2), sharey=True, squeeze=False)
    for ax, bucket in zip(axes[0], buckets):
        for mth in METHODS + CONTIG:
            pts = []
            for keep in RATIOS:
                st = _stats([r["ll_delta"] for r in rows if r["method"] == mth and r["keep"] == keep
                             and _bucket(r["n"]) == bucket])
                if st:
                    pts.append((keep, st["mean"], st["se"] or 0))
            if pts:
                k, m, e = zip(*pts)
                ax.errorbar(k, m, yerr=e, marker="o" if "/" not in mth else "x", capsize=3, label=mth,
                            ls="-" if "/" not in mth else ":", color=f"C{(METHODS + CONTIG).index(mth)}")
        n = len({r["prompt"] for r in rows if _bucket(r["n"]) == bucket})
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"prompts of {bucket} tokens ({n})")
        ax.set_xlabel("keep ratio")
    axes[0][0].set_ylabel("log-lik. change of the full-prompt answer (nats/token)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":  # the CLI's options plus the time bound and long-context count
    import argparse
    import shlex

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--per-length", type=int, default=1)
    ap.add_argument("--per-length-long", type=int, default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-s", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/refine.json")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--merge", action="store_true",
                    help="write bench/results/refine.md and refine.png from every bench/results/refine*.json")
    a = ap.parse_args()
    if a.merge:
        res = Path(__file__).resolve().parent / "results"
        files = sorted(res.glob("refine*.json"))
        rows = [{**r, "prompt": f"{i}:{r['prompt']}"} for i, p in enumerate(files) for r in json.loads(p.read_text())["rows"]]
        summ = summarize(rows)
        (res / "refine.md").write_text(
            f"Merged from {', '.join(p.name for p in files)} (`python bench/refine.py --merge`); their commands:\n\n"
            + "".join(f"- `{json.loads(p.read_text())['command']}`\n" for p in files) + "\n" + markdown_table(summ)
            + f"\nREFINE_BY_LENGTH = {refine_table(summ)}\n")
        _plot(rows, res / "refine.png")
        print((res / "refine.md").read_text())
        sys.exit(0)
    r = bench_refine([int(x) for x in a.lengths.split(",") if x.strip()], a.per_length, seed=a.seed, out=a.out,
                     plot=str(Path(a.out).with_suffix(".png")), workers=a.workers, max_s=a.max_s,
                     per_length_long=a.per_length_long, methods=tuple(a.methods.split(",")),
                     ratios=tuple(float(x) for x in a.ratios.split(",")), command=shlex.join(["python", "bench/refine.py", *sys.argv[1:]]))
    print(json.dumps({k: v for k, v in r["summary"].items()}, indent=1)[:4000])
