"""MODEL, not a run: what bounds the split / cloud-only goodput ratio, from the costs a goodput run
measured (`bench/goodput.py`), and the ratio the same costs give under another workload.

Measured inputs (all from one `run_goodput_bench` result):
* cloud prefill: non-negative least-squares fit of the zero-load TTFT of the pool's prompts (one request at a
  time, the reference pass) against their length: base ms + ms/token (its inverse: prefill tokens/s);
* cloud CPU per request: each rate point's cloud process CPU seconds (`cloud_cpu_s`) over its
  requests, and from it the CPU per streamed cloud token once the prompt's prefill is taken off:
  (cpu/request - prefill(P)) / cloud tokens per request, the decode cost per token at that point's
  batch (a decode step of B streams costs about a + c*B, so a token costs c + a/B);
* cloud decode step against the requests the cloud held (`cloud_step_ms_p50` against
  `cloud_concurrency`, the cloud-only points);
* the device profile (a, b, d) and the answer / cloud tokens per request of each mode.

The occupancy model: one cloud core serves every request's prefill (P tokens at p ms/token) and
its n streamed tokens (A, the whole answer, cloud-only; h, up to the hand-off, split) at k ms of CPU
per token, so at full use it sustains 1 / (P*p + n*k) requests/s, and the goodput ratio of two
modes bounded by the same core is at most

    ratio = (P*p + A*k_cloud_only) / (P*p + h*k_split).

It is the goodput ratio when both modes are bound by the cloud's compute (a cloud-only mode bound
earlier by its TPOT SLO, its batch unable to grow past the step time the SLO allows, does worse and
the ratio is higher), and it says why a large ratio needs answers long against the hand-off index
(A/h) and a prefill that is a small part of the cloud's work (P*p small against A*k). The costs of
each mode are read at its busiest clean point (the highest rate whose requests all completed, none
refused: the largest batch it reached, so the cheapest token). The paper-like workload: the same model and costs, a short prompt and
long answers with the hand-off index the phone's plan gives for them (`settings.catch_up` on the
plan of `virtual.plan_for`, cloud TTFT and TPOT as measured at zero load).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def prefill_fit(pool: list[dict]) -> tuple[float, float]:
    """(base ms, ms/token), both >= 0 (`settings.cost_line`), of the zero-load TTFT against the prompt
    length over `pool` (dicts with 'prompt_tokens', 'zero_load_ttft_ms'; >= 2 distinct lengths).
    Raises ValueError otherwise."""
    from relayinfer.device.settings import cost_line

    xs = [p["prompt_tokens"] for p in pool]
    if len(set(xs)) < 2:
        raise ValueError("the prefill fit needs prompts of at least two lengths")
    return cost_line(xs, [p["zero_load_ttft_ms"] for p in pool])


def occupancy_ratio(prompt_tokens: float, prefill_ms_per_token: float, answer_tokens: float, k_cloud_only_ms: float,
                    handoff_tokens: float, k_split_ms: float) -> float:
    """(P*p + A*k_co) / (P*p + h*k_split): the split / cloud-only ratio of the cloud's CPU per
    request (see the module docstring; tokens, ms/token)."""
    pp = prompt_tokens * prefill_ms_per_token
    return (pp + answer_tokens * k_cloud_only_ms) / (pp + handoff_tokens * k_split_ms)


def _points(res: dict, mode: str) -> list[dict]:
    return [p for p in res["sweeps"][mode]["points"] if p.get("cloud_cpu_s") and p["requests"]]


def model(res: dict, paper_prompt_tokens: int = 64, paper_answer_tokens: int = 512, target_tpot_ms: float | None = None,
          profile: str | None = None) -> dict:
    """The model's figures for a goodput result `res` (see the module docstring): measured costs,
    per point the CPU per request and per cloud token, the occupancy bound on the ratio for the run's
    own workload, and the ratio under the paper-like workload (`paper_prompt_tokens`,
    `paper_answer_tokens`)."""
    from relayinfer.device.profiles import load_profile
    from relayinfer.device.settings import CloudEstimate, Timing, catch_up
    from relayinfer.device.virtual import plan_for

    base, p_ms = prefill_fit(res["pool"])
    prof = load_profile(profile or res["profiles"][0])
    target = target_tpot_ms or res.get("target_tpot_ms", 50.0)
    split_mode = f"split {prof.name}"
    prompt_mean = float(np.mean([q["prompt_tokens"] for q in res["pool"]]))
    per_point = {}
    for mode in ("cloud-only", split_mode):
        rows = []
        for pt in _points(res, mode):
            cpu_req = pt["cloud_cpu_s"] * 1e3 / pt["requests"]
            tok = pt.get("cloud_tokens_mean") or 0.0
            k = (cpu_req - prompt_mean * p_ms) / tok if tok else None
            rows.append({"rate_rps": pt["offered_rps"], "cpu_ms_per_request": cpu_req, "cloud_tokens": tok,
                         "cpu_ms_per_cloud_token": k, "held": pt.get("cloud_concurrency"),
                         "step_ms_p50": pt.get("cloud_step_ms_p50"), "cpu_busy": pt.get("cloud_cpu_busy")})
        per_point[mode] = rows
    # the costs at each mode's busiest clean point (its largest batch: the cheapest token it reached)
    busiest = {}
    for m, rows in per_point.items():
        clean = [r for r, pt in zip(rows, _points(res, m)) if pt["ok"] == pt["measured"] and not pt.get("errors")]
        if clean or rows:
            busiest[m] = max(clean or rows, key=lambda r: r["rate_rps"])
    out: dict = {"what": "MODEL (occupancy of one cloud core; inputs measured in this run)",
                 "prefill_base_ms": base, "prefill_ms_per_token": p_ms,
                 "prefill_tokens_per_s": 1e3 / p_ms if p_ms > 0 else None,
                 "device": {"name": prof.name, "prefill_ms_per_token": prof.prefill_ms_per_token,
                            "prefill_ms_base": prof.prefill_ms_base, "decode_ms_per_token": prof.decode_ms_per_token},
                 "prompt_tokens_mean": prompt_mean, "per_point": per_point,
                 "step_vs_held": [(r["held"], r["step_ms_p50"]) for r in per_point.get("cloud-only", [])
                                  if r["held"] is not None and r["step_ms_p50"] is not None]}
    if "cloud-only" not in busiest or split_mode not in busiest:
        return out
    co, sp = busiest["cloud-only"], busiest[split_mode]
    measured_ratio = co["cpu_ms_per_request"] / sp["cpu_ms_per_request"]
    answer = co["cloud_tokens"]
    free_prefill = occupancy_ratio(prompt_mean, 0.0, answer, co["cpu_ms_per_cloud_token"], sp["cloud_tokens"],
                                   sp["cpu_ms_per_cloud_token"])
    # the paper-like workload: the phone's plan and hand-off on a short prompt with a long answer, the cloud as
    # measured at zero load (TTFT fit, single-stream step)
    steps = [q["zero_load_cloud_step_ms"] for q in res["pool"] if q.get("zero_load_cloud_step_ms")]
    tpot = float(np.median(steps)) if steps else 50.0
    est = CloudEstimate(ttft_base_ms=base, prefill_ms_per_token=p_ms, tpot_ms=tpot)
    t, pl = plan_for(prof, paper_prompt_tokens, paper_answer_tokens, target, cloud=est)
    h = catch_up(t, paper_prompt_tokens, pl.budget)[0] if pl.budget is not None else paper_answer_tokens
    paper = occupancy_ratio(paper_prompt_tokens, p_ms, paper_answer_tokens, co["cpu_ms_per_cloud_token"], h,
                            sp["cpu_ms_per_cloud_token"])
    out.update(
        at={"cloud-only": co, split_mode: sp},
        measured_cpu_ratio=measured_ratio,
        run_workload={"prompt_tokens": prompt_mean, "answer_tokens": answer, "handoff_tokens": sp["cloud_tokens"],
                      "ratio_free_prefill": free_prefill},
        paper_like={"prompt_tokens": paper_prompt_tokens, "answer_tokens": paper_answer_tokens, "budget": pl.budget,
                    "handoff_tokens": h, "cloud_ttft_ms": est.ttft_ms(paper_prompt_tokens), "cloud_tpot_ms": tpot,
                    "ratio": paper})
    return out


def markdown(m: dict) -> str:
    """The model's section of the goodput table (labelled MODEL)."""
    f = lambda x, p=0: "-" if x is None else f"{x:,.{p}f}"  # noqa: E731
    how = f"`{m['command']}`" if m.get("command") else "`bench/goodput_model.py`"
    lines = ["", f"MODEL (not a run; {how}, inputs measured in this run): cloud prefill "
             f"{f(m['prefill_tokens_per_s'])} tokens/s ({f(m['prefill_ms_per_token'], 2)} ms/token + "
             f"{f(m['prefill_base_ms'])} ms, fit of the zero-load TTFT); device {m['device']['name']}: prefill "
             f"{f(m['device']['prefill_ms_per_token'], 2)} ms/token, decode {f(m['device']['decode_ms_per_token'], 1)} "
             "ms/token.", "",
             "| mode, rate | cloud CPU ms/request | cloud tokens/request | CPU ms per cloud token (prefill off) | held | step ms p50 |",
             "|---|---|---|---|---|---|"]
    for mode, rows in m["per_point"].items():
        for r in rows:
            lines.append(f"| {mode}, {r['rate_rps']:g} rps | {f(r['cpu_ms_per_request'])} | {f(r['cloud_tokens'], 1)} | "
                         f"{f(r['cpu_ms_per_cloud_token'], 1)} | {f(r['held'], 1)} | {f(r['step_ms_p50'])} |")
    if "run_workload" in m:
        w, pl = m["run_workload"], m["paper_like"]
        at = m["at"]
        lines += ["", "Cloud CPU per request, cloud-only / split, each at its busiest clean point ("
                  + ", ".join(f"{k} {v['rate_rps']:g} rps" for k, v in at.items()) +
                  f"): **{m['measured_cpu_ratio']:.1f}x** (measured; the goodput ratio if both modes were bound by the "
                  f"cloud's compute; workload P {w['prompt_tokens']:.0f}, A {w['answer_tokens']:.0f}, "
                  f"h {w['handoff_tokens']:.1f} tokens). With a free prefill (MODEL): {w['ratio_free_prefill']:.1f}x. "
                  f"Paper-like workload (MODEL: prompt {pl['prompt_tokens']}, answer {pl['answer_tokens']} tokens, "
                  f"the phone's plan: budget {pl['budget']}, hand-off at {pl['handoff_tokens']}, same costs): "
                  f"**{pl['ratio']:.1f}x**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    """`python -m bench.goodput_model RESULT.json`: add the model ('model') to a goodput result and
    rewrite its .md beside it."""
    from bench.goodput import markdown as table

    path = Path(argv[0] if argv else "bench/results/goodput.json")
    res = json.loads(path.read_text())
    res["model"] = model(res)
    res["model"]["command"] = f"python -m bench.goodput_model {path}"
    path.write_text(json.dumps(res, indent=1))
    path.with_suffix(".md").write_text(table(res))


if __name__ == "__main__":
    main(sys.argv[1:])
