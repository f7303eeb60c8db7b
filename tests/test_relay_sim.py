"""Cascade simulator on ML-100K users: the relay takes the prefix off the critical path."""
import numpy as np
import pytest

from relayinfer.cloud.relay.data import load_ml100k
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.trigger import TriggerConfig
from relayinfer.sdk.cli import bench_module

_bench = bench_module("relay")   # the drivers live in bench/ (relay.py, relay_sim.py), importing the library
longest_ok, workload, live_vs_sim = _bench.longest_ok, _bench.workload, _bench.live_vs_sim
SimConfig, Simulator, p99, poisson_requests = _bench.SimConfig, _bench.Simulator, _bench.p99, _bench.poisson_requests

# quadratic full / prefix cost, linear cached rank (the shape measured on the real HSTU)
LAT = LatencyModel(full=[5, 0.02, 1e-4, 1e-4], prefix=[3, 0.02, 1e-4], cached=[2, 0.01, 6e-5])
CFG = SimConfig(instances=4, delay_ms=200, n_cands=100, bytes_per_token=1032, hbm_bytes=32 << 20,
                trigger=TriggerConfig(budget_ms=200, risk_fraction=0.5, n_cands=100, token_rate=6000, token_burst=12000))


def test_latency_fit_recovers_coefficients():
    s = [{"L": L, "N": N, "full_ms": LAT.full_ms(L, N), "prefix_ms": LAT.prefix_ms(L), "cached_ms": LAT.cached_ms(L, N)}
         for L in (128, 512, 1024, 2048) for N in (50, 100)]
    fit = LatencyModel.fit(s)
    for L in (256, 1536, 4096):
        assert abs(fit.prefix_ms(L) / LAT.prefix_ms(L) - 1) < 1e-6
        assert fit.full_ms(L, 100) == fit.prefix_ms(L) + fit.cached_ms(L, 100)
        assert abs(fit.cached_ms(L, 100) / LAT.cached_ms(L, 100) - 1) < 1e-6


def test_relay_cuts_p99_and_respects_budgets():
    data = load_ml100k()
    sim = Simulator(LAT, CFG)
    curves = {"baseline": {}, "relay": {}}
    for L in (512, 1024, 1536, 2048):
        reqs, _ = workload(data, np.random.default_rng(0), 3.0, 1500, L)
        for mode in curves:
            r = sim.run(reqs, mode)
            assert not np.isnan(r["latency_ms"]).any()           # every request was ranked
            curves[mode][L] = p99(r["latency_ms"])
            if mode == "relay":
                assert r["hbm_peak_bytes"] <= CFG.hbm_bytes
                assert r["preinfer_tokens"] <= CFG.instances * (CFG.trigger.token_burst + CFG.trigger.token_rate * reqs[-1].t0)
    assert longest_ok(curves["relay"], 200) > longest_ok(curves["baseline"], 200) > 0
    assert curves["relay"][1536] < curves["baseline"][1536] / 2


def test_short_histories_are_not_pre_inferred():
    data = load_ml100k()
    reqs = poisson_requests(3.0, 500, data.users, lambda u: len(data.items[u]), np.random.default_rng(0))
    r = Simulator(LAT, CFG).run(reqs, "relay")
    assert r["counts"]["trigger_short"] == 500 and r["preinfer_tokens"] == 0


def test_live_vs_sim_error_is_relative_to_the_real_measurement():
    live = {m: {"p50_ms": 100.0, "p99_ms": 400.0, "mean_ms": 150.0} for m in ("baseline", "relay")}
    sim = {"s": {"baseline": np.full(100, 110.0), "relay": np.r_[np.full(98, 50.0), 300.0, 300.0]}}
    out = live_vs_sim(live, sim)["s"]
    assert out["baseline"]["p50_ms"]["error"] == pytest.approx(0.10)
    assert out["baseline"]["p99_ms"]["error"] == pytest.approx(110 / 400 - 1)
    assert out["relay"]["p99_ms"]["sim"] == pytest.approx(300.0) and out["relay"]["p50_ms"]["error"] == pytest.approx(-0.5)


def test_preinference_pieces_keep_their_fifo_place():
    """Like the real Worker (cloud/relay/server.py): a chunked pre-inference runs its pieces back to back
    unless a ranking waits, and then resumes ahead of later pre-inferences; two pre-inferences are not
    interleaved, so the first user's prefix is ready after its own compute time (1 s here)."""
    lat = LatencyModel(full=[0, 1.0, 0, 0], prefix=[0, 1.0, 0], cached=[10.0, 0, 0])   # prefix 1 ms/event
    cfg = SimConfig(instances=1, delay_ms=1200, n_cands=100, hbm_bytes=1 << 30, chunk=100, layers=3,
                    trigger=TriggerConfig(budget_ms=100, risk_fraction=0.0, n_cands=100, token_rate=1e9, token_burst=1e9))
    reqs = [_bench.Request(0.0, 1, 1000), _bench.Request(0.001, 2, 1000, session=1)]
    r = Simulator(lat, cfg).run(reqs, "relay")
    assert r["counts"]["rank_hbm"] == 2
    # user 1: prefix done at 1.0 s, its ranking at 1.2 s waits at most for the piece in progress (50 ms)
    assert r["latency_ms"][0] < 10 + 50 + 1e-6
    # user 2: its prefix (1.0-2.0 s, paused for user 1's ranking) is awaited, then ranked
    assert 2000 - 1201 < r["latency_ms"][1] < 2000 - 1201 + 10 + 10 + 1e-6
