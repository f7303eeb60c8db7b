"""Ranking instances as separate processes on 127.0.0.1: affinity, fallback when an instance is gone,
bad input and malformed frames answered with clear errors (the instance keeps serving)."""
import asyncio
import json

import numpy as np
import pytest
import torch

from relayinfer.cloud.relay.client import RelayClient, spawn_instance
from relayinfer.cloud.relay.data import extend_history, load_ml100k
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.train import TrainConfig, load, save, train
from relayinfer.protocol.errors import RemoteError

CFG = {"hbm_bytes": 32 << 20, "dram_bytes": 32 << 20, "ttl_s": 30.0, "dram_window_s": 30.0,
       "trigger": {"budget_ms": 100, "risk_fraction": 0.0, "token_rate": 1e6, "token_burst": 1e6}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("relay")
    data = load_ml100k()
    torch.set_num_threads(1)
    model = train(data, TrainConfig(steps=5, batch=16, negatives=15), log=lambda s: None)
    ck = save(model, {}, d / "hstu.pt")
    lat = d / "latency.json"
    LatencyModel(full=[0.0, 0.1, 0.0, 0.0], prefix=[0.0, 0.09, 0.0], cached=[1.0, 0.0, 0.0]).to_json(lat)
    procs = [spawn_instance(f"i{k}", str(ck), str(lat), CFG, lifetime_s=300) for k in range(2)]
    yield data, load(ck)[0], procs
    for p in procs:
        p.stop()


async def until_stats(proc, key: str, at_least: int, bound_s: float = 120.0) -> None:
    """Wait (polling GET /stats, at most `bound_s` s) until the instance's counter `key` reaches
    `at_least`: the state the next step depends on, instead of a guess at how long it takes."""
    loop = asyncio.get_running_loop()
    t_end = loop.time() + bound_s
    while (await asyncio.to_thread(proc.stats)).get(key, 0) < at_least:
        assert loop.time() < t_end, f"{proc.name}: {key} stayed below {at_least} for {bound_s} s"
        await asyncio.sleep(0.05)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_affinity_then_fallback_when_instance_removed(cluster):
    data, model, procs = cluster

    async def go():
        client = await RelayClient.connect({p.name: p.url for p in procs}, procs[0].fingerprint)
        rng = np.random.default_rng(0)
        users = data.users[:6]
        hist = {u: extend_history(data, u, 300, rng) for u in users}
        cands = np.arange(1, 51)
        ref = {u: model.score(torch.from_numpy(hist[u][0])[None], torch.from_numpy(hist[u][1])[None],
                              torch.tensor([300]), torch.from_numpy(cands)[None]).detach().numpy()[0] for u in users}
        done = {p.name: p.stats().get("preinfer_done", 0) for p in procs}
        placed = {u: await client.pre_infer(u, *hist[u]) for u in users[:4]}
        for p in procs:                                            # retrieval + pre-processing: the prefixes are ready
            await until_stats(p, "preinfer_done", done[p.name] + sum(v == p.name for v in placed.values()))
        for u in users[:4]:
            s, src, inst = await client.rank(u, *hist[u], cands)
            assert inst == placed[u] and src == "hbm"
            np.testing.assert_allclose(s, ref[u], rtol=1e-4, atol=1e-4)
        # pre-infer two more users, then kill the instance holding the first one's prefix
        done = {p.name: p.stats().get("preinfer_done", 0) for p in procs}
        placed = {u: await client.pre_infer(u, *hist[u]) for u in users[4:]}
        for p in procs:
            await until_stats(p, "preinfer_done", done[p.name] + sum(v == p.name for v in placed.values()))
        victim = next(p for p in procs if p.name == placed[users[4]])
        survivor = next(p for p in procs if p is not victim)
        before = survivor.stats().get("rank_recompute", 0)
        victim.stop()
        s, src, inst = await client.rank(users[4], *hist[users[4]], cands)
        assert inst == survivor.name and src == "recompute"        # fallback: full inference elsewhere
        np.testing.assert_allclose(s, ref[users[4]], rtol=1e-4, atol=1e-4)
        assert survivor.stats()["rank_recompute"] == before + 1
        assert client.counts["instance_down"] == 1 and client.counts["fallback"] == 1
        # bad input: clear per-request error, instance keeps serving
        with pytest.raises(RemoteError, match=r"candidate_ids\[1\] must be an integer in \[1, "):
            await client.rank(users[5], *hist[users[5]], [1, 10**6])
        with pytest.raises(RemoteError, match=r"item_ids must be a list of 1\.\.16384 ids"):
            await client.rank(users[5], [], [], [1])
        s, src, _ = await client.rank(users[5], *hist[users[5]], cands)
        np.testing.assert_allclose(s, ref[users[5]], rtol=1e-4, atol=1e-4)
        await client.close()

    run(go())


def test_rank_during_running_pre_inference_waits_for_it(cluster):
    """The ranking request arrives while its prefix is being computed (chunked): the instance
    finishes the prefix and ranks on it (source hbm), scores equal full inference."""
    data, model, procs = cluster
    p = next(p for p in procs if p.proc.poll() is None)

    async def go():
        client = await RelayClient.connect({p.name: p.url}, p.fingerprint)
        u = data.users[20]
        it, ts = extend_history(data, u, 2500, np.random.default_rng(3))
        cands = np.arange(100, 140)
        started = p.stats().get("preinfer_started", 0)
        await client.pre_infer(u, it, ts)
        await until_stats(p, "preinfer_started", started + 1)  # running (a queued one would be cancelled)
        s, src, _ = await client.rank(u, it, ts, cands, request_ts=int(ts[-1]) + 7 * 86_400)
        await client.close()
        return u, it, ts, cands, s, src

    u, it, ts, cands, s, src = run(go())

    def ref(t):
        return model.score(torch.from_numpy(it)[None], torch.from_numpy(ts)[None], torch.tensor([len(it)]),
                           torch.from_numpy(cands)[None], t).detach().numpy()[0]
    assert src == "hbm"
    np.testing.assert_allclose(s, ref(torch.tensor([int(ts[-1]) + 7 * 86_400])), rtol=1e-5, atol=1e-5)
    assert np.abs(s - ref(None)).max() > 1e-4            # the request time crossed the protocol


def test_malformed_frame_does_not_kill_instance(cluster):
    from websockets.asyncio.client import connect
    data, _, procs = cluster
    p = next(p for p in procs if p.proc.poll() is None)

    async def go():
        async with connect(p.url) as ws:
            await ws.send(b"\x93not-a-message")
            reply = await ws.recv()
            assert b"bad_frame" in reply or b"handshake" in reply
        from relayinfer.protocol.messages import Cancel, Error
        from relayinfer.protocol.transport.ws import open_channel
        ch = await open_channel(p.url, p.fingerprint)
        await ch.send(Cancel(request_id="c1"))                   # a message an instance does not handle
        reply = await ch.recv()
        assert isinstance(reply, Error) and reply.code == "bad_request" and reply.request_id == "c1"
        await ch.close()
        client = await RelayClient.connect({p.name: p.url}, p.fingerprint)
        u = data.users[7]
        s, src, _ = await client.rank(u, data.items[u], data.ts[u], [1, 2, 3])
        assert s.shape == (3,) and np.isfinite(s).all()
        await client.close()

    run(go())
    assert p.proc.poll() is None and "rank_recompute" in json.dumps(p.stats())
