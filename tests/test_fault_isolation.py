"""Fault isolation: an exception raised while serving one request ends that request only.

Faults are injected into the real engine on the real model: the sampler raising for one request
(`protocol.decoding.sample`, the numpy path a seeded, temperature > 0 request takes), a stop check
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

from relayinfer.cloud.engine import llm_engine as le
from relayinfer.cloud.engine import sampler as sampler_mod
from relayinfer.cloud.engine.llm_engine import (AsyncLLMEngine, EngineFailed, LLMEngine, RequestFailed,
                                                MAX_FORWARD_FAILURES)
from relayinfer.protocol.decoding import SamplingParams

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


def _drive(engine: LLMEngine, max_steps: int = 500) -> tuple[dict, dict]:
    """Step until idle; (tokens by request id, RequestFailed by request id)."""
    out: dict[str, list[int]] = {}
    failed: dict[str, RequestFailed] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        failed.update(engine.take_failures())
    assert not engine.has_unfinished()
    return out, failed


def test_sampler_fault_ends_only_its_request(torch_engine, chat_prompt_ids, reference, bad_sampler):
    engine = LLMEngine(torch_engine, kv_cache_bytes=16 << 20)
    for i, p in enumerate(chat_prompt_ids):
        engine.add_request(f"ok{i}", p, GREEDY)
    engine.add_request("bad", chat_prompt_ids[0], DRAW)
    out, failed = _drive(engine)
    assert list(failed) == ["bad"]
    assert "'bad'" in str(failed["bad"]) and "Seed must be between" in str(failed["bad"])
    assert len(out["bad"]) == 2  # what it streamed before the fault
    for i in range(len(chat_prompt_ids)):
        assert out[f"ok{i}"] == reference[i]
    assert engine.block_manager.num_used_blocks == 0 and not engine.seqs
    assert engine.request_stats("bad").finish_reason == "error"
    engine.add_request("next", chat_prompt_ids[1], GREEDY)  # the engine goes on
    out, failed = _drive(engine)
    assert out["next"] == reference[1] and not failed
    reg = engine.metrics.registry
    assert reg.get_sample_value("relayinfer_engine_requests_total", {"reason": "error"}) == 1


def test_stop_check_fault_ends_only_its_sequence(torch_engine, chat_prompt_ids, reference, monkeypatch):
    real = le.is_stop
    marked = SamplingParams(max_new_tokens=8)  # same rule as GREEDY, another object

    def is_stop(tok, eos, params):
        if params is marked:
            raise RuntimeError("stop callback exploded")
        return real(tok, eos, params)

    monkeypatch.setattr(le, "is_stop", is_stop)
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
