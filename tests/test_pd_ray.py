"""P/D serving on Ray (one local Ray per module, 2 CPUs): the `relayinfer pd serve` service with
prefill and decode pools of actors, a device split session and a cloud-only request through it,
and faults (a prefill actor dying mid-transfer, after its KV export, a decode actor dying mid-decode:
retried, Ray restarts the actor, no KV stranded)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from relayinfer.cloud.pd.gateway import GroupSpec, Scenario  # noqa: E402
from relayinfer.cloud.pd.instance import InstanceConfig  # noqa: E402
from relayinfer.cloud.pd.service import make_pd_service, wait_idle  # noqa: E402
from relayinfer.cloud.serve.service import ServiceThread  # noqa: E402
from relayinfer.protocol.model.decoding import SamplingParams  # noqa: E402

MAX_NEW = 24
# Starting Ray and four actors on a shared 2-core machine takes 1-2 minutes: beyond the default
# suite's time budget, so these run with `make test-slow` (the in-process P/D tests cover the logic).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_pd(torch_engine):
    svc = make_pd_service(torch_engine, [GroupSpec(Scenario("chat", 10000, 1000), 2, 2)],
                          InstanceConfig(kv_cache_bytes=16 << 20), actor_cpus=0, ray_cpus=2)
    try:
        with ServiceThread(svc) as running:
            yield running
    finally:
        svc.llm.gateway.pool.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def refs(torch_engine, chat_prompt_ids):
    return [torch_engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW)).token_ids for ids in chat_prompt_ids]


def run(svc, coro, timeout=240):
    return asyncio.run_coroutine_threadsafe(coro, svc_loop(svc)).result(timeout)


def svc_loop(svc):
    return svc.llm.gateway._reporter.get_loop()


def test_split_and_cloud_only_through_ray_pools(ray_pd, onnx_engine, chat_prompt_ids, refs):
    from test_split import BUDGET, client

    c = client(ray_pd, onnx_engine)
    split = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW)
    assert split.token_ids == refs[0] and split.mode == "split" and 0 < split.cloud_tokens <= BUDGET
    cloud_only = c.complete(chat_prompt_ids[1], max_new_tokens=MAX_NEW, mode="cloud-only")
    assert cloud_only.token_ids == refs[1]
    body = json.dumps({"model": ray_pd.model_name, "prompt": chat_prompt_ids[1], "max_tokens": MAX_NEW,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{ray_pd.http_url}/v1/completions", body, {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert answer["usage"]["completion_tokens"] == len(refs[1])
    reports = run(ray_pd, wait_idle(ray_pd.llm.gateway))
    assert sum(r["decodes"] for r in reports.values()) == 2  # cloud-only + OpenAI: P -> KV -> D; split: none
    assert sum(r["generates"] for r in reports.values()) == 1
    assert all(r["kv_blocks_used"] == 0 and r["held"] == 0 for r in reports.values()), reports
    health = json.loads(urllib.request.urlopen(f"{ray_pd.http_url}/healthz").read())
    assert health["pd"]["groups"][0]["ratio"] == "2P:2D"


def test_ray_actor_faults_are_retried_and_restarted(ray_pd, chat_prompt_ids, refs):
    gw = ray_pd.llm.gateway
    pool = gw.pool
    params = SamplingParams(max_new_tokens=MAX_NEW)

    async def collect(rid, ids):
        return [o.token_id async for o in gw.generate(rid, ids, params)]

    async def main():
        await gw.refresh_reports()
        pids = {n: r["pid"] for n, r in gw.reports.items()}
        # both prefill actors die once after exporting the KV, before the hand-off reaches the
        # gateway: the request is prefilled again on the other one, then on a restarted one
        for name in ("chat-p0", "chat-p1"):
            await pool.handle(name).set_fault(die_after_export=1)
        a = await collect("a", chat_prompt_ids[2])
        for name in ("chat-d0", "chat-d1"):
            await pool.handle(name).set_fault(die_after_tokens=3)
        b = await collect("b", chat_prompt_ids[0])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:  # Ray restarts the dead actors (new processes)
            reports = await wait_idle(gw)
            if len(reports) == 4 and not gw.dead and all(reports[n]["pid"] != pids[n] for n in
                                                          ("chat-p0", "chat-p1")):
                break
            await asyncio.sleep(0.5)
        return a, b, pids, reports

    a, b, pids, reports = run(ray_pd, main(), timeout=400)
    assert a == refs[2] and b == refs[0]
    reg = gw.metrics.registry
    assert reg.get_sample_value("relayinfer_pd_retries_total", {"group": "chat"}) >= 3
    assert reg.get_sample_value("relayinfer_pd_requests_total", {"group": "chat", "outcome": "error"}) is None
    assert all(reports[n]["pid"] != pids[n] for n in ("chat-p0", "chat-p1"))  # restarted by Ray
    assert any(reports[n]["pid"] != pids[n] for n in ("chat-d0", "chat-d1"))
    assert all(r["kv_blocks_used"] == 0 and r["held"] == 0 and r["running"] == 0 for r in reports.values())


def test_pools_of_a_gguf_engine_run_its_blocks(ray_pd, model_path, chat_prompt_ids):
    """A service made from a `weights='gguf'` engine: its actors rebuild the model on the file's
    4-bit blocks (not in `state_dict`, shipped as `ray_pool.model_weights`' blocks), and a request
    through P -> KV -> D answers as that engine does alone."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.models.llama import BlockLinear

    if not BlockLinear.available():
        pytest.skip("this torch has no CPU int4 kernel")
    engine = TorchEngine(model_path, threads=1, weights="gguf")
    params = SamplingParams(max_new_tokens=MAX_NEW)
    ref = engine.generate(chat_prompt_ids[1], params).token_ids
    svc = make_pd_service(engine, [GroupSpec(Scenario("gguf", 10000, 1000), 1, 1)],
                          InstanceConfig(kv_cache_bytes=16 << 20), actor_cpus=0)
    try:
        with ServiceThread(svc) as running:
            gw = running.llm.gateway

            async def collect():
                return [o.token_id async for o in gw.generate("g", chat_prompt_ids[1], params)]

            assert run(running, collect()) == ref
            reports = run(running, wait_idle(gw))
            assert sum(r["decodes"] for r in reports.values()) == 1
            assert all(r["kv_blocks_used"] == 0 and r["held"] == 0 for r in reports.values()), reports
    finally:
        svc.llm.gateway.pool.shutdown()
