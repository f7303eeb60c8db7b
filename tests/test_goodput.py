"""Goodput under TTFT and TPOT SLOs (bench/goodput.py): the attainment and goodput rules on
constructed values, the speed-controller emulation against `SpeedController`, and one short real
run (the batched cloud in its own pinned process, virtual devices, chitchat prompts)."""
import json
import os

import pytest
from typer.testing import CliRunner

from relayinfer.device.speed import SpeedController
from relayinfer.sdk.cli import app
from relayinfer.sdk.cli_common import bench_module

gp = bench_module("goodput")
goodput_model = bench_module("goodput_model")


def test_tpot_p90_is_the_90th_percentile_of_the_shown_gaps():
    shown = [0.0]
    for g in [50.0] * 9 + [150.0]:  # ten gaps: nine of 50 ms, one of 150 ms
        shown.append(shown[-1] + g)
    # linear interpolation at rank 0.9 * 9 = 8.1 of the sorted gaps: 50 + 0.1 * (150 - 50)
    assert gp.tpot_p90_ms(shown) == pytest.approx(60.0)
    assert gp.tpot_p90_ms([0.0, 120.0]) == pytest.approx(120.0)
    assert gp.tpot_p90_ms([5.0]) is None and gp.tpot_p90_ms([]) is None


def test_a_request_attains_only_with_both_ttft_and_tpot_within_the_slo():
    assert gp.attains(True, 1000.0, 100.0, 1000.0, 100.0)  # both at the bound: attained
    assert not gp.attains(True, 1000.1, 50.0, 1000.0, 100.0)
    assert not gp.attains(True, 200.0, 100.5, 1000.0, 100.0)
    assert not gp.attains(False, 200.0, 50.0, 1000.0, 100.0)  # failed (timeout, error)
    assert not gp.attains(True, None, 50.0, 1000.0, 100.0)
    assert gp.attains(True, 300.0, None, 1000.0, 100.0)  # one token: no gap, judged on TTFT


def test_attainment_counts_the_fraction_of_rows_that_attain():
    rows = [{"ok": True, "ttft_ms": 400.0, "tpot_ms": 60.0}] * 7 + \
           [{"ok": True, "ttft_ms": 1500.0, "tpot_ms": 60.0}, {"ok": True, "ttft_ms": 400.0, "tpot_ms": 130.0},
            {"ok": False, "ttft_ms": None, "tpot_ms": None}]
    assert gp.attainment(rows, 1000.0, 100.0) == pytest.approx(0.7)
    assert gp.attainment(rows, 2000.0, 200.0) == pytest.approx(0.9)
    assert gp.attainment([], 1000.0, 100.0) is None
    s = gp.point_summary([{**r, "bucket": "short"} for r in rows], (1000.0, 100.0))
    assert (s["miss_ttft"], s["miss_tpot"], s["attainment_by_bucket"]["short"]) == (2, 1, pytest.approx(0.7))
    assert s["attainment_by_bucket"]["long"] is None


def test_goodput_is_the_highest_rate_below_the_first_failing_one():
    pts = [(0.4, 0.95), (0.1, 1.0), (0.2, 0.9), (0.8, 0.85), (1.6, 0.97)]  # 1.6 passes again: noise, not goodput
    assert gp.goodput_rps(pts) == 0.4
    assert gp.goodput_rps(pts, goal=0.8) == 1.6
    assert gp.goodput_rps([(0.1, 0.89)]) == 0.0
    assert gp.goodput_rps([(0.1, 1.0), (0.2, None)]) == 0.1
    assert gp.goodput_rps([]) == 0.0


def test_refined_rates_bisect_between_the_goodput_and_the_first_failing_rate():
    pts = [(0.1, [1.0, 1.0]), (0.2, [0.95, 1.0]), (0.4, [0.5, 0.92]), (0.8, [0.1, 0.3])]
    # pair 0: 0.2 passes, 0.4 fails -> 0.283; pair 1: 0.4 passes, 0.8 fails -> 0.566
    assert gp.refine_rates(pts, 2, set()) == [0.283, 0.566]
    assert gp.refine_rates(pts, 2, {0.283}) == [0.566]
    assert gp.refine_rates([(0.2, [0.9]), (0.24, [0.5])], 1, set()) == []  # already within 1.25x
    assert gp.refine_rates([(0.1, [0.5])], 1, set()) == []  # no passing rate: nothing to bisect
    assert gp.refine_rates([(0.1, [1.0]), (0.2, [None])], 1, set()) == [0.141]


def test_display_times_follow_the_speed_controller_and_its_interval_change():
    ready = [0.0, 0.0, 0.0, 0.0, 400.0, 410.0]
    ctl = SpeedController(target_tpot_ms=50.0)
    ref = []
    for r in ready:
        t = ctl.release_at(r)
        ctl.shown(t)
        ref.append(t)
    assert ref == pytest.approx([0, 50, 100, 150, 400, 450])
    assert gp.display_ms(ready, 50.0) == pytest.approx(ref)
    # the interval drops from 100 to 40 ms at the hand-off (250 ms): a token the display turns to from then on
    got = gp.display_ms([0.0, 10.0, 20.0, 300.0, 300.0], 100.0, 40.0, 250.0)
    assert got == pytest.approx([0.0, 100.0, 200.0, 300.0, 340.0])


def test_bound_of_names_the_resource_from_the_figures():
    base = {"offered_rps": 0.4, "cloud_concurrency": 3.0, "cloud_busy_ms_mean": 9000.0, "cloud_step_ms_p50": 120.0}
    assert gp.bound_of({**base, "miss_ttft": 1, "miss_tpot": 9, "cloud_cpu_busy": 0.95, "ttft_ms_p50": 500.0},
                       400.0)["verdict"] == "cloud compute"
    # a shared core: the cloud ran half the time and waited for the core the other half
    assert gp.bound_of({**base, "miss_ttft": 1, "miss_tpot": 9, "cloud_cpu_busy": 0.5, "cloud_cpu_wait": 0.45,
                        "ttft_ms_p50": 500.0}, 400.0)["verdict"] == "cloud compute"
    assert gp.bound_of({**base, "miss_ttft": 1, "miss_tpot": 9, "cloud_cpu_busy": 0.6, "ttft_ms_p50": 500.0},
                       400.0)["verdict"] == "decode step"
    q = gp.bound_of({**base, "miss_ttft": 8, "miss_tpot": 2, "cloud_cpu_busy": 0.7, "ttft_ms_p50": 2500.0}, 400.0)
    assert q["verdict"] == "queueing" and q["cloud_busy_ms_per_request"] == 9000.0
    assert gp.bound_of({**base, "miss_ttft": 3, "miss_tpot": 2, "cloud_cpu_busy": 0.7, "ttft_ms_p50": 500.0},
                       400.0)["verdict"] == "other"


def test_rel_dev():
    assert gp.rel_dev(110.0, 100.0) == pytest.approx(0.1)
    assert gp.rel_dev(None, None) == 0.0 and gp.rel_dev(3, None) is None
    assert gp.rel_dev(2, 0) == pytest.approx(2.0) and gp.rel_dev(0, 0) == 0.0


def test_goodput_cli_refuses_the_flags_it_cannot_honour():
    for args, flag in ((["--link", "wifi"], "--link"), (["--per-bucket", "2"], "--per-bucket"),
                       (["--no-pin-cores"], "--no-pin-cores"), (["--no-capacity"], "--no-capacity")):
        r = CliRunner().invoke(app, ["bench", "split", "--goodput", *args])
        assert r.exit_code == 2 and flag in r.output, (args, r.output)
    r = CliRunner().invoke(app, ["bench", "split", "--goodput", "--profile", "nosuch"])
    assert r.exit_code == 2 and "nosuch" in r.output


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins the cloud and the load driver to two cores")
def test_a_light_rate_point_attains_for_cloud_only_and_the_json_has_the_sweeps(tmp_path):
    out = tmp_path / "goodput.json"
    # seed 1: arrivals at 0, 5.5 and 8.0 s (seeded Poisson at 0.2 rps), each answer 16 tokens: one at a time
    res = gp.run_goodput_bench(["phone"], str(out), seed=1, max_new_tokens=16, pool_size=3, rates=(0.2,),
                               duration_s=10.0, max_requests=3, warmup_s=0.0, validate_per_rate=0,
                               time_limit_s=120.0, command="test")
    saved = json.loads(out.read_text())
    assert saved["command"] == "test" and set(saved["sweeps"]) == {"cloud-only", "split phone"}
    assert [p["bucket"] for p in saved["pool"]] == ["short", "medium", "long"]
    assert all(1 <= p["answer_len"] <= 16 for p in saved["pool"])
    assert isinstance(saved["setup"]["load_avg_start"][0], float)
    for mode, sw in saved["sweeps"].items():
        (p,) = sw["points"]
        assert p["offered_rps"] == 0.2 and p["measured"] == p["requests"] >= 1, mode
        assert [s["ttft_slo_ms"] for s in p["slo"]] == [1000.0, 2000.0]
        assert len(p["requests_detail"]) == p["requests"]
        assert all(r["answer_tokens"] <= 16 for r in p["requests_detail"])
    light = saved["sweeps"]["cloud-only"]["points"][0]
    assert light["ok"] == light["requests"] == 3 and light["errors"] == {}
    assert [round(r["arrival_s"], 1) for r in light["requests_detail"]] == [0.0, 5.5, 8.0]
    # the attainment and goodput follow from each request's own TTFT and TPOT (how fast a loaded machine
    # is decides those figures, not whether the bookkeeping holds)
    rows = light["requests_detail"]
    for j, slo in enumerate(light["slo"]):
        want = sum(r["ok"] and r["ttft_ms"] <= slo["ttft_slo_ms"] and (r["tpot_ms"] is None or r["tpot_ms"] <= slo["tpot_slo_ms"])
                   for r in rows) / len(rows)
        assert slo["attainment"] == pytest.approx(want), j
        assert saved["goodput"][j]["goodput_rps"]["cloud-only"] == (0.2 if want >= gp.ATTAINMENT_GOAL else 0.0), j
    assert all(r["ttft_ms"] > 0 and (r["tpot_ms"] is None or r["tpot_ms"] > 0) for r in rows)
    md = out.with_suffix(".md").read_text()
    assert md.count("| cloud-only |") == 1 and "MODEL (not a run" in md and saved["model"]["prefill_ms_per_token"] >= 0
    assert saved["model"]["prefill_ms_per_token"] == pytest.approx(goodput_model.prefill_fit(saved["pool"])[1])
    assert out.with_suffix(".png").stat().st_size > 1000
    assert res["goodput"] == saved["goodput"]
