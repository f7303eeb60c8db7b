"""Ranking instances placed by Ray: the client launches them as Ray actors (a local Ray,
CPU only), ranks through the same affinity router and protocol, and gets the same scores as through
locally spawned instance processes and as the model itself (the shipped checkpoint, real ML-100K
histories at real request times).

Ray's start-up on this shared 2-core machine (10-40 s) does not fit the suite's time budget, so this
runs with `make test-slow`, like tests/test_pd_ray.py; the process placement is covered in
tests/test_relay_serve.py."""
import asyncio

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from relayinfer.cloud.relay.client import RelayClient  # noqa: E402
from relayinfer.cloud.relay.data import extend_history, load_ml100k  # noqa: E402
from relayinfer.cloud.relay.latency import LatencyModel  # noqa: E402
from relayinfer.cloud.relay.train import default_checkpoint, load  # noqa: E402

pytestmark = pytest.mark.slow

CFG = {"hbm_bytes": 32 << 20, "dram_bytes": 32 << 20, "ttl_s": 60.0, "dram_window_s": 60.0,
       "trigger": {"budget_ms": 100, "risk_fraction": 0.0, "token_rate": 1e6, "token_burst": 1e6}}


async def scores_through(placement, lat, data, users, hist, cands, rts):
    client = await RelayClient.launch(2, str(default_checkpoint()), str(lat), CFG, placement=placement,
                                      lifetime_s=300)
    try:
        placed = {u: await client.pre_infer(u, *hist[u]) for u in users}
        await asyncio.sleep(1.0)                                    # retrieval + pre-processing delay
        out = {}
        for u in users:
            s, src, inst = await client.rank(u, *hist[u], cands, request_ts=rts[u])
            assert inst == placed[u] and src in ("hbm", "recompute")  # affinity: ranked where pre-inferred
            out[u] = (s, src, inst)
        return out, client.instance_stats()
    finally:
        await client.close()


def test_ray_placed_instances_rank_like_local_ones(tmp_path):
    data = load_ml100k()
    model = load(default_checkpoint())[0]
    lat = tmp_path / "latency.json"
    LatencyModel(full=[0.0, 0.1, 0.0, 0.0], prefix=[0.0, 0.09, 0.0], cached=[1.0, 0.0, 0.0]).to_json(lat)
    users = data.users[:6]
    hist = {u: (data.items[u], data.ts[u]) if k % 2 else extend_history(data, u, 400, np.random.default_rng(u))
            for k, u in enumerate(users)}
    rts = {u: int(hist[u][1][-1]) + 3600 for u in users}
    cands = np.arange(1, 101)
    try:
        via_ray, stats = asyncio.run(asyncio.wait_for(scores_through("ray", lat, data, users, hist, cands, rts), 900))
        assert len(stats) == 2 and sum(s.get("rank_hbm", 0) + s.get("rank_recompute", 0) for s in stats) == len(users)
    finally:
        ray.shutdown()
    local, _ = asyncio.run(asyncio.wait_for(scores_through("process", lat, data, users, hist, cands, rts), 300))
    assert sum(v[1] == "hbm" for v in via_ray.values()) >= 4        # the relay worked through Ray too
    for u in users:
        assert via_ray[u][2] == local[u][2]                           # the same router places users alike
        np.testing.assert_allclose(via_ray[u][0], local[u][0], rtol=1e-5, atol=1e-5)
        it, ts = hist[u]
        ref = model.score(torch.from_numpy(it)[None], torch.from_numpy(ts)[None], torch.tensor([len(it)]),
                          torch.from_numpy(cands)[None], torch.tensor([rts[u]])).detach().numpy()[0]
        np.testing.assert_allclose(via_ray[u][0], ref, rtol=1e-4, atol=1e-4)
