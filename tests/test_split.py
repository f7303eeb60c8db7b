"""End to end: a real cloud service on loopback, the real model on both sides, the split hand-off."""
from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import urllib.request

import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.profiles import DeviceProfile
from relayinfer.protocol.model import refine as refine_mod
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.messages import Generate, Token, encode
from relayinfer.sdk import Client
from conftest import CloudFirstClient
from servers import split_cloud

# A device slower at prefill than the cloud, so the cloud's first tokens come before the device is
# ready; with a cloud budget the hand-off index does not depend on how loaded this machine is.
SLOW_DEVICE = DeviceProfile("test-slow", prefill_ms_per_token=40.0)
BUDGET = 8
MAX_NEW = 24


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    with split_cloud(torch_engine, device_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def reference(torch_engine, chat_prompt_ids):
    """Cloud-engine greedy answers computed directly (no service)."""
    return [torch_engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW)).token_ids for ids in chat_prompt_ids]


def client(cloud, onnx_engine, **kw) -> Client:
    """A client of the split path: its device is never ready before the cloud's first token."""
    return CloudFirstClient(cloud_url=cloud.url, engine=onnx_engine, profile=kw.pop("profile", SLOW_DEVICE),
                  target_tpot_ms=kw.pop("target_tpot_ms", 30.0), cloud_budget=kw.pop("cloud_budget", BUDGET), **kw)


def test_split_equals_cloud_only_and_device_only(cloud, onnx_engine, chat_prompt_ids, reference):
    c = client(cloud, onnx_engine)
    for ids, ref in zip(chat_prompt_ids, reference):
        stream = c.generate(ids, max_new_tokens=MAX_NEW)
        shown = [e.shown_at_ms for e in stream]
        split = stream.result
        cloud_only = c.complete(ids, max_new_tokens=MAX_NEW, mode="cloud-only")
        device_only = c.complete(ids, max_new_tokens=MAX_NEW, mode="device-only")
        assert split.token_ids == cloud_only.token_ids == device_only.token_ids == ref
        assert split.mode == "split" and split.cloud_tokens > 0 and split.device_tokens > 0
        assert split.handoff_index == split.cloud_tokens <= BUDGET and split.fault is None and split.plan == "split"
        assert cloud_only.plan == "cloud-only" and device_only.plan == "device-only" and "asked for" in device_only.plan_reason
        assert cloud_only.mode == "cloud-only" and cloud_only.device_tokens == 0
        assert device_only.mode == "device-only" and device_only.cloud_tokens == 0
        assert split.text == c.tokenizer.decode(ref, skip_special=True)
        # the display's own lateness, one per shown token: never negative, never more than the token
        # waited between being ready and being shown (a release is never before the token is ready)
        assert len(split.late_ms) == len(split.ready_ms) == len(shown) == len(split.token_ids)
        assert all(0.0 <= lt <= t - r + 1e-6 for lt, t, r in zip(split.late_ms, shown, split.ready_ms)), \
            (split.late_ms, shown, split.ready_ms)
        # the cloud's send stamp of every cloud token the answer holds, in its order; a token sent
        # earlier arrived earlier (one websocket, in order), so the stamps ascend as the arrivals do
        sent = split.cloud_sent_ms
        assert len(sent) == split.cloud_tokens and sent == sorted(sent) and sent[0] > 0.0
        assert cloud_only.cloud_sent_ms == sorted(cloud_only.cloud_sent_ms) and len(cloud_only.cloud_sent_ms) == len(ref)
        assert device_only.cloud_sent_ms == []


def test_gguf_q8_device_takes_over_where_the_cloud_stopped(cloud, model_path, chat_prompt_ids, reference):
    """A 'gguf-q8' device (int8 activations, not fp32-equal): the answer is the cloud's tokens up to
    the hand-off, then that device model's greedy tokens after the prompt and those tokens.

    Greedy under q8 is judged teacher-forced, not by equality with a fresh q8 run: on int8
    activations a token's logits depend on how its context was chunked (one-token decode against a
    many-token prefill differ by up to ~0.6 logit here), and the device chunks its prefill by the
    tokens it received, so a near-tie (gaps of 0.02 occur) can break either way."""
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine

    q8 = OnnxEngine(ensure_device_model(model_path, "gguf-q8"), quantize="gguf-q8")
    c = client(cloud, q8)
    exact = total = 0
    for ids, ref in zip(chat_prompt_ids, reference):
        split = c.complete(ids, max_new_tokens=MAX_NEW)
        h = split.handoff_index
        assert split.mode == "split" and 0 < h == split.cloud_tokens <= BUDGET and split.fault is None, split
        assert split.token_ids[:h] == ref[:h] and len(split.token_ids) == MAX_NEW
        logits, kv = q8.prefill(ids + split.token_ids[:h])
        for tok in split.token_ids[h:]:
            gap = float(logits.max() - logits[tok])
            assert gap < 1.5, f"device token {tok} is {gap:.2f} logits below q8's greedy choice"
            exact += gap == 0.0
            total += 1
            logits, kv = q8.decode(tok, kv)
    assert exact >= 0.75 * total, f"only {exact} of {total} device tokens are q8's exact greedy choice"


def test_stream_events_have_no_gap_or_duplicate(cloud, onnx_engine, chat_prompt_ids, reference):
    c = client(cloud, onnx_engine)
    stream = c.generate(chat_prompt_ids[0], max_new_tokens=MAX_NEW)
    events = list(stream)
    res = stream.result
    assert [e.index for e in events] == list(range(len(res.token_ids)))
    assert [e.token_id for e in events] == res.token_ids == reference[0]
    sources = [e.source for e in events]
    h = res.handoff_index
    assert sources == ["cloud"] * h + ["device"] * (len(events) - h)
    times = [e.shown_at_ms for e in events]
    assert times == sorted(times) and res.ttft_ms == pytest.approx(times[0])
    # the speed controller never shows two tokens closer than its interval
    assert min(b - a for a, b in zip(times, times[1:])) >= 30.0 - 1.0
    assert "".join(e.text for e in events) == c.tokenizer.decode(res.token_ids)


def test_async_generate(cloud, onnx_engine, chat_prompt_ids, reference):
    c = client(cloud, onnx_engine)

    async def main():
        stream = c.agenerate(chat_prompt_ids[1], max_new_tokens=MAX_NEW)
        ids = [ev.token_id async for ev in stream]
        return ids, stream.result

    ids, res = asyncio.run(main())
    assert ids == res.token_ids == reference[1] and res.mode == "split"


def test_seeded_sampling_split_equals_device_only(cloud, onnx_engine, chat_prompt_ids):
    c = client(cloud, onnx_engine)
    sampling = dict(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=11)
    split = c.complete(chat_prompt_ids[2], **sampling)
    device_only = c.complete(chat_prompt_ids[2], **sampling, mode="device-only")
    assert split.mode == "split" and split.token_ids == device_only.token_ids


# --- faults ----------------------------------------------------------------------------------

def test_cloud_unreachable_falls_back_to_device(onnx_engine, chat_prompt_ids, reference):
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Client(cloud_url=f"ws://127.0.0.1:{port}", engine=onnx_engine, connect_timeout_s=2.0, cloud_budget=None)
    res = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW)
    assert res.mode == "device-only" and res.fault == "cloud-unreachable" and res.token_ids == reference[0]


class _DroppingChannel:
    """Proxy of a server channel that closes the socket after `after` tokens (a cloud crash)."""

    def __init__(self, channel, after: int):
        self._c, self._left = channel, after

    def __getattr__(self, name):
        return getattr(self._c, name)

    async def send(self, msg):
        if isinstance(msg, Token):
            if self._left == 0:
                await self._c.ws.close(1011, "simulated crash")
            self._left -= 1
        await self._c.send(msg)


class DroppingService(CloudService):
    async def _run(self, channel, req, session):
        await super()._run(_DroppingChannel(channel, 3), req, session)


def test_connection_lost_mid_stream_device_completes(torch_engine, onnx_engine, chat_prompt_ids, reference):
    svc = DroppingService(torch_engine, torch_engine.fingerprint, step_delay_ms=20.0)
    with ServiceThread(svc, http_port=None) as running:
        # prefill takes seconds on this device: the crash comes long before it could take over
        c = CloudFirstClient(cloud_url=running.url, engine=onnx_engine, profile=DeviceProfile("slower", prefill_ms_per_token=80.0),
                   target_tpot_ms=30.0, cloud_budget=None)
        res = c.complete(chat_prompt_ids[1], max_new_tokens=MAX_NEW)
    assert res.fault == "connection-lost" and res.mode == "split"
    assert res.token_ids == reference[1]
    assert 1 <= res.cloud_tokens <= 3 and res.device_tokens == len(res.token_ids) - res.cloud_tokens


def test_auto_settings_hand_off_and_refinement(cloud, onnx_engine, chat_prompt_ids, reference, monkeypatch):
    """The settings algorithm picks the budget; refinement makes the device prefill fewer tokens,
    but only on prompts long enough for it to pay (`refine_pays`)."""
    # a device slow enough (40 ms/token) that a split stays the plan when a loaded machine slows the cloud
    c = client(cloud, onnx_engine, cloud_budget="auto", target_tpot_ms=60.0,
               profile=DeviceProfile("test", prefill_ms_per_token=40.0))
    res = c.complete(chat_prompt_ids[0], max_new_tokens=64)
    assert res.token_ids[: len(reference[0])] == reference[0]
    assert res.mode == "split" and res.cloud_budget is not None and res.interval_ms >= 60.0
    assert res.cloud_tokens <= res.cloud_budget
    n = len(chat_prompt_ids[0])
    short = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW, refine=0.5, cloud_budget=BUDGET)
    assert n < refine_mod.MIN_REFINE_TOKENS and short.device_prompt_tokens == n  # refinement off: too short
    monkeypatch.setattr(refine_mod, "MIN_REFINE_TOKENS", 0)
    refined = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW, refine=0.5, cloud_budget=BUDGET)
    assert refined.mode == "split" and refined.device_prompt_tokens < n
    assert refined.token_ids[: refined.handoff_index] == reference[0][: refined.handoff_index]


def test_auto_settings_fall_back_to_cloud_when_device_cannot_catch_up(cloud, onnx_engine, chat_prompt_ids, reference):
    hopeless = DeviceProfile("hopeless", prefill_ms_per_token=500.0)  # per-token prefill > display interval
    c = client(cloud, onnx_engine, profile=hopeless, cloud_budget="auto")
    res = c.complete(chat_prompt_ids[1], max_new_tokens=12)
    assert res.mode == "cloud-only" and res.fault is None and res.cloud_budget is None  # planned, not a fault
    assert res.plan == "cloud-to-the-end" and "500 ms a token" in res.plan_reason, res.plan_reason
    assert res.token_ids == reference[1][:12] and res.device_prefill_ms == 0.0


def test_device_slower_than_answer_cloud_streams_to_end(cloud, onnx_engine, chat_prompt_ids, reference):
    glacial = DeviceProfile("glacial", prefill_ms_per_token=2000.0)
    c = client(cloud, onnx_engine, profile=glacial, cloud_budget=None)
    res = c.complete(chat_prompt_ids[0], max_new_tokens=8)
    assert res.mode == "cloud-only" and res.fault is None and res.plan == "split"  # ended before the device caught up
    assert res.token_ids == reference[0][:8] and res.device_tokens == 0


async def _raw(url: str, frames: list[bytes | None]) -> list:
    """Send raw frames on a fresh websocket and return the decoded replies until the close; a None
    in `frames` waits for one reply first (the Welcome: frames sent before it are held to the 4 KiB
    handshake limit, by websockets itself above its margin)."""
    from websockets.asyncio.client import connect

    from relayinfer.protocol.messages import decode

    got = []
    async with connect(url, max_size=None) as ws:
        for f in frames:
            if f is None:
                got.append(decode(await asyncio.wait_for(ws.recv(), 10)))
            else:
                await ws.send(f)
        try:
            async for data in ws:
                got.append(decode(data))
        except Exception:
            pass
    return got


def test_bad_clients_get_errors_while_others_finish(torch_engine, onnx_engine, chat_prompt_ids, reference):
    from relayinfer.protocol.messages import Hello

    fp = torch_engine.fingerprint
    svc = CloudService(torch_engine, fp, auth_token="s3cret", step_delay_ms=20.0, max_frame_bytes=1 << 20)
    with ServiceThread(svc, http_port=None) as running:
        good = CloudFirstClient(cloud_url=running.url, engine=onnx_engine, token="s3cret", profile=SLOW_DEVICE,
                      target_tpot_ms=30.0, cloud_budget=BUDGET)
        stream = good.generate(chat_prompt_ids[2], max_new_tokens=MAX_NEW)  # runs in its own thread

        async def attacks():
            hello = encode(Hello(1, fp, "s3cret"))
            garbage = await _raw(running.url, [b"\x00\xffnot msgpack at all"])
            oversized = await _raw(running.url, [hello, None, b"\x91" + b"x" * ((1 << 20) + 10)])
            with pytest.raises(RemoteError) as wrong_fp:
                await proto_ws.open_channel(running.url, "0" * 64, "s3cret")
            with pytest.raises(RemoteError) as wrong_token:
                await proto_ws.open_channel(running.url, fp, "guess")
            ch = await proto_ws.open_channel(running.url, fp, "s3cret")  # request-level errors keep the connection
            await ch.send(Generate("too-long", [1] * 8190, 16))
            too_long = await ch.recv()
            await ch.send(Generate("bad-id", [10 ** 6], 4))
            bad_id = await ch.recv()
            await ch.close()
            return garbage, oversized, wrong_fp.value, wrong_token.value, too_long, bad_id

        garbage, oversized, wrong_fp, wrong_token, too_long, bad_id = asyncio.run(attacks())
        res = stream.collect()
    assert garbage[-1].code == ErrorCode.BAD_FRAME.value
    assert oversized[-1].code == ErrorCode.FRAME_TOO_LARGE.value
    assert wrong_fp.code == ErrorCode.FINGERPRINT_MISMATCH and "fingerprint" in wrong_fp.message
    assert wrong_token.code == ErrorCode.UNAUTHORIZED
    assert too_long.code == ErrorCode.PROMPT_TOO_LONG.value and too_long.request_id == "too-long"
    assert bad_id.code == ErrorCode.BAD_REQUEST.value and bad_id.message.startswith("prompt_ids[0] must be an integer in [0, ")
    assert res.token_ids == reference[2] and res.mode == "split"


@pytest.fixture(scope="module")
def batched_cloud(torch_engine):
    """The cloud service with continuous batching (LLMEngine over a paged KV cache)."""
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine

    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=64 << 20))
    # correctness under concurrency, not load shedding: no OVERLOADED from the expected-wait bound
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, max_queue_wait_ms=600_000.0)
    with ServiceThread(svc) as running:
        yield running


def test_split_on_batched_cloud(batched_cloud, onnx_engine, chat_prompt_ids, reference):
    c = client(batched_cloud, onnx_engine)
    res = c.complete(chat_prompt_ids[2], max_new_tokens=MAX_NEW)
    assert res.token_ids == reference[2] and res.mode == "split" and res.cloud_tokens > 0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{batched_cloud.http_port}/metrics").read().decode()
    assert "relayinfer_engine_kv_bytes_per_token 46080.0" in metrics  # 30 layers x K,V x 3 heads x 64 x 4 B


def test_eight_concurrent_sessions(batched_cloud, onnx_engine, tokenizer):
    cloud = batched_cloud
    import time

    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    prompts = chitchat_prompts_by_length(tokenizer, [40, 48, 56, 64, 40, 48, 56, 64], seed=3)
    refs = [onnx_engine.generate(p, SamplingParams(max_new_tokens=10)).token_ids for p in prompts]
    requests = cloud.metrics.requests
    before = sum(s.value for m in requests.collect() for s in m.samples if s.name.endswith("_total"))
    results = [None] * 8
    slower = DeviceProfile("slower", prefill_ms_per_token=100.0)

    def one(i):  # each device has its own client (executor), sharing the loaded ONNX model
        c = Client(cloud_url=cloud.url, engine=onnx_engine, profile=slower, target_tpot_ms=10.0, cloud_budget=BUDGET)
        results[i] = c.complete(prompts[i], max_new_tokens=10)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r.token_ids for r in results] == refs
    assert all(r.fault is None and r.mode in ("split", "device-only", "cloud-only") for r in results), [(r.mode, r.fault, r.error) for r in results]
    # every request reached the cloud and was freed there (Stop, Done or the device hanging up)
    deadline = time.monotonic() + 30
    while cloud.metrics.active_requests._value.get() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cloud.metrics.active_requests._value.get() == 0
    after = sum(s.value for m in requests.collect() for s in m.samples if s.name.endswith("_total"))
    assert after - before == 8


def test_http_side_health_metrics_and_device_model(cloud, onnx_engine, chat_prompt_ids, tmp_path, device_model_dir):
    from relayinfer.device.fetch import download_device_model
    from relayinfer.device.onnx_engine import OnnxEngine, onnx_file_name

    client(cloud, onnx_engine).complete(chat_prompt_ids[0], max_new_tokens=4, mode="cloud-only")  # tokens to count
    base = f"http://127.0.0.1:{cloud.http_port}"
    health = json.loads(urllib.request.urlopen(f"{base}/healthz").read())
    assert health["status"] == "ok" and health["model_fingerprint"] == cloud.fingerprint  # no token: details
    metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
    tokens = [line for line in metrics.splitlines() if line.startswith("relayinfer_cloud_tokens_total")]
    assert tokens and float(tokens[0].split()[-1]) > 0
    assert "relayinfer_active_sessions" in metrics and "relayinfer_prefill_seconds_bucket" in metrics
    d = download_device_model(base, tmp_path / "dl")
    onnx = (d / onnx_file_name()).read_bytes()
    assert hashlib.sha256(onnx).hexdigest() == json.loads((device_model_dir / "manifest.json").read_text())[
        "files"][onnx_file_name()]
    eng = OnnxEngine(d)
    assert eng.fingerprint == cloud.fingerprint
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/v1/device-model/../../etc/passwd")
    assert e.value.code == 404


def test_demo_cli_json():
    """The default demo (no prompt, no --max-new-tokens) chooses its conversation and answer length
    from the plan, and the answer is handed off: mode split at an index > 0 on the real model."""
    exe = shutil.which("relayinfer") or f"{sys.prefix}/bin/relayinfer"
    out = subprocess.run([exe, "demo", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for key in ("text", "token_ids", "mode", "ttft_ms", "tpot_ms_p50", "tpot_ms_max", "stalls", "cloud_tokens",
                "device_tokens", "handoff_index", "prompt_ids", "device_only_ttft_ms", "demo", "outcome"):
        assert key in res
    demo = res["demo"]
    assert res["device_weights"] == "gguf"
    assert demo["chosen_by_plan"] and demo["split"] and demo["label"].startswith("chitchat conversation")
    assert 0 < demo["planned_handoff"] <= demo["budget"] < demo["max_new_tokens"]
    assert res["sampling"] == {"max_new_tokens": demo["max_new_tokens"], "temperature": 0.2, "top_p": 0.9, "seed": 0}
    assert res["plan"] == "split" and res["fault"] is None and "the device takes over" in res["plan_reason"]
    assert res["mode"] == "split" and res["handoff_index"] > 0, (res["outcome"], res["plan_reason"])
    assert res["cloud_tokens"] == res["handoff_index"] and res["device_tokens"] == len(res["token_ids"]) - res["handoff_index"]
    assert res["outcome"].startswith(f"split: the cloud streamed tokens 0-{res['handoff_index'] - 1}, the device took "
                                     f"over at token {res['handoff_index']}")
    # a budget the device extended is said as such, not as a cap the cloud then broke
    assert ("extended the cloud's budget" in res["outcome"]) == (res["budget_extensions"] > 0), res["outcome"]
    assert out.stderr == "", out.stderr  # --json: nothing but the JSON object


def test_outcome_line_counts_the_budget_extensions():
    """The demo's and chat's second line: a split's hand-off, and how often the device extended
    the planned cloud budget (its prefill ran later than planned)."""
    from relayinfer.device.split import GenerationResult
    from relayinfer.sdk.cli import _outcome

    def res(ext):
        return GenerationResult("", [1] * 96, "split", 60.0, 60.0, 80.0, 0, 51, 45, 51, plan="split",
                                cloud_budget=53, budget_extensions=ext)

    assert _outcome(res(0)) == ("split: the cloud streamed tokens 0-50, the device took over at token 51 and "
                                "decoded 45 of the 96 (planned split)")
    assert _outcome(res(1)).endswith("(planned split); the device extended the cloud's budget once (its prefill "
                                     "ran later than planned)")
    assert "budget 2 times" in _outcome(res(2))


def test_demo_choice_follows_the_plan():
    """`choose_demo` takes the first candidate and the shortest answer whose plan hands off in its
    first 60 %: a phone that prefills a 114-token prompt in 1.9 s needs more than 64 tokens at a
    60 ms display; a 2000-token prompt fits at no length, and then the choice says why."""
    from relayinfer.device.settings import Timing
    from relayinfer.sdk.cli import DEMO_LENGTHS, choose_demo

    def timing(n):
        return Timing(0.0, 16.67, 52.6, 300.0 + n, 40.0)

    pick = choose_demo([("short", [1] * 114)], DEMO_LENGTHS, timing, 60.0, 108.0)
    assert pick["split"] and pick["label"] == "short" and pick["max_new_tokens"] == 96
    assert 0 < pick["planned_handoff"] <= 0.6 * 96 and pick["budget"] < 96
    pick = choose_demo([("long", [1] * 2000), ("short", [1] * 114)], DEMO_LENGTHS, timing, 60.0, 108.0)
    assert pick["label"] == "short"  # the long prompt fits at no length: the next candidate
    none = choose_demo([("long", [1] * 2000)], DEMO_LENGTHS, timing, 60.0, 108.0)
    assert not none["split"] and none["max_new_tokens"] == 256 and "cannot catch up" in none["plan_reason"]
