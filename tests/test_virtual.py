"""Virtual devices (device/virtual.py) against a real CloudService on loopback: bounded, low-rate load."""
from __future__ import annotations

import asyncio

import numpy as np

import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.profiles import DeviceProfile
from relayinfer.device import virtual
from relayinfer.device.virtual import auto_budget, run_load, summarize, VirtualResult
from relayinfer.protocol.messages import Done, Token

MAX_NEW = 16
# a device that prefills fast (so it takes over after a few cloud tokens) but decodes slowly
FAST = DeviceProfile("test-fast", prefill_ms_per_token=0.5, decode_ms_per_token=60.0)


@pytest.fixture(scope="module")
def cloud(torch_engine):
    svc = CloudService(torch_engine, torch_engine.fingerprint, step_delay_ms=10.0)
    with ServiceThread(svc, http_port=None) as running:
        yield running


@pytest.fixture(scope="module")
def short_prompts(tokenizer):
    return [tokenizer.encode_chat(p) for p in ("Hi there!", "What is your favourite colour?", "Tell me a joke.")]


def test_virtual_devices_complete_and_split_streams_fewer_cloud_tokens(cloud, torch_engine, short_prompts):
    kw = dict(rate_rps=2.0, duration_s=3.0, max_requests=3, profile=FAST, max_new_tokens=MAX_NEW, seed=1,
              timeout_s=30.0)
    co = asyncio.run(run_load(cloud.url, torch_engine.fingerprint, short_prompts, mode="cloud-only", **kw))
    sp = asyncio.run(run_load(cloud.url, torch_engine.fingerprint, short_prompts, mode="split", **kw))
    for run in (co, sp):
        assert 1 <= run["requests"] <= 3 and run["ok"] == run["requests"]
        # a device that is ready before the cloud's first token stops it then (hand-off at 0): the
        # cloud reports no prefill time for a request stopped before its first token
        assert all(r["ttft_ms"] > 0 and r["cloud_busy_ms"] >= (0 if r["handoff"] == 0 else 1e-9)
                   for r in run["results"]), run["results"]
        assert 0 < run["ttft_ms_p50"] <= run["ttft_ms_p99"]
    # cloud-only streams the whole answer (the prompts' answers are longer than MAX_NEW tokens or end on EOS)
    assert all(1 <= r["cloud_tokens"] <= MAX_NEW and r["handoff"] is None for r in co["results"])
    # split: the device hands off early (Stop) and the cloud stops streaming
    assert all(r["handoff"] is not None and r["cloud_tokens"] < MAX_NEW for r in sp["results"])
    assert sp["cloud_tokens_mean"] < co["cloud_tokens_mean"]
    assert sp["cloud_busy_ms_mean"] < co["cloud_busy_ms_mean"]


def test_auto_budget_and_summary():
    phone = DeviceProfile("p", prefill_ms_per_token=16.67, decode_ms_per_token=52.6)
    # short prompt: the device catches up within the answer; long prompt: the cloud streams to the end
    assert auto_budget(phone, 60, 256, 50.0) is not None and auto_budget(phone, 60, 256, 50.0) < 256
    assert auto_budget(phone, 2000, 64, 50.0) is None
    rs = [VirtualResult(10, "split", True, ttft_ms=t, cloud_tokens=2, cloud_busy_ms=100.0) for t in (100, 200, 300)]
    s = summarize(rs + [VirtualResult(10, "split", False)], 1.0, 10.0, ttft_slo_ms=1000.0)
    assert s["ok"] == 3 and s["ttft_ms_p50"] == 200 and not s["meets_slo"]  # a failure breaks the SLO
    assert s["goodput_rps"] == pytest.approx(0.3)
    assert summarize(rs, 1.0, 10.0)["meets_slo"]


class _FakeChannel:
    """A cloud that answers the Generate with the given frames (built from its request id)."""

    def __init__(self, frames):
        self.frames, self.sent, self.rid = frames, [], asyncio.Event()

    async def send(self, msg):
        self.sent.append(msg)
        self.rid.set()

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        await self.rid.wait()
        for make in self.frames:
            yield make(self.sent[0].request_id)

    async def close(self):
        pass


@pytest.mark.parametrize("frames,why", [
    ([lambda r: Token(r, 5, 0, 1.0), lambda r: Token(r, 6, 2, 2.0), lambda r: Done(r, "eos", 3, 1.0)], "skips 1"),
    ([lambda r: Token(r, 5, 0, 1.0), lambda r: Token(r, 5, 0, 1.0), lambda r: Done(r, "eos", 2, 1.0)], "repeats"),
    ([lambda r: Token(r, 5, 0, 1.0), lambda r: Done(r, "eos", 4, 1.0)], "cloud_tokens=4 but 1"),
    ([lambda r: Token("other", 5, 0, 1.0)], "unknown request"),
])
def test_virtual_request_names_a_protocol_violation(monkeypatch, frames, why):
    """A cloud stream that breaks the per-request rules fails the virtual request, naming the rule."""
    async def fake_open(*a, **k):
        return _FakeChannel(frames)
    monkeypatch.setattr(virtual.proto_ws, "open_channel", fake_open)
    res = asyncio.run(virtual.virtual_request("ws://x", "fp", [1, 2, 3], mode="cloud-only", max_new_tokens=8,
                                              timeout_s=10.0))
    assert not res.ok and res.error.startswith("protocol violation") and why in res.error, res.error


PHONE = DeviceProfile("phone-like", prefill_ms_per_token=16.67, decode_ms_per_token=52.6)


def _exact_estimate(ttft_ms: float, tpot_ms: float, prompt: int):
    """A cloud estimate whose TTFT for `prompt` tokens and TPOT are exactly the stream's (ms)."""
    from relayinfer.device.settings import CloudEstimate

    return CloudEstimate(ttft_base_ms=ttft_ms - 1.0 * prompt, prefill_ms_per_token=1.0, tpot_ms=tpot_ms)


def test_replay_on_a_steady_stream_hands_off_where_the_model_says():
    """Replayed on a stream that arrives as the plan expected (token k at T + k*c), the virtual
    device plans the real device's budget, asks for no more, and hands off at the index and time
    of `settings.catch_up`; its tokens follow at the decode pace and the TTFT is the first arrival."""
    from relayinfer.device.settings import catch_up

    P, T, c, answer = 120, 400.0, 45.0, 200
    est = _exact_estimate(T, c, P)
    t, p = virtual.plan_for(PHONE, P, 256, 50.0, cloud=est)
    assert p.budget is not None and not p.held
    trace = [T + c * k for k in range(p.budget)]
    r = virtual.replay(PHONE, P, trace, answer, 256, 50.0, cloud=est)
    h, at = catch_up(t, P, p.budget)
    assert (r["handoff"], r["budget"], r["extensions"], r["extrapolated"]) == (h, p.budget, 0, 0)
    assert r["handoff_ms"] == pytest.approx(at) and 0 < h <= p.budget
    assert r["ttft_ms"] == T and len(r["ready_ms"]) == answer
    assert r["ready_ms"][h + 1] - r["ready_ms"][h] == pytest.approx(52.6)
    # shown after the hand-off at the device's pace (52.6 ms > the 50 ms target): the p90 gap is that pace
    assert r["tpot_ms"] == pytest.approx(max(52.6, p.interval_ms), rel=1e-6)


def test_replay_of_a_fast_device_answers_alone_and_a_short_trace_is_extended():
    """A device ready before the first cloud token hands off at 0 (its own first token is the
    TTFT); a recording that ends before the virtual device caught up is extended at its mean gap."""
    fast = DeviceProfile("fast", prefill_ms_per_token=0.5, decode_ms_per_token=60.0)
    r = virtual.replay(fast, 3, [500.0, 540.0], 16, 16, 50.0)
    assert r["handoff"] == 0 and r["ttft_ms"] == pytest.approx(1.5) and len(r["shown_ms"]) == 16
    P = 120
    est = _exact_estimate(400.0, 45.0, P)
    r = virtual.replay(PHONE, P, [400.0 + 45.0 * k for k in range(10)], 200, 256, 50.0, cloud=est)
    assert r["extrapolated"] > 0 and r["handoff"] == 10 + r["extrapolated"]


def test_occupancy_model_and_prefill_fit():
    from relayinfer.sdk.cli_common import bench_module

    gm = bench_module("goodput_model")
    base, slope = gm.prefill_fit([{"prompt_tokens": 100, "zero_load_ttft_ms": 400.0},
                                  {"prompt_tokens": 200, "zero_load_ttft_ms": 700.0}])
    assert (base, slope) == (pytest.approx(100.0), pytest.approx(3.0))
    # prefill 300 ms, 150 answer tokens at 20 ms vs 10 cloud tokens at 30 ms: (300 + 3000) / (300 + 300)
    assert gm.occupancy_ratio(100, 3.0, 150, 20.0, 10, 30.0) == pytest.approx(5.5)
    with pytest.raises(ValueError):
        gm.prefill_fit([{"prompt_tokens": 100, "zero_load_ttft_ms": 400.0}] * 2)


def test_replay_of_a_device_slower_than_its_fit_extends_the_budget_while_its_prompt_prefills(monkeypatch):
    """A device whose calls take 25 ms a token where its fit says 16.67 re-plans after its first
    prompt call (`policy.FIRST_CHUNK`, 64 tokens: the measured prefill rate moved the plan,
    `policy.moved`) and asks the cloud for the whole answer at 1.6 s, while the cloud still streams
    its 213-token budget (to 4.6 s) and long before its 700-token prompt is prefilled, as the real
    device's `revisit` does: the cloud answers to the end and no shown gap is longer than the display
    interval. With a 256-token first call the re-plan comes at 6.4 s, after the budget ran out, and
    the display stalls until the device hands off. A device as fast as its fit asks for nothing."""
    from relayinfer.device import policy
    from relayinfer.device.settings import Timing

    P, T, c, answer = 700, 400.0, 20.0, 256
    est = _exact_estimate(T, c, P)
    t, p = virtual.plan_for(PHONE, P, 256, 50.0, cloud=est)
    assert p.budget is not None and not p.held
    trace = [T + c * k for k in range(answer)]
    exact = virtual.replay(PHONE, P, trace, answer, 256, 50.0, cloud=est)
    assert exact["extensions"] == 0 and exact["extended_ms"] == [] and exact["handoff"] is not None
    slow = Timing(PHONE.prefill_ms_base, 25.0, PHONE.decode_ms_per_token, 0.0, 0.0)
    r = virtual.replay(PHONE, P, trace, answer, 256, 50.0, cloud=est, cost=slow)
    assert (r["extensions"], r["budget"], r["handoff"]) == (1, answer, None)
    assert r["extended_ms"][0] == pytest.approx(slow.prefill_ms(policy.FIRST_CHUNK))
    assert r["extended_ms"][0] < trace[p.budget - 1]
    assert len(r["shown_ms"]) == answer and np.diff(r["shown_ms"]).max() == pytest.approx(r["interval_ms"])
    monkeypatch.setattr(policy, "FIRST_CHUNK", virtual.PREFILL_CHUNK)
    late = virtual.replay(PHONE, P, trace, answer, 256, 50.0, cloud=est, cost=slow)
    assert late["extensions"] == 0 and late["handoff"] == p.budget
    assert np.diff(late["shown_ms"]).max() > 10 * late["interval_ms"]  # the stall
