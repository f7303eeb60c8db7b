"""Fault isolation: an exception raised while serving one request ends that request only.

Faults are injected into the real engine on the real model: the sampler raising for one request
(`protocol.model.decoding.sample`, the numpy path a seeded, temperature > 0 request takes), a stop check
raising for one sequence, a batched forward failing once (or for good), a K/V import failing. Each
time the other requests finish with the tokens they get alone, the failed one gets an error naming
it, every KV block goes back, and the next request is served. Over HTTP and the websocket the
failed request gets 500 JSON / `Error` INTERNAL, the others their answers, and `/healthz` stays ok.
The per-request path (`TorchEngine`), the relay compute thread and the patho compute thread are
covered the same way.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from relayinfer.cloud.engine import sampler as sampler_mod
from relayinfer.cloud.engine import scheduler as scheduler_mod
from relayinfer.cloud.engine.llm_engine import (AsyncLLMEngine, EngineFailed, LLMEngine, RequestFailed,
                                                MAX_FORWARD_FAILURES)
from relayinfer.cloud.engine.metrics import EngineMetrics
from relayinfer.protocol.model.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8)
BAD_SEED = 4242  # the injected sampler raises for requests with this seed
DRAW = SamplingParams(max_new_tokens=8, temperature=0.7, seed=BAD_SEED)


@pytest.fixture(scope="module")
def reference(torch_engine, chat_prompt_ids):
    """Greedy tokens of each chat prompt generated alone."""
    return [torch_engine.generate(p, GREEDY).token_ids for p in chat_prompt_ids]


@pytest.fixture
def bad_sampler(monkeypatch):
    """`decoding.sample` as the engine calls it, raising on the 3rd answer position of a request
    seeded BAD_SEED (it has streamed two tokens by then), as numpy does on a bad seed."""
    real = sampler_mod.sample

    def sample(logits, params, index, *a, **kw):
        if params.seed == BAD_SEED and index == 2:
            raise ValueError("Seed must be between 0 and 2**32 - 1")
        return real(logits, params, index, *a, **kw)

    monkeypatch.setattr(sampler_mod, "sample", sample)


def _drive(engine: LLMEngine, max_steps: int = 500, metrics: EngineMetrics | None = None) -> tuple[dict, dict]:
    """Step until idle, feeding `metrics` when given; (tokens by request id, RequestFailed by
    request id)."""
    out: dict[str, list[int]] = {}
    failed: dict[str, RequestFailed] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outs = engine.step()
        if metrics is not None:
            metrics.observe(outs, engine.last_stats)
        for o in outs:
            out.setdefault(o.request_id, []).append(o.token_id)
        failed.update(engine.take_failures())
    assert not engine.has_unfinished()
    return out, failed


def test_sampler_fault_ends_only_its_request(torch_engine, chat_prompt_ids, reference, bad_sampler):
    engine = LLMEngine(torch_engine, kv_cache_bytes=16 << 20)
    metrics = EngineMetrics(engine)
    for i, p in enumerate(chat_prompt_ids):
        engine.add_request(f"ok{i}", p, GREEDY)
    engine.add_request("bad", chat_prompt_ids[0], DRAW)
    out, failed = _drive(engine, metrics=metrics)
    assert list(failed) == ["bad"]
    assert "'bad'" in str(failed["bad"]) and "Seed must be between" in str(failed["bad"])
    assert len(out["bad"]) == 2  # what it streamed before the fault
    for i in range(len(chat_prompt_ids)):
        assert out[f"ok{i}"] == reference[i]
    assert engine.block_manager.num_used_blocks == 0 and not engine.seqs
    assert engine.request_stats("bad").finish_reason == "error"
    engine.add_request("next", chat_prompt_ids[1], GREEDY)  # the engine goes on
    out, failed = _drive(engine, metrics=metrics)
    assert out["next"] == reference[1] and not failed
    reg = metrics.registry
    assert reg.get_sample_value("relayinfer_engine_requests_total", {"reason": "error"}) == 1


def test_stop_check_fault_ends_only_its_sequence(torch_engine, chat_prompt_ids, reference, monkeypatch):
    real = scheduler_mod.finish_reason
    marked = SamplingParams(max_new_tokens=8)  # same rule as GREEDY, another object

    def finish_reason(tok, n, params, eos, budget=None, guide=None):
        if params is marked:
            raise RuntimeError("stop callback exploded")
        return real(tok, n, params, eos, budget, guide)

    monkeypatch.setattr(scheduler_mod, "finish_reason", finish_reason)
    engine = LLMEngine(torch_engine, kv_cache_bytes=16 << 20)
    engine.add_request("ok", chat_prompt_ids[2], GREEDY)
    engine.add_request("bad", chat_prompt_ids[1], marked)
    out, failed = _drive(engine)
    assert list(failed) == ["bad"] and "stop callback exploded" in str(failed["bad"])
    assert out["ok"] == reference[2] and "bad" not in out
    assert engine.block_manager.num_used_blocks == 0


def test_forward_fault_fails_its_step_then_engine_fails_when_it_persists(torch_engine, chat_prompt_ids,
                                                                          reference):
    engine = LLMEngine(torch_engine, kv_cache_bytes=16 << 20)
    real = engine.runner.run
    fails = {"left": 1}

    def run(batch):
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("device lost for one step")
        return real(batch)

    engine.runner.run = run
    engine.add_request("a", chat_prompt_ids[0], GREEDY)
    engine.add_request("b", chat_prompt_ids[1], GREEDY)
    out, failed = _drive(engine)
    assert sorted(failed) == ["a", "b"] and "device lost" in str(failed["a"])
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("c", chat_prompt_ids[2], GREEDY)  # one failed step is not an engine failure
    out, failed = _drive(engine)
    assert out["c"] == reference[2] and not failed
    fails["left"] = 10**6  # now every forward fails: after MAX_FORWARD_FAILURES the engine gives up
    with pytest.raises(EngineFailed, match="batched forwards failed in a row"):
        for i in range(MAX_FORWARD_FAILURES):
            engine.add_request(f"d{i}", chat_prompt_ids[0], GREEDY)
            engine.step()
    assert fails["left"] == 10**6 - MAX_FORWARD_FAILURES


def test_async_engine_delivers_the_failure_and_goes_on(torch_engine, chat_prompt_ids, reference, bad_sampler):
    async def main():
        llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))

        async def collect(rid, p, params):
            return [o.token_id async for o in llm.generate(rid, p, params)]

        try:
            res = await asyncio.gather(collect("ok0", chat_prompt_ids[0], GREEDY),
                                       collect("bad", chat_prompt_ids[1], DRAW),
                                       collect("ok2", chat_prompt_ids[2], GREEDY), return_exceptions=True)
            after = await collect("after", chat_prompt_ids[1], GREEDY)
            return res, after, llm.error, llm.engine.block_manager.num_used_blocks
        finally:
            llm.shutdown()

    (ok0, bad, ok2), after, error, used = asyncio.run(asyncio.wait_for(main(), 300))
    assert isinstance(bad, RequestFailed) and bad.request_id == "bad"
    assert ok0 == reference[0] and ok2 == reference[2] and after == reference[1]
    assert error is None and used == 0


# --- the servers ----------------------------------------------------------------------------------

def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def cloud(torch_engine):
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=32 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, max_queue_wait_ms=1e9, max_queued_tokens=10**6)
    with ServiceThread(svc) as running:
        yield running


def test_http_request_whose_sampler_raises_gets_500_others_answer(cloud, bad_sampler):
    from concurrent.futures import ThreadPoolExecutor

    url = cloud.http_url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "Hi"}]
    ok = {"messages": msg, "max_tokens": 6, "temperature": 0}
    bad = {"messages": msg, "max_tokens": 6, "temperature": 0.7, "seed": BAD_SEED}
    want = _post(url, ok)
    assert want[0] == 200
    with ThreadPoolExecutor(4) as ex:
        res = list(ex.map(lambda b: _post(url, b), [ok, bad, ok, ok]))
    assert [s for s, _ in res] == [200, 500, 200, 200]
    err = res[1][1]["error"]
    assert err["type"] == "server_error" and "failed in the engine" in err["message"]
    assert "Seed must be between" in err["message"]
    for _, body in (res[0], res[2], res[3]):
        assert body["choices"][0]["message"]["content"] == want[1]["choices"][0]["message"]["content"]
    status, health = _get(cloud.http_url + "/healthz")
    assert status == 200 and health["status"] == "ok" and health["engine"]["kv_blocks_used"] == 0
    status, body = _post(url, ok)  # and the next request is served
    assert status == 200 and body["choices"] == want[1]["choices"]


def _ws_generate(url, fp, gens) -> dict:
    from relayinfer.protocol.transport import ws as proto_ws
    from relayinfer.protocol.messages import Done, Error, Token

    async def main():
        async with await proto_ws.open_channel(url, fp) as ch:
            for g in gens:
                await ch.send(g)
            got: dict = {g.request_id: [] for g in gens}
            ended: set = set()
            async for m in ch:
                if isinstance(m, (Token, Done, Error)):
                    got[m.request_id].append(m)
                    if isinstance(m, (Done, Error)):
                        ended.add(m.request_id)
                if len(ended) == len(gens):
                    return got

    return asyncio.run(asyncio.wait_for(main(), 180))


@pytest.mark.parametrize("refine", [None, 0.9], ids=["batched", "per-request"])
def test_ws_request_whose_sampler_raises_gets_internal_error(cloud, chat_prompt_ids, reference, bad_sampler,
                                                             monkeypatch, refine):
    from relayinfer.cloud.engine import per_request as per_request_mod
    from relayinfer.protocol.messages import Done, Error, Generate, Token

    real = per_request_mod.sample

    def sample(logits, params, index, *a, **kw):  # the per-request engine samples on its own
        if params.seed == BAD_SEED and index == 2:
            raise ValueError("Seed must be between 0 and 2**32 - 1")
        return real(logits, params, index, *a, **kw)

    monkeypatch.setattr(per_request_mod, "sample", sample)
    p = chat_prompt_ids[0]
    gens = [Generate("ok", p, 8, refine=refine), Generate("bad", p, 8, temperature=0.7, seed=BAD_SEED, refine=refine)]
    got = _ws_generate(cloud.url, cloud.fingerprint, gens)
    assert isinstance(got["ok"][-1], Done) and got["ok"][-1].reason in ("length", "eos")
    if refine is None:
        assert [m.token_id for m in got["ok"] if isinstance(m, Token)] == reference[0]
    err = got["bad"][-1]
    assert isinstance(err, Error) and err.code == "internal" and "Seed must be between" in err.message
    assert [m.index for m in got["bad"] if isinstance(m, Token)] == [0, 1]
    assert cloud.llm.engine.block_manager.num_used_blocks == 0 and cloud.health() is None
    again = _ws_generate(cloud.url, cloud.fingerprint, [Generate("again", p, 8)])
    assert [m.token_id for m in again["again"] if isinstance(m, Token)] == reference[0]


def test_relay_worker_survives_failing_and_cancelled_jobs():
    """The relay compute thread: a job that raises fails its request only; a job whose request
    left while it waited (its future cancelled) is skipped; later jobs still run."""
    import threading

    from relayinfer.cloud.relay.server import Worker

    w = Worker()
    gate = threading.Event()
    blocker = w.submit(0, lambda: gate.wait(30) and "unblocked")
    waiting = w.submit(0, lambda: "never awaited")
    assert waiting.cancel()  # asyncio.wrap_future cancels it when the awaiting task is cancelled
    boom = w.submit(0, lambda: 1 / 0)
    gate.set()
    assert blocker.result(30) == "unblocked"
    with pytest.raises(ZeroDivisionError):
        boom.result(30)
    assert w.submit(0, lambda: 42).result(30) == 42

    def job():  # a generator job (chunked pre-inference) that fails half-way
        yield
        raise RuntimeError("chunk failed")

    with pytest.raises(RuntimeError, match="chunk failed"):
        w.submit(1, job).result(30)
    assert w.submit(0, lambda: "still serving").result(30) == "still serving"


def test_patho_encoder_fault_ends_only_its_slide():
    import numpy as np

    from relayinfer.cloud.patho.encoder import ViTEncoder
    from relayinfer.cloud.patho.service import PathoService, PathoServiceThread, SlideScreener
    from relayinfer.cloud.patho.vit import VIT_TINY_TEST
    from relayinfer.protocol.messages import Embeddings, Error, Tensor, TileBatch
    from relayinfer.protocol.patho import jpeg_encode
    from relayinfer.protocol.transport.ws import open_channel

    enc = ViTEncoder(cfg=VIT_TINY_TEST, seed=0)
    real = enc.encode
    calls = {"n": 0}

    def encode(tiles):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("encoder blew up on this batch")
        return real(tiles)

    enc.encode = encode
    svc = PathoService(SlideScreener(enc))
    good = jpeg_encode(np.full((224, 224, 3), 200, np.uint8))
    empty = Tensor.from_numpy(np.zeros((0, 224, 224, 3), np.uint8))

    async def main(url):
        async with await open_channel(url, svc.fingerprint) as ch:
            out = []
            for rid in ("bad", "ok"):
                await ch.send(TileBatch(rid, "s", [[0, 0]], empty, jpeg=[good], last=True))
                out.append(await asyncio.wait_for(ch.recv(), 60))
            return out

    with PathoServiceThread(svc) as running:
        bad, ok = asyncio.run(main(running.url))
    assert isinstance(bad, Error) and bad.code == "internal" and "encoder blew up" in bad.message
    assert isinstance(ok, Embeddings) and ok.slide_score is not None


# --- P/D: instances whose engine fails are replaced, within a restart budget per time window -----

def test_pd_gateway_replaces_failed_local_instances_within_a_window_budget(torch_engine, chat_prompt_ids,
                                                                           reference):
    from relayinfer.cloud.pd.gateway import Gateway, GroupSpec, PDError, RestartBudget, Scenario, local_groups
    from relayinfer.cloud.pd.instance import InstanceConfig

    now = [0.0]
    budget = RestartBudget(max_restarts=5, window_s=60.0, clock=lambda: now[0])

    async def main():
        groups = local_groups(torch_engine, [GroupSpec(Scenario("chat", 5000, 500), 1, 1)],
                              InstanceConfig(kv_cache_bytes=16 << 20))
        gw = Gateway(groups, report_interval_s=0.3, restarts=budget, restart_wait_s=20.0, max_retries=3)
        await gw.start()
        (p,), (d,) = gw.groups[0].prefill, gw.groups[0].decode
        seen, answers = [], []
        for h in (p, d):  # what /healthz says while an instance is being replaced (the replacement
            restart = h.restart  # starts after the failure and ends before the instance serves again)

            async def recording_restart(h=h, restart=restart):
                st = gw.health_state()
                seen.append((h.name, st["status"], h.name in st["dead"] or h.name in st["restarting"]))
                await restart()
            h.restart = recording_restart
        try:
            for k, h in enumerate([d, p, p, p, p, p]):  # 6 engine failures (5 of the prefill): each is replaced
                old = h.instance
                h.instance.set_fault(fail_engine=True)
                answers.append(await asyncio.wait_for(_tokens(gw, f"r{k}", chat_prompt_ids[0]), 120))
                assert h.instance is not old and old.llm.error is not None
                assert gw.health() is None
            restarts, replaced = dict(gw.num_restarts), list(seen)  # the six, before the budget runs out
            # the prefill's sixth failure within the window: its budget is spent, the pool stays empty
            p.instance.set_fault(fail_engine=True)
            gw.restart_wait_s = 3.0
            with pytest.raises(PDError, match="no live prefill instance"):
                await _tokens(gw, "over", chat_prompt_ids[1])
            fatal = gw.health()
            now[0] += 61.0  # the window moves on: replaced again, and serving
            for _ in range(600):
                if gw.health_state()["status"] == "ok":
                    break
                await asyncio.sleep(0.05)
            after = await _tokens(gw, "after", chat_prompt_ids[1])
            used = [h.instance.engine.block_manager.num_used_blocks for h in (p, d)]
            return replaced, answers, restarts, fatal, after, used, dict(gw.num_restarts)
        finally:
            await gw.stop()

    seen, answers, restarts, fatal, after, used, final = asyncio.run(asyncio.wait_for(main(), 600))
    assert [name for name, _, _ in seen] == ["chat-d0"] + ["chat-p0"] * 5, seen
    assert all(status != "ok" and named for _, status, named in seen), seen
    assert all(a == reference[0] for a in answers)  # each request was resumed on the replacement
    assert restarts == {"chat-p0": 5, "chat-d0": 1}
    assert fatal is not None and "chat-p0" in fatal and "restart budget spent (5 per 60 s)" in fatal
    assert after == reference[1] and used == [0, 0] and final["chat-p0"] == 6


async def _tokens(gw, rid, ids):
    return [o.token_id async for o in gw.generate(rid, ids, GREEDY)]


def test_restart_budget_is_a_sliding_window():
    from relayinfer.cloud.pd.gateway import RestartBudget

    now = [0.0]
    b = RestartBudget(max_restarts=2, window_s=10.0, clock=lambda: now[0])
    assert b.take("a") and b.take("a") and not b.take("a") and b.take("b")
    now[0] = 5.0
    assert not b.take("a") and b.recent("a") == 2
    now[0] = 10.5  # the first two left the window
    assert b.recent("a") == 0 and b.take("a")
    with pytest.raises(ValueError):
        RestartBudget(max_restarts=-1)


def test_per_request_model_that_keeps_failing_is_reported_and_refused(torch_engine, chat_prompt_ids):
    """The per-request path: a decode step that raises ends its request alone (INTERNAL, /healthz
    stays ok, a request served to its end resets the count); MAX_FORWARD_FAILURES requests in a row
    failing so mean the model cannot go on: health() names it, /healthz answers 503, new requests
    get INTERNAL naming it."""
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.protocol.messages import Done, Error, Generate, Token

    class Flaky:
        def __init__(self, engine):
            self._e, self.broken = engine, True

        def __getattr__(self, name):
            return getattr(self._e, name)

        def decode(self, tok, kv):
            if self.broken:
                raise RuntimeError("injected decode fault")
            return self._e.decode(tok, kv)

    flaky = Flaky(torch_engine)
    p = chat_prompt_ids[1]
    with ServiceThread(CloudService(flaky, torch_engine.fingerprint)) as svc:  # no batching engine: per-request
        def one(rid):
            return _ws_generate(svc.url, svc.fingerprint, [Generate(rid, p, 4)])[rid]

        for i in range(MAX_FORWARD_FAILURES - 1):
            got = one(f"f{i}")
            assert isinstance(got[0], Token) and isinstance(got[-1], Error) and got[-1].code == "internal"
            assert "injected decode fault" in got[-1].message and svc.health() is None
        flaky.broken = False
        assert isinstance(one("ok")[-1], Done)  # a model step that works: the count starts again
        flaky.broken = True
        for i in range(MAX_FORWARD_FAILURES - 1):
            assert isinstance(one(f"g{i}")[-1], Error) and svc.health() is None
        assert _get(svc.http_url + "/healthz")[0] == 200
        assert isinstance(one("last")[-1], Error)
        why = svc.health()
        assert why is not None and f"{MAX_FORWARD_FAILURES} requests in a row failed in a model step" in why, why
        assert "injected decode fault" in why
        status, body = _get(svc.http_url + "/healthz")
        assert status == 503 and body["status"] == "error", body
        refused = one("after")
        assert len(refused) == 1 and refused[0].code == "internal" and "failed in a model step" in refused[0].message


@pytest.mark.parametrize("at", [0, 2], ids=["prefill-instance", "decode-instance"])
def test_pd_request_whose_sampler_raises_fails_alone_without_a_restart(torch_engine, chat_prompt_ids, reference,
                                                                       monkeypatch, at):
    """Through the P/D gateway (local instances): a request whose sampling raises on the prefill
    instance (its first token) or the decode instance (its third) fails alone with RequestFailed,
    split or not; it is not retried, no instance is counted dead or replaced, the greedy requests
    beside it get their own answers and every KV block goes back."""
    from relayinfer.cloud.pd.gateway import Gateway, GroupSpec, Scenario, local_groups
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.service import wait_idle

    real = sampler_mod.sample

    def sample(logits, params, index, *a, **kw):
        if params.seed == BAD_SEED and index == at:
            raise ValueError("injected sampler fault")
        return real(logits, params, index, *a, **kw)

    monkeypatch.setattr(sampler_mod, "sample", sample)
    p = chat_prompt_ids[0]

    async def run(gw, rid, params, budget=None):
        try:
            return [o.token_id async for o in gw.generate(rid, p, params, budget, split=budget is not None)]
        except RequestFailed as e:
            return e

    async def main():
        groups = local_groups(torch_engine, [GroupSpec(Scenario("chat", 5000, 500), 1, 1)],
                              InstanceConfig(kv_cache_bytes=16 << 20))
        gw = Gateway(groups, report_interval_s=0.3, restart_wait_s=20.0, max_retries=3)
        await gw.start()
        try:
            res = await asyncio.gather(run(gw, "ok", GREEDY), run(gw, "bad", DRAW), run(gw, "bad-split", DRAW, 3),
                                       run(gw, "ok2", GREEDY))
            reports = await wait_idle(gw, 30)
            return res, gw.health(), gw.health_state(), dict(gw.num_restarts), reports
        finally:
            await gw.stop()

    (ok, bad, bad_split, ok2), fatal, state, restarts, reports = asyncio.run(asyncio.wait_for(main(), 300))
    assert ok == reference[0] and ok2 == reference[0]
    for e in (bad, bad_split):
        assert isinstance(e, RequestFailed) and "injected sampler fault" in str(e), e
    assert fatal is None and state["status"] == "ok" and not state["dead"] and restarts == {}
    assert all(r["kv_blocks_used"] == 0 and r["running"] == 0 and r["held"] == 0 for r in reports.values()), reports
