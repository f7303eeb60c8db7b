"""Fast checks of the split benchmark's metrics (no model)."""
from __future__ import annotations

import pytest

from relayinfer.sdk.cli import bench_module

_split = bench_module("split")  # the driver lives in bench/, importing the library
_refine_saving, lcs_len, rouge_l = _split._refine_saving, _split.lcs_len, _split.rouge_l


def test_lcs_and_rouge_l():
    assert lcs_len([1, 2, 3, 4], [1, 3, 4, 5]) == 3
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0 and rouge_l([1, 2], [3, 4]) == 0.0 and rouge_l([], [1]) == 0.0
    # P = 3/4, R = 3/4 -> F = 0.75
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)


def test_refine_saving_uses_prompts_where_both_handed_off():
    row = lambda m, i, ms, n: {"bench_mode": m, "prompt_idx": i, "device_prefill_ms": ms,  # noqa: E731
                               "device_prompt_tokens": n, "prompt_tokens": 100}
    rows = [row("split", 0, 1000.0, 100), row("split+refine", 0, 600.0, 50),
            row("split", 1, 0.0, 100), row("split+refine", 1, 500.0, 50)]  # prompt 1: split never handed off
    s = _refine_saving(rows)
    assert s["prompts"] == 1 and s["prefill_ms_saving"] == pytest.approx(0.4) and s["prompt_token_saving"] == 0.5
    assert _refine_saving(rows[2:]) is None


def test_bucket_summary_counts_handoffs_fallbacks_and_ratios():
    def row(mode, n, result, ttft, fault=None, shown=(0.0, 100.0, 180.0)):
        return {"profile": "phone", "bench_mode": mode, "prompt_tokens": n, "mode": result, "ttft_ms": ttft,
                "fault": fault, "plan": "split", "plan_reason": "", "token_ids": [1] * len(shown), "cloud_streamed": 2,
                "cloud_tokens": 2, "handoff_index": 2 if result == "split" else None, "interval_ms": 80.0,
                "stalls": 0, "shown_ms": [ttft + s for s in shown], "ready_ms": [ttft + s for s in shown]}

    rows = [row("split", 600, "split", 1000.0), row("split", 1100, "cloud-only", 3000.0),
            row("split", 700, "device-only", 5000.0, fault="connection-lost"), row("split", 100, "split", 400.0),
            row("device-only", 600, "device-only", 10000.0), row("device-only", 1100, "device-only", 20000.0),
            row("cloud-only", 600, "cloud-only", 900.0), row("cloud-only", 1100, "cloud-only", 2900.0)]
    b = _split.bucket_summary(rows, 50.0)
    ge512, ge1024, short = b["phone >=512"], b["phone >=1024"], b["phone <256"]
    assert ge512["requests"] == 3 and ge512["handed_off"] == 1 and ge512["fallbacks"] == 1  # a fallback is not a split
    assert ge512["result_modes"] == {"cloud-only": 1, "device-only": 1, "split": 1}
    assert ge512["ttft_ms_p50"] == 3000.0 and ge512["device_only_ttft_ms_p50"] == 15000.0
    assert ge512["ttft_p50_over_device_only"] == pytest.approx(0.2) and ge512["tpot_ms_max"] == 100.0
    assert ge1024["requests"] == 1 and short["handed_off_fraction"] == 1.0 and "phone 256-511" not in b
    assert ge512["ended_early"] == 0 and ge512["link"] is None
    assert ge512["slow_gaps"]["upstream"] == 0  # no gap over 2 x 50 ms
    # per link: keys and goals carry the link's name; an answer that ended (EOS) inside the planned
    # cloud budget counts as not handed off, and as ended early
    eos = {**row("split", 800, "cloud-only", 2000.0, shown=(0.0, 90.0)), "finish_reason": "eos", "cloud_budget": 150}
    lte = [{**r, "link": "lte"} for r in rows + [eos]]
    bl = _split.bucket_summary(lte, 50.0)
    assert set(bl) == {f"lte {k}" for k in b} and bl["lte phone >=512"]["ended_early"] == 1
    assert bl["lte phone >=512"]["handed_off_fraction"] == 0.25
    goals = _split._goals(bl, None, 50.0, ["lte"])
    assert goals["lte handoff_fraction_ge512"] == {"value": 0.25, "goal": ">= 0.8", "met": False}
    assert goals["lte tpot_max_ge512_ms"]["met"] and goals["lte stalls_ge512"]["met"]


def test_slow_gaps_name_where_each_came_from():
    """Cloud tokens arriving every 120 ms give gaps the speed controller asks for too ('upstream'); a
    token there 150 ms before it was shown is the device's ('device_loop'); a gap after the
    hand-off is the device's own decode. The cloud's send stamps split an upstream gap into the
    cloud's share and the link's."""
    def counts(g: dict) -> dict:
        return {k: g[k] for k in ("upstream", "device_loop", "device_decode", "device_late_ms_max")}

    row = {"ready_ms": [0.0, 120.0, 240.0, 360.0, 560.0], "shown_ms": [0.0, 120.0, 390.0, 510.0, 620.0],
           "handoff_index": 4, "interval_ms": 50.0}
    g = _split.slow_gaps(row, 100.0)
    assert counts(g) == {"upstream": 2, "device_loop": 1, "device_decode": 1, "device_late_ms_max": 150.0}
    assert g["upstream_cloud"] == g["upstream_link"] == 0 and g["upstream_unsplit"] == 2  # no send stamps
    on_time = {**row, "shown_ms": [0.0, 120.0, 240.0, 360.0, 620.0]}
    assert counts(_split.slow_gaps(on_time, 100.0)) == {"upstream": 3, "device_loop": 0, "device_decode": 1,
                                                        "device_late_ms_max": 0.0}
    assert _split.slow_gaps(on_time, 300.0)["upstream"] == 0  # only gaps over the bound count
    # sent 110 ms apart, arrived 120 apart: the cloud's gap; sent 20 ms apart, arrived 120: the link's 100
    # (the stamps are on the cloud's clock, offset by 1,000 ms: only differences count)
    stamped = _split.slow_gaps({**on_time, "cloud_sent_ms": [1000.0, 1110.0, 1130.0, 1240.0]}, 100.0)
    assert (stamped["upstream"], stamped["upstream_cloud"], stamped["upstream_link"]) == (3, 2, 1)
    assert stamped["upstream_link_ms_max"] == pytest.approx(100.0) and stamped["upstream_unsplit"] == 0
    short = _split.slow_gaps({**on_time, "cloud_sent_ms": [1000.0, 1110.0]}, 100.0)  # stamps of 2 of 4 tokens
    assert (short["upstream"], short["upstream_cloud"], short["upstream_link"], short["upstream_unsplit"]) == (3, 1, 0, 2)
    assert _split._gaps_cell(short) == "3 (1 / 0 / 2 unstamped) / 0 (0 ms) / 1"
    # the device's own lateness record (`GenerationResult.late_ms`) decides where there is one: a display
    # the plan slowed to 150 ms shows the 120 ms arrivals late by the recomputation, on time by the record
    slowed = {**row, "shown_ms": [0.0, 150.0, 300.0, 450.0, 620.0], "late_ms": [0.0, 0.0, 0.0, 35.0, 0.0]}
    assert _split.slow_gaps({**slowed, "late_ms": None}, 100.0)["device_loop"] == 3  # against the last 50 ms
    assert counts(_split.slow_gaps(slowed, 100.0)) == {"upstream": 2, "device_loop": 1, "device_decode": 1,
                                                       "device_late_ms_max": 35.0}


def test_gc_pauses_are_recorded_with_their_time_in_the_window():
    """`_GCPauses`: a collection while installed is recorded with its generation and placed in a
    request's window ([start ms since t0, ms, generation]); none outside the window or after exit."""
    import gc
    import time

    with _split._GCPauses(min_ms=0.0) as rec:
        t0 = time.perf_counter()
        junk = [[i] for i in range(200_000)]  # objects for a full collection to walk
        gc.collect()
        t1 = time.perf_counter()
        n = len(rec.pauses)
    gc.collect()  # after exit: not recorded
    del junk
    assert len(rec.pauses) == n
    inside = rec.within(t0, t1)
    assert inside and all(g in (0, 1, 2) for _, _, g in inside)
    full = [p for p in inside if p[2] == 2]
    assert full and 0.0 <= full[-1][0] <= (t1 - t0) * 1e3 and full[-1][1] > 0.0
    assert rec.within(t1 + 1.0, t1 + 2.0) == []
