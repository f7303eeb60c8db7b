"""RelayGR parts in-process on real ML-100K histories: trigger, pools, expander, router, instance."""
import threading
import time

import numpy as np
import pytest
import torch

from relayinfer.cloud.models.hstu import HSTU, HSTUConfig
from relayinfer.cloud.relay.data import extend_history
from relayinfer.cloud.relay.expander import Expander
from relayinfer.cloud.relay.instance import InstanceConfig, RankingInstance
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.pool import DramTier, Entry, HBMPool
from relayinfer.cloud.relay.router import Router
from relayinfer.cloud.relay.trigger import Trigger, TriggerConfig


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


# full ranking ms = 0.1 * L: a 1000-event history costs 100 ms (fixed so the tests are deterministic)
LAT = LatencyModel(full=[], prefix=[-1.0, 0.1, 0.0], cached=[1.0, 0.0, 0.0])  # full = prefix + cached = 0.1 * L


@pytest.fixture(scope="module")
def model(data):
    torch.manual_seed(0)
    return HSTU(HSTUConfig(num_items=data.num_items)).eval()


def test_extend_history_keeps_real_events(data):
    u = data.users[5]
    it, ts = extend_history(data, u, 1500, np.random.default_rng(0))
    assert len(it) == len(ts) == 1500
    n = len(data.items[u])
    assert np.array_equal(it[-n:], data.items[u]) and np.array_equal(ts[-n:], data.ts[u])
    assert np.all(np.diff(ts) >= 0) and it.min() >= 1 and it.max() <= data.num_items


def test_trigger_bounds_footprint_and_load_under_burst(data):
    clock = Clock()
    bpt = 1032
    pool = HBMPool(capacity=3_000 * bpt, clock=clock)
    cfg = TriggerConfig(budget_ms=100, risk_fraction=0.5, n_cands=100, token_rate=2_000, token_burst=4_000)
    trig = Trigger(cfg, LAT.full_ms, pool, bpt, clock)
    users = data.users[:200]
    admitted_tokens, t0, held = 0, clock.t, []
    lengths = [len(data.items[u]) * 8 for u in users]        # real lengths scaled into the 100-6000 range
    for i, L in enumerate(lengths):
        if i % 20 == 0:
            clock.t += 0.25                                 # a burst of 20 requests every 250 ms
        ok, reason, nbytes = trig.admit(L)
        if ok:
            admitted_tokens += L
            held.append((clock.t + 1.0, nbytes))            # prefix lives ~1 s until its ranking consumes it
            pool.put(Entry(i, None, nbytes, clock.t + 5), nbytes)
        for exp, nb in [h for h in held if h[0] <= clock.t]:
            held.remove((exp, nb))
        # consume entries whose ranking came
        for k in [k for k, e in pool.entries.items() if e.expires - 4.0 <= clock.t]:
            pool.pop(k)
        assert pool.used + pool.reserved <= pool.capacity
        assert admitted_tokens <= cfg.token_burst + cfg.token_rate * (clock.t - t0) + 1e-6
    c = trig.counts
    assert c["ok"] > 0 and c["short"] > 0 and c["load"] > 0, c   # every rule fired on this burst
    assert pool.peak <= pool.capacity
    # short histories are never pre-inferred: predicted 0.1 ms/event * L <= 50 ms
    assert not trig.at_risk(500) and trig.at_risk(501)


def test_trigger_footprint_rule(data):
    clock = Clock()
    pool = HBMPool(capacity=2_500 * 1000, clock=clock)
    trig = Trigger(TriggerConfig(budget_ms=100, token_rate=1e9, token_burst=1e9), LAT.full_ms, pool, 1000, clock)
    got = [trig.admit(1000) for _ in range(4)]
    assert [g[1] for g in got] == ["ok", "ok", "footprint", "footprint"]
    assert pool.reserved == 2_000_000 <= pool.capacity
    pool.release(got[0][2])
    assert trig.admit(1000)[1] == "ok"


def test_pool_lifecycle_timeout():
    clock = Clock()
    pool = HBMPool(10_000, clock)
    assert pool.reserve(4000)
    pool.put(Entry("a", None, 4000, clock.t + 2.0), 4000)
    assert pool.get("a") is not None and pool.used == 4000
    clock.t += 2.5
    assert pool.get("a") is None and pool.used == 0 and pool.expired == 1


def test_router_affinity_and_bounded_load():
    clock = Clock()
    r = Router(["a", "b", "c"], epsilon=0.25, clock=clock)
    placed = {u: r.route_preinfer(u) for u in range(300)}
    assert max(r.load.values()) <= np.ceil(1.25 * 300 / 3)          # bounded load
    for u in range(300):
        inst, affine = r.route_rank(u)
        assert affine and inst == placed[u]
        r.done(inst)
    assert sum(r.load.values()) == 0 and r.counts["affine"] == 300
    # removal: users of the removed instance are re-routed (counted as fallback), others unaffected
    placed = {u: r.route_preinfer(u) for u in range(30)}
    r.remove("b")
    for u in range(30):
        inst, affine = r.route_rank(u)
        assert inst != "b" and affine == (placed[u] != "b")
        r.done(inst)
    assert r.counts["fallback"] == sum(p == "b" for p in placed.values()) > 0


def test_expander_single_flight_reload():
    clock = Clock()
    pool, dram = HBMPool(10_000, clock), DramTier(10_000, 5.0, clock)
    copies = []

    def slow_copy(kv):  # the copy lasts until the three other readers wait for it (state, at most 10 s)
        copies.append(kv)
        deadline = time.monotonic() + 10
        while ex.reload_waits < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        return kv

    ex = Expander(pool, dram, ttl_s=5.0, copy=slow_copy)
    assert pool.reserve(3000)
    pool.put(Entry("u", "payload", 3000, clock.t + 5), 3000)
    assert ex.demote("u") and pool.used == 0 and "u" in dram
    out = []
    ts = [threading.Thread(target=lambda: out.append(ex.reload("u"))) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(copies) == 1 and ex.reloads == 1 and ex.reload_waits == 3
    assert all(e is not None and e.kv == "payload" for e in out) and pool.used == 3000
    clock.t += 10  # outside the window a demoted entry is gone
    ex.demote("u")
    clock.t += 6
    assert ex.reload("u") is None


def _instance(model, clock, **kw):
    cfg = InstanceConfig(hbm_bytes=64 << 20, dram_bytes=64 << 20, ttl_s=5.0, dram_window_s=10.0,
                         trigger=TriggerConfig(budget_ms=100, risk_fraction=0.0, token_rate=1e6, token_burst=1e6), **kw)
    return RankingInstance(model, LAT, cfg, clock)


def test_instance_relay_scores_equal_full_and_returning_user_hits_dram(model, data):
    clock = Clock()
    inst = _instance(model, clock)
    calls = []
    orig = model.prefix_forward
    inst.model = type("M", (), {})()
    inst.model.cfg, inst.model.rank = model.cfg, model.rank
    inst.model.prefix_forward = lambda *a: calls.append(1) or orig(*a)
    orig_steps = model.prefix_forward_steps
    inst.model.prefix_forward_steps = lambda *a: calls.append(1) or orig_steps(*a)
    u = data.users[10]
    it, ts = extend_history(data, u, 600, np.random.default_rng(1))
    cands = np.arange(1, 101)
    ref = model.score(torch.from_numpy(it)[None], torch.from_numpy(ts)[None], torch.tensor([600]),
                      torch.from_numpy(cands)[None]).detach().numpy()[0]
    assert inst.pre_infer(u, it, ts) == "admitted" and len(calls) == 1
    s1, src1 = inst.rank(u, it, ts, cands)
    assert src1 == "hbm" and len(calls) == 1
    clock.t += 3.0                                               # returns within the 10 s window
    s2, src2 = inst.rank(u, it, ts, cands)
    assert src2 == "dram" and len(calls) == 1 and inst.expander.reloads == 1
    np.testing.assert_allclose(s1, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s2, ref, rtol=1e-4, atol=1e-4)
    clock.t += 11.0                                              # past the window: recompute
    s3, src3 = inst.rank(u, it, ts, cands)
    assert src3 == "recompute" and len(calls) == 2
    np.testing.assert_allclose(s3, ref, rtol=1e-4, atol=1e-4)
    # a changed history never hits a stale prefix
    s4, src4 = inst.rank(u, it[:-1], ts[:-1], cands)
    assert src4 == "recompute"
    st = inst.stats()
    assert st["rank_hbm"] == 1 and st["rank_dram"] == 1 and st["rank_recompute"] == 2


def test_instance_bad_input_is_a_clear_error(model, data):
    inst = _instance(model, Clock())
    u = data.users[0]
    it, ts = data.items[u], data.ts[u]
    with pytest.raises(ValueError, match=r"^item_ids must be a list of 1\.\.16384 ids, got \[\]"):
        inst.rank(u, [], [], [1, 2])
    with pytest.raises(ValueError, match=r"^candidate_ids\[1\] must be an integer in \[1, 1682\], got 99999"):
        inst.rank(u, it, ts, [1, 99_999])
    with pytest.raises(ValueError, match=r"^item_ids\[0\] must be an integer in \[1, 1682\], got 0"):
        inst.pre_infer(u, [0, 5], [1, 2])
    with pytest.raises(ValueError, match="timestamps"):
        inst.rank(u, it, ts[:-1], [1])
    s, src = inst.rank(u, it, ts, [1, 2, 3])                     # still serving
    assert s.shape == (3,) and src == "recompute"


def test_baseline_instance_never_caches(model, data):
    inst = _instance(model, Clock(), relay=False)
    u = data.users[3]
    it, ts = data.items[u], data.ts[u]
    assert inst.pre_infer(u, it, ts) == "disabled"
    assert inst.rank(u, it, ts, [1, 2])[1] == "none" and inst.pool.used == 0 and inst.dram.used == 0


def test_worker_runs_ranking_between_pre_inference_chunks():
    from relayinfer.cloud.relay.server import Worker
    order = []
    two_in, queued = threading.Event(), threading.Event()

    def prefix_job():
        for i in range(6):
            order.append(f"chunk{i}")
            if i == 1:                                    # the pre-inference is 2 chunks in
                two_in.set()
                assert queued.wait(10)                    # ... when the ranking is queued
            yield
        return "kv"

    w = Worker()
    f_pre = w.submit(1, prefix_job)
    assert two_in.wait(10)
    f_rank = w.submit(0, lambda: order.append("rank") or "scores")
    queued.set()
    assert f_rank.result(10) == "scores" and f_pre.result(10) == "kv"
    assert order.index("rank") == 2 and len(order) == 7  # ranked at the next step, pre-inference then resumed


def test_instance_prefix_serves_every_request_time(model, data):
    """One pre-inferred prefix serves the same user at two request times (hbm, then dram); the scores
    follow the request time and equal full inference at that time."""
    inst = _instance(model, Clock())
    u = data.users[20]
    it, ts = extend_history(data, u, 300, np.random.default_rng(2))
    cands = np.arange(1, 51)

    def full(t):
        return model.score(torch.from_numpy(it)[None], torch.from_numpy(ts)[None], torch.tensor([300]),
                           torch.from_numpy(cands)[None], torch.tensor([t])).detach().numpy()[0]
    assert inst.pre_infer(u, it, ts) == "admitted"
    soon, later = int(ts[-1]) + 60, int(ts[-1]) + 30 * 86_400
    s1, src1 = inst.rank(u, it, ts, cands, request_ts=soon)
    s2, src2 = inst.rank(u, it, ts, cands, request_ts=later)
    assert (src1, src2) == ("hbm", "dram")
    np.testing.assert_allclose(s1, full(soon), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s2, full(later), rtol=1e-4, atol=1e-4)
    assert np.abs(s1 - s2).max() > 1e-3
