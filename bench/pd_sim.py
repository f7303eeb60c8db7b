"""SIMULATED: discrete-event simulation of P/D serving with 8-64 instances, driven by timings
measured on this machine (`bench/results/pd-perf.json`: the real engine's prefill tokens/s and
decode step time by batch size; `pd-transfer.json`: the real contiguous / block-fixed KV hand-off
time per token). Nothing here runs a model; every latency comes from those fits.

Model of one instance (the engine's own scheduling rules): continuous batching, a step runs every
running decode (one token each) plus prefill chunks up to the step's token budget (Sarathi chunked
prefill); step time = a + c * decodes + prefill_tokens / prefill_tok_s. An aggregated instance mixes
both (prefill chunks stretch every decode step in the batch); a prefill instance runs only prompts
and hands the KV over (transfer time per token from the real measurement); a decode instance runs
only decodes.

Systems with the same number of instances N:
* `aggregated`: N engines, each request to the one with the fewest requests (fresh state).
* `pd-static`: one P/D pool for all requests, one ratio (the analytic model's best for the mixed
  workload), on-demand forwarding.
* `pd-grouped`: one P/D group per scenario (chitchat, long-context), instances split by the groups'
  load, each group starting at the analytic best ratio, the ratio controller (`Hysteresis`, the same
  rule as `cloud/pd/ratio.py`) moving instances between P and D every 5 s of simulated time.
Forwarding: `on-demand` (a prefill instance accepts only if its own queue lets it start within the
remaining TTFT budget, else rejects; the gateway tries the next, backs off after a full round (10 ms,
doubling up to 200 ms),
and forces the shortest wait when the budget is spent) vs `push` (the shortest queue as reported
every `report_s`, stale in between).

Workloads: token lengths from chitchat-dataset conversations, tokenized with the model's tokenizer
and chat template: chitchat = one conversation up to a user turn (answer = the real next turn's
length); long-context = several conversations concatenated as context, 2-6k tokens, short answers.
Arrivals Poisson or Gamma with CV 4 (bursty).
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayinfer.cloud.pd.ratio import Hysteresis, PerfModel, Workload, best_ratio, decode_capacity, prefill_capacity  # noqa: E402


# --- workloads -------------------------------------------------------------------------------------

def real_lengths(n_chat: int = 600, n_long: int = 300, seed: int = 0) -> dict:
    """(prompt, output) token lengths of real chitchat conversations and long contexts made of them."""
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import _chitchat, chitchat_messages

    tok = Tokenizer.from_gguf(None)
    convs = _chitchat()
    rng = random.Random(seed)
    chat, answers, texts = [], [], []
    while len(chat) < n_chat:
        msgs = chitchat_messages(convs[rng.randrange(len(convs))])
        full = convs[rng.randrange(len(convs))]["messages"]
        if not msgs:
            continue
        k = rng.randrange(1, len(msgs) + 1)
        cut = msgs[:k]
        while cut and cut[-1]["role"] != "user":
            cut.pop()
        if not cut:
            continue
        ids = tok.encode_chat(cut)
        nxt = msgs[len(cut)] if len(cut) < len(msgs) else None
        out = len(tok.encode(nxt["content"])) + 1 if nxt else len(tok.encode(" ".join(m["text"] for m in full[-1])))
        chat.append((len(ids), max(2, min(out, 256))))
        answers.append(max(2, min(out, 64)))
        texts.append(" ".join(m["content"] for m in msgs))
    longs = []
    while len(longs) < n_long:
        target = rng.uniform(2000, 6000)
        parts, n = [], 0
        while n < target:
            t = texts[rng.randrange(len(texts))]
            parts.append(t)
            n += len(tok.encode(t)) + 2
        ids = tok.encode_chat([{"role": "user", "content": "Here are some conversations:\n" + "\n\n".join(parts)
                                + "\nSummarise them in one sentence."}])
        if len(ids) <= 6000:
            longs.append((len(ids), answers[rng.randrange(len(answers))]))
    return {"chat": chat, "long": longs}


def arrivals(rate: float, duration: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s): Poisson (cv 1) or Gamma inter-arrivals with coefficient of variation `cv`."""
    n = int(rate * duration * 1.5) + 10
    if cv == 1.0:
        gaps = rng.exponential(1 / rate, n)
    else:
        k = 1 / cv ** 2
        gaps = rng.gamma(k, 1 / (rate * k), n)
    t = np.cumsum(gaps)
    return t[t < duration]


# --- the simulated engine ---------------------------------------------------------------------------

@dataclass
class Req:
    rid: int
    scen: str
    arrival: float
    prompt: int
    output: int
    left_prefill: int = 0
    first: float | None = None
    done: float | None = None
    made: int = 0

    def tpot(self) -> float:
        return 0.0 if self.output <= 1 or self.done is None else (self.done - self.first) / (self.output - 1)


@dataclass
class Inst:
    name: str
    role: str                    # aggregated / prefill / decode
    group: str
    queue: list = field(default_factory=list)    # Reqs waiting or in prefill (FIFO)
    running: list = field(default_factory=list)  # Reqs decoding
    busy: bool = False
    queued_tokens: int = 0


class Sim:
    """One run: `system` in aggregated / pd-static / pd-grouped, `forwarding` on-demand / push."""

    def __init__(self, perf: dict, n: int, system: str, forwarding: str, slos: dict, split: dict | None = None,
                 report_s: float = 1.0, budget: int = 512, max_batch: int = 64, controller: bool = True,
                 transfer_mode: str = "contiguous"):
        self.p = perf
        self.slos, self.system, self.forwarding = slos, system, forwarding
        self.report_s, self.budget, self.max_batch = report_s, budget, max_batch
        self.events: list = []
        self.seq = itertools.count()
        self.insts: list[Inst] = []
        self.groups: dict[str, dict] = {}
        self.controller = controller and system == "pd-grouped"
        self.moves: list = []
        self.xfer_ms_tok = perf["transfer_ms_per_token"][transfer_mode]
        if system == "aggregated":
            self.insts = [Inst(f"a{i}", "aggregated", "all") for i in range(n)]
        else:
            for g, (n_p, n_d) in split.items():
                ps = [Inst(f"{g}-p{i}", "prefill", g) for i in range(n_p)]
                ds = [Inst(f"{g}-d{i}", "decode", g) for i in range(n_d)]
                self.insts += ps + ds
                self.groups[g] = {"rule": Hysteresis(patience=2, cooldown_s=10.0), "ttft": [], "tpot": []}
        self.reports = {i.name: 0 for i in self.insts}
        self.rr = itertools.count()
        self.decode_load = {i.name: 0 for i in self.insts}
        self.rejections = self.offers = self.forced = 0

    # -- helpers
    def at(self, t: float, kind: str, *a) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, a))

    def step_s(self, n_dec: int, n_pre: int) -> float:
        p = self.p
        return (p["decode_a_ms"] + p["decode_c_ms"] * n_dec) / 1e3 + n_pre / p["prefill_tok_s"]

    def est_wait_s(self, inst: Inst, n: int) -> float:
        return (inst.queued_tokens + n) / self.p["prefill_tok_s"] + self.p["decode_a_ms"] / 1e3

    def group_of(self, r: Req) -> str:
        return r.scen if self.system == "pd-grouped" else "all"

    def pool(self, group: str, role: str) -> list[Inst]:
        return [i for i in self.insts if i.role == role and (self.system != "pd-grouped" or i.group == group)]

    # -- routing
    def arrive(self, t: float, r: Req) -> None:
        if self.system == "aggregated":
            inst = min(self.insts, key=lambda i: len(i.queue) + len(i.running))
            return self.enqueue(t, inst, r)
        self.offer_round(t, r, t)

    def offer_round(self, t: float, r: Req, t0: float, backoff: float = 0.01) -> None:
        pool = self.pool(self.group_of(r), "prefill")
        slo = self.slos[r.scen]["ttft_s"]
        if self.forwarding == "push":
            k = next(self.rr)
            inst = min(pool, key=lambda i: (self.reports[i.name], (pool.index(i) - k) % len(pool)))
            self.offers += 1
            return self.enqueue(t + 0.0005, inst, r)
        k = next(self.rr) % len(pool)
        order = pool[k:] + pool[:k]
        tt = t
        for inst in order:  # each offer is one round trip (0.5 ms); the instance answers from its own state
            tt += 0.0005
            self.offers += 1
            if self.est_wait_s(inst, r.prompt) <= slo - (tt - r.arrival):
                return self.enqueue(tt, inst, r)
            self.rejections += 1
        if tt + backoff - r.arrival >= slo:
            self.forced += 1
            return self.enqueue(tt, min(pool, key=lambda i: i.queued_tokens), r)
        self.at(tt + backoff, "retry", r, t0, min(2 * backoff, 0.2))  # exponential back-off, as the gateway

    def enqueue(self, t: float, inst: Inst, r: Req) -> None:
        r.left_prefill = r.prompt
        inst.queue.append(r)
        inst.queued_tokens += r.prompt
        self.kick(t, inst)

    def kick(self, t: float, inst: Inst) -> None:
        if not inst.busy and (inst.queue or inst.running):
            inst.busy = True
            self.plan(t, inst)

    def plan(self, t: float, inst: Inst) -> None:
        dec = inst.running[: self.max_batch]
        left = self.budget - len(dec)
        chunks = []
        for r in inst.queue:
            if left <= 0:
                break
            c = min(r.left_prefill, left)
            chunks.append((r, c))
            left -= c
        n_pre = sum(c for _, c in chunks)
        self.at(t + self.step_s(len(dec), n_pre), "step", inst, dec, chunks)

    def finish_step(self, t: float, inst: Inst, dec: list, chunks: list) -> None:
        for r in dec:
            r.made += 1
            if r.made >= r.output:
                r.done = t
                inst.running.remove(r)
                self.decode_load[inst.name] -= 1
                self.record(r)
        for r, c in chunks:
            r.left_prefill -= c
            inst.queued_tokens -= c
            if r.left_prefill == 0:
                inst.queue.remove(r)
                r.first, r.made = t, 1
                if r.output <= 1:
                    r.done = t
                    self.record(r)
                elif inst.role == "aggregated":
                    inst.running.append(r)
                    self.decode_load[inst.name] += 1
                else:  # KV hand-off to the group's least loaded decode instance
                    pool = self.pool(self.group_of(r), "decode")
                    d = min(pool, key=lambda i: self.decode_load[i.name])
                    self.decode_load[d.name] += 1
                    self.at(t + r.prompt * self.xfer_ms_tok / 1e3, "admit", d, r)
        inst.busy = False
        self.kick(t, inst)

    def record(self, r: Req) -> None:
        if self.controller:
            g = self.groups[r.scen]
            g["ttft"].append((r.first - r.arrival) * 1e3)
            if r.output > 1:
                g["tpot"].append(r.tpot() * 1e3)

    def control(self, t: float) -> None:
        for name, g in self.groups.items():
            ttft = float(np.percentile(g["ttft"], 90)) if g["ttft"] else None
            tpot = float(np.percentile(g["tpot"], 90)) if g["tpot"] else None
            g["ttft"], g["tpot"] = [], []
            ps, ds = self.pool(name, "prefill"), self.pool(name, "decode")
            slo = self.slos[name]
            move = g["rule"].observe(t, ttft, tpot, slo["ttft_s"] * 1e3, slo["tpot_s"] * 1e3, len(ps), len(ds))
            if move == "to_prefill":
                inst = min(ds, key=lambda i: self.decode_load[i.name])
            elif move == "to_decode":
                inst = min(ps, key=lambda i: i.queued_tokens)
            else:
                continue
            inst.role = "prefill" if move == "to_prefill" else "decode"
            self.moves.append({"t": round(t, 2), "group": name, "instance": inst.name, "to": inst.role,
                               "ratio": f"{len(self.pool(name, 'prefill'))}P:{len(self.pool(name, 'decode'))}D"})

    def run(self, reqs: list[Req], duration: float) -> dict:
        for r in reqs:
            self.at(r.arrival, "arrive", r)
        t = 0.0
        while t < duration:
            t += self.report_s
            self.at(t, "report")
            if self.controller and int(t / self.report_s) % max(1, int(5.0 / self.report_s)) == 0:
                self.at(t, "control")
        horizon = duration * 4 + 60
        while self.events:
            t, _, kind, a = heapq.heappop(self.events)
            if t > horizon:
                break
            if kind == "arrive":
                self.arrive(t, a[0])
            elif kind == "retry":
                self.offer_round(t, *a)
            elif kind == "step":
                self.finish_step(t, *a)
            elif kind == "admit":
                d, r = a
                d.running.append(r)
                self.kick(t, d)
            elif kind == "report":
                self.reports = {i.name: i.queued_tokens for i in self.insts}
            elif kind == "control":
                self.control(t)
        return self.metrics(reqs, duration)

    def metrics(self, reqs: list[Req], duration: float) -> dict:
        ok_ttft = ok_both = 0
        for r in reqs:
            s = self.slos[r.scen]
            good_ttft = r.first is not None and r.first - r.arrival <= s["ttft_s"]
            good = good_ttft and r.done is not None and r.tpot() <= s["tpot_s"]
            ok_ttft += good_ttft
            ok_both += good
        n = max(1, len(reqs))
        return {"requests": len(reqs), "ttft_attainment": ok_ttft / n, "slo_attainment": ok_both / n,
                "goodput_rps": ok_both / duration, "offers": self.offers, "rejections": self.rejections,
                "forced": self.forced, "moves": len(self.moves)}


# --- experiments ------------------------------------------------------------------------------------

def make_reqs(lengths: dict, rate: float, duration: float, cv: float, share_long: float, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(arrivals(rate, duration, cv, rng)):
        scen = "long" if rng.random() < share_long else "chat"
        p, o = lengths[scen][rng.integers(len(lengths[scen]))]
        out.append(Req(i, scen, float(t), int(p), int(o)))
    return out


def plan_split(n: int, perf: dict, slos: dict, lengths: dict, share_long: float, system: str) -> dict:
    """Instances per group and role: the analytic model (`cloud/pd/ratio.py`)."""
    pm = PerfModel(perf["prefill_tok_s"], perf["decode_a_ms"], perf["decode_c_ms"],
                   perf["transfer_ms_per_token"]["contiguous"])
    w = {s: Workload(float(np.mean([p for p, _ in lengths[s]])), float(np.mean([o for _, o in lengths[s]])),
                     slos[s]["ttft_s"] * 1e3, slos[s]["tpot_s"] * 1e3) for s in ("chat", "long")}
    share = {"chat": 1 - share_long, "long": share_long}
    if system == "pd-static":  # one pool, one ratio for the mixed workload (its tighter SLOs)
        mix = Workload(sum(share[s] * w[s].mean_prompt_tokens for s in w), sum(share[s] * w[s].mean_output_tokens
                       for s in w), min(w[s].ttft_slo_ms for s in w) * 0 + sum(share[s] * w[s].ttft_slo_ms for s in w),
                       min(w[s].tpot_slo_ms for s in w))
        n_p, n_d, _ = best_ratio(n, mix, pm)
        return {"all": (n_p, n_d)}
    # groups sized so that both reach their capacity at the same total rate
    best = None
    for n_long in range(2, n - 1):
        caps = {}
        for s, k in (("chat", n - n_long), ("long", n_long)):
            n_p, n_d, cap = best_ratio(k, w[s], pm)
            caps[s] = (n_p, n_d, cap / max(share[s], 1e-9))
        total = min(c[2] for c in caps.values())
        if best is None or total > best[0]:
            best = (total, {s: caps[s][:2] for s in caps})
    return best[1]


def goodput_curve(lengths, perf, slos, n, system, forwarding, cv, share_long, rates, duration, seed):
    rows = []
    split = None if system == "aggregated" else plan_split(n, perf, slos, lengths, share_long, system)
    for rate in rates:
        reqs = make_reqs(lengths, rate, duration, cv, share_long, seed)
        sim = Sim(perf, n, system, forwarding, slos, split)
        m = sim.run(reqs, duration)
        rows.append({"rate": round(rate, 3), **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}})
    return {"split": split, "rows": rows}


def max_rate(rows, key="slo_attainment", target=0.9) -> float:
    """The highest offered rate whose attainment is >= target (linear interpolation between points)."""
    best = 0.0
    for a, b in zip(rows, rows[1:]):
        if a[key] >= target:
            best = a["rate"]
            if b[key] < target:
                best = a["rate"] + (b["rate"] - a["rate"]) * (a[key] - target) / max(a[key] - b[key], 1e-9)
                return best
    if rows and rows[-1][key] >= target:
        best = rows[-1]["rate"]
    return best


def load_inputs(out: Path) -> dict:
    perf = json.loads((out / "pd-perf.json").read_text())
    tr = json.loads((out / "pd-transfer.json").read_text())
    per_tok = {}
    for mode in ("contiguous", "block-fixed"):
        rows = [r for r in tr["rows"] if r["mode"] == mode]
        per_tok[mode] = float(np.median([r["cpu_ms"] / r["tokens"] for r in rows]))  # CPU time, as pd-perf
    return {**perf["fit"], "transfer_ms_per_token": per_tok}


def run_all(out: Path, quick: bool = False, seed: int = 0) -> dict:
    perf = load_inputs(out)
    lengths = real_lengths(300 if quick else 600, 150 if quick else 300, seed)
    chat_p = float(np.mean([p for p, _ in lengths["chat"]]))
    long_p = float(np.mean([p for p, _ in lengths["long"]]))
    step8 = perf["decode_a_ms"] + 8 * perf["decode_c_ms"]
    # SLOs scaled to this machine's measured speed (the paper's absolute SLOs are for NPUs): TTFT twice
    # the prefill time of the scenario's 95th-percentile prompt, TPOT twice a decode step of batch 8
    p95 = {s: float(np.percentile([p for p, _ in lengths[s]], 95)) for s in lengths}
    slos = {s: {"ttft_s": round(2 * p95[s] / perf["prefill_tok_s"] + perf["decode_a_ms"] / 1e3, 3),
                "tpot_s": round(2.0 * step8 / 1e3, 3)} for s in ("chat", "long")}
    share_long = 0.2
    sizes = (8, 16) if quick else (8, 16, 32, 64)
    duration = 60.0
    res = {"what": "SIMULATED (discrete-event) with timings measured here: pd-perf.json (engine), pd-transfer.json "
                   "(KV hand-off); request lengths from real chitchat-dataset conversations",
           "perf": perf, "slos": slos, "share_long": share_long, "duration_s": duration,
           "mean_prompt": {"chat": chat_p, "long": long_p},
           "mean_output": {s: float(np.mean([o for _, o in lengths[s]])) for s in lengths}, "goodput": {}, "forwarding": {}}
    summary = {"goodput_ratio_grouped_over_aggregated": {}, "goodput_ratio_static_over_aggregated": {}}
    pm = PerfModel(perf["prefill_tok_s"], perf["decode_a_ms"], perf["decode_c_ms"])
    for n in sizes:
        # rates around the analytic capacity of n instances
        cap = min(prefill_capacity(n // 2, Workload(chat_p, 40, slos["chat"]["ttft_s"] * 1e3, slos["chat"]["tpot_s"] * 1e3), pm),
                  decode_capacity(n // 2, Workload(chat_p, 40, slos["chat"]["ttft_s"] * 1e3, slos["chat"]["tpot_s"] * 1e3), pm))
        rates = list(np.linspace(0.1, 1.6, 7) * max(cap, 0.5))
        for cv in (1.0, 4.0):
            key = f"n{n}-cv{cv:g}"
            res["goodput"][key] = {}
            for system in ("aggregated", "pd-static", "pd-grouped"):
                c = goodput_curve(lengths, perf, slos, n, system, "on-demand", cv, share_long, rates, duration, seed)
                c["max_rate_at_90pct"] = round(max_rate(c["rows"]), 3)
                res["goodput"][key][system] = c
                print(f"sim {key} {system:10s} split {c['split']} max rate at 90% SLO {c['max_rate_at_90pct']:.2f} req/s",
                      flush=True)
            g = res["goodput"][key]
            base = g["aggregated"]["max_rate_at_90pct"]
            summary["goodput_ratio_grouped_over_aggregated"][key] = round(g["pd-grouped"]["max_rate_at_90pct"] / base, 3) if base else None
            summary["goodput_ratio_static_over_aggregated"][key] = round(g["pd-static"]["max_rate_at_90pct"] / base, 3) if base else None
            res["summary"] = summary
            (out / "pd-sim.partial.json").write_text(json.dumps(res, indent=1))  # survives an interrupted run
    # forwarding: on-demand vs push on the chat group alone, bursty arrivals, stale reports
    fw_summary = {}
    for n in (sizes if quick else (8, 32, 64)):
        key = f"n{n}"
        w = Workload(chat_p, 40, slos["chat"]["ttft_s"] * 1e3, slos["chat"]["tpot_s"] * 1e3)
        n_p, n_d, cap = best_ratio(n, w, pm)
        rates = list(np.linspace(0.2, 1.4, 7) * max(cap, 0.5))
        curves = {}
        for fw in ("push", "on-demand"):
            rows = []
            for rate in rates:
                reqs = make_reqs(lengths, rate, duration, 4.0, 0.0, seed)
                m = Sim(perf, n, "pd-static", fw, slos, {"all": (n_p, n_d)}).run(reqs, duration)
                rows.append({"rate": round(rate, 3), **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}})
            curves[fw] = rows
        # the first rate where push falls below 90 % TTFT-SLO attainment
        at = next((i for i, r in enumerate(curves["push"]) if r["ttft_attainment"] < 0.9), None)
        entry = {"split": (n_p, n_d), "curves": curves}
        if at is not None:
            p, o = curves["push"][at], curves["on-demand"][at]
            entry.update({"rate": p["rate"], "push_ttft_attainment": p["ttft_attainment"],
                          "on_demand_ttft_attainment": o["ttft_attainment"],
                          "ratio": round(o["ttft_attainment"] / max(p["ttft_attainment"], 1e-9), 3)})
            fw_summary[key] = entry["ratio"]
            print(f"forwarding {key}: at {p['rate']:.2f} req/s push {p['ttft_attainment']:.3f} on-demand "
                  f"{o['ttft_attainment']:.3f} -> {entry['ratio']:.2f}x", flush=True)
        res["forwarding"][key] = entry
        (out / "pd-sim.partial.json").write_text(json.dumps(res, indent=1))
    summary["forwarding_ttft_attainment_ratio"] = fw_summary
    res["summary"] = summary
    plot(res, out)
    return res


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["goodput"])
    fig, axes = plt.subplots(2, len(keys) // 2 + len(keys) % 2, figsize=(4 * (len(keys) // 2 + 1), 7), squeeze=False)
    for ax, key in zip(axes.T.flatten(), keys):
        for system, c in res["goodput"][key].items():
            ax.plot([r["rate"] for r in c["rows"]], [r["slo_attainment"] for r in c["rows"]], marker=".", label=system)
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.set_title(f"{key} (simulated)", fontsize=9)
        ax.set_xlabel("offered rate (req/s)", fontsize=8)
        ax.set_ylabel("SLO attainment", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pd-sim-goodput.png", dpi=110)
    plt.close(fig)
    fw = res["forwarding"]
    fig, axes = plt.subplots(1, len(fw), figsize=(4 * len(fw), 3.2), squeeze=False)
    for ax, (key, e) in zip(axes[0], fw.items()):
        for name, rows in e["curves"].items():
            ax.plot([r["rate"] for r in rows], [r["ttft_attainment"] for r in rows], marker=".", label=name)
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.set_title(f"{key} chat, Gamma CV 4 (simulated)", fontsize=9)
        ax.set_xlabel("offered rate (req/s)", fontsize=8)
        ax.set_ylabel("TTFT-SLO attainment", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pd-sim-forwarding.png", dpi=110)
    plt.close(fig)
