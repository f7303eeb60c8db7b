"""End to end through the link emulator (`sdk.linkem`): the real cloud service and the real device
model on loopback, with an emulated LTE link (a proxy, not a radio) between them. Greedy answers
must equal the device-only answer whatever the link does: delay, a cut mid-stream, a black hole."""
from __future__ import annotations

import threading
import time

import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.profiles import DeviceProfile
from relayinfer.sdk import Client
from relayinfer.sdk.linkem import PROFILES, LinkProxyThread

from conftest import BackgroundSlow, CloudFirstClient

MAX_NEW = 24
LTE = PROFILES["lte"]
# slower at prefill than the cloud, so the cloud's first tokens come before the device is ready
SLOW_DEVICE = DeviceProfile("test-slow", prefill_ms_per_token=40.0)
SLOWER_DEVICE = DeviceProfile("test-slower", prefill_ms_per_token=80.0)


@pytest.fixture(scope="module")
def cloud(torch_engine):
    # 50 ms between decode steps: a few tokens at most are in flight when a fault is injected
    svc = CloudService(torch_engine, torch_engine.fingerprint, step_delay_ms=50.0)
    with ServiceThread(svc, http_port=None) as running:
        yield running


@pytest.fixture(scope="module")
def device_only(onnx_engine, chat_prompt_ids):
    """The device-only greedy answers (no cloud)."""
    c = Client(engine=onnx_engine)
    return [c.complete(ids, max_new_tokens=MAX_NEW, mode="device-only").token_ids for ids in chat_prompt_ids]


def sessions_and_requests(svc) -> tuple[float, float]:
    reg = svc.metrics.registry
    return reg.get_sample_value("relayinfer_active_sessions"), reg.get_sample_value("relayinfer_active_requests")


def wait_idle(svc, bound_s: float = 10.0) -> tuple[float, float]:
    """The cloud's open sessions and requests, once both are 0 or after `bound_s`."""
    t = time.monotonic()
    while time.monotonic() - t < bound_s and sessions_and_requests(svc) != (0.0, 0.0):
        time.sleep(0.05)
    return sessions_and_requests(svc)


def generate_bounded(client: Client, ids, bound_s: float, on_event=None, **kw) -> dict:
    """Consume `client.generate(ids, **kw)` in a thread for at most `bound_s`: {'result' (None if it
    did not return in time), 'events' [(perf_counter, TokenEvent)], 'returned_at', 'error'}."""
    box: dict = {"result": None, "events": [], "returned_at": None, "error": None}

    def consume():
        try:
            stream = client.generate(ids, max_new_tokens=MAX_NEW, **kw)
            for ev in stream:
                box["events"].append((time.perf_counter(), ev))
                if on_event is not None:
                    on_event(ev)
            box["result"] = stream.result
        except BaseException as e:  # surfaced by the test's asserts
            box["error"] = e
        box["returned_at"] = time.perf_counter()

    th = threading.Thread(target=consume, name="test-generate", daemon=True)
    th.start()
    th.join(bound_s)
    return box


def test_split_through_lte_equals_device_only(cloud, onnx_engine, chat_prompt_ids, device_only):
    with LinkProxyThread(cloud.url, LTE, seed=1) as link:
        c = CloudFirstClient(cloud_url=link.url, engine=onnx_engine, profile=SLOW_DEVICE, target_tpot_ms=30.0, cloud_budget=8)
        for k, (ids, ref) in enumerate(zip(chat_prompt_ids[:2], device_only)):
            r = c.complete(ids, max_new_tokens=MAX_NEW)
            assert r.token_ids == ref
            assert r.mode == "split" and r.fault is None and 1 <= r.cloud_tokens <= 8 and r.device_tokens > 0
            # the first call: HTTP upgrade, Hello/Welcome, Generate/first Token: three round trips of
            # >= 2 x 30 ms; the next ones reuse the client's websocket: Generate/first Token only
            assert r.ttft_ms >= (6 if k == 0 else 2) * LTE.delay_ms
        counters = link.counters()
        c.close()
    assert counters["connections"] == 1 and counters["bytes_down"] > 0 and counters["bytes_up"] > 0
    assert counters["cuts"] == 0 and counters["loss_stalls_down"] == 0


def _cut_after_first_token(link):
    """An on_event hook that cuts the link's connections when the first token is shown: the stream
    is known to have started (the handshake and Generate went through), whatever the machine's load."""
    def on_event(ev):
        if ev.index == 0:
            on_event.cut = link.cut()
    on_event.cut = None
    return on_event


def test_link_cut_mid_stream_device_completes(cloud, onnx_engine, chat_prompt_ids, device_only):
    with LinkProxyThread(cloud.url, LTE, seed=2) as link:
        # prefill takes seconds on this device: the cut comes long before it could take over
        c = CloudFirstClient(cloud_url=link.url, engine=onnx_engine, profile=SLOWER_DEVICE, target_tpot_ms=30.0,
                   cloud_budget=None)
        hook = _cut_after_first_token(link)
        box = generate_bounded(c, chat_prompt_ids[1], 60.0, on_event=hook)
        counters = link.counters()
    r = box["result"]
    assert box["error"] is None and r is not None
    assert hook.cut == 1  # the request's one connection was open when the first token was shown
    assert r.token_ids == device_only[1]
    assert r.fault == "connection-lost" and r.mode == "split"
    assert 1 <= r.cloud_tokens <= MAX_NEW // 2 and r.device_tokens == len(r.token_ids) - r.cloud_tokens
    assert counters["cuts"] == 1 and counters["active"] == 0
    assert wait_idle(cloud) == (0.0, 0.0)  # the cloud noticed and freed the request


def _blackhole_after_first_token(link):
    def on_event(ev):
        if ev.index == 0:
            link.blackhole()
            on_event.at = time.perf_counter()
    on_event.at = None
    return on_event


def test_blackhole_while_device_prefills_ends_bounded(cloud, onnx_engine, chat_prompt_ids, device_only):
    """The network goes silent after the first token while the device is prefilling: the device
    completes from what it has and the call returns (no hang on the silent socket)."""
    with LinkProxyThread(cloud.url, LTE, seed=3) as link:
        c = CloudFirstClient(cloud_url=link.url, engine=onnx_engine, profile=SLOWER_DEVICE, target_tpot_ms=30.0,
                   cloud_budget=None)
        hook = _blackhole_after_first_token(link)
        box = generate_bounded(c, chat_prompt_ids[1], 90.0, on_event=hook)
        assert link.blackholed and link.active == 1  # the socket was held open all along
    r = box["result"]
    assert box["error"] is None and r is not None, box
    assert r.token_ids == device_only[1] and r.mode == "split" and r.device_tokens > 0
    # the device may take over before or after the progress timeout notices the silence
    assert r.fault in (None, "cloud-stalled"), r.fault
    last_token_at = box["events"][-1][0]
    # the device's own work after the black hole: prefill (~40 tokens x 80 ms) + catch-up + 24 decodes
    assert last_token_at - hook.at < 20.0
    # and the call returns after its last token without waiting out the websocket close timeout
    # (10 s) although the close handshake gets no answer: the close is bounded by SEND_TIMEOUT_S
    assert box["returned_at"] - last_token_at < 6.0, box["returned_at"] - last_token_at
    assert wait_idle(cloud) == (0.0, 0.0)


class PlannedIdleClient(Client):
    """Plans with a device that cannot catch up (1 s per prefill token >= any display interval), so
    the settings algorithm streams from the cloud to the end and the device stays idle; the device
    really runs at its own speed if it has to take over."""

    def device_timing(self):
        return (0.0, 1000.0, 50.0)


def test_blackhole_while_device_idle_ends_bounded(cloud, onnx_engine, chat_prompt_ids, device_only):
    """The settings planned the cloud to the end (device idle); the network goes silent after the
    first token: a progress timeout must notice, the device prefills and completes the answer.
    (Its background prefill, 150 ms a token, is still short of the prompt then: a held device that
    caught up would take over by itself.)"""
    with LinkProxyThread(cloud.url, LTE, seed=4) as link:
        c = PlannedIdleClient(cloud_url=link.url, engine=BackgroundSlow(onnx_engine, 150.0), target_tpot_ms=30.0,
                              cloud_budget="auto")
        hook = _blackhole_after_first_token(link)
        box = generate_bounded(c, chat_prompt_ids[1], 45.0, on_event=hook)
    r = box["result"]
    assert box["error"] is None and r is not None, "no result within 45 s of a silent cloud"
    assert r.token_ids == device_only[1] and r.fault == "cloud-stalled" and r.device_tokens > 0
    assert r.mode == "split" and r.cloud_tokens >= 1
    assert box["returned_at"] - hook.at < 30.0
