"""One session per client and the KV hand-off from the batch, on the real model.

* A `Client` keeps one websocket (one Hello/Welcome) across its `generate` calls, multiplexes
  overlapping calls over it by request id, opens a new one after a cut (between calls, or mid-call:
  that call ends with its fault and the device's answer, the next one is whole), and frees it on
  `close()`. Handshakes are counted on the cloud (`relayinfer_sessions_total`).
* The KV hand-off (`Generate.kv_from`) stays in the continuous batch: the KV is copied out of the
  paged cache (float16, the ONNX past-KV layout) and the greedy tokens equal those of the device's
  own prefill, on chitchat prompts; it is charged to the memory budget.
* A multi-MB hand-off goes out in bounded pieces: a Stop or Cancel sent while it is in flight is
  acted on before it ends (no piece after the Pong that answers a Ping sent right after it; the
  Done comes with fewer pieces than the transfer has), asserted by the order of the frames.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.profiles import DeviceProfile
from relayinfer.protocol.messages import Cancel, Done, Generate, KVTransfer, Ping, Pong, Stop, Token
from relayinfer.sdk import Client
from relayinfer.sdk.datasets import chitchat_prompts_by_length
from relayinfer.sdk.linkem import LinkProxyThread

MAX_NEW = 16
SLOW_DEVICE = DeviceProfile("test-slow", prefill_ms_per_token=40.0)
PIECE = 256 << 10  # the cloud's KV piece size here (bytes): a 600-token hand-off is ~54 pieces


@pytest.fixture(scope="module")
def cloud(torch_engine):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=96 << 20))
    # no queue-wait refusals on this loaded 2-core machine: admission is not what is tested here
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, kv_piece_bytes=PIECE, max_queue_wait_ms=1e6)
    with ServiceThread(svc, http_port=None) as running:
        yield running


@pytest.fixture(scope="module")
def chitchat(tokenizer):
    """Chitchat prompts of about 64, 160 and 320 tokens (chat template applied)."""
    return chitchat_prompts_by_length(tokenizer, [64, 160, 320], seed=3)


def handshakes(svc) -> float:
    return svc.metrics.registry.get_sample_value("relayinfer_sessions_total") or 0.0


def wait_for(cond, bound_s: float = 20.0) -> bool:
    t = time.monotonic()
    while time.monotonic() - t < bound_s:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_generates_share_one_websocket_and_overlap_by_request_id(cloud, onnx_engine, chitchat):
    before = handshakes(cloud)
    with Client(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=4) as c:
        first = [c.complete(ids, max_new_tokens=MAX_NEW) for ids in chitchat[:2]]
        assert handshakes(cloud) - before == 1 and c.link.connections == 1
        assert first[0].plan_reason.startswith("a fixed cloud budget of 4 tokens, then the device takes over")
        # two calls at once from two threads: multiplexed over the same websocket (cloud-only, so that
        # every token crosses it whatever the machine's load: a split's device may answer first)
        out: dict = {}
        threads = [threading.Thread(target=lambda k=k: out.__setitem__(
            k, c.complete(chitchat[k], max_new_tokens=MAX_NEW, mode="cloud-only"))) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert handshakes(cloud) - before == 1 and c.link.connections == 1
        assert out[0].request_id != out[1].request_id
        for k in (0, 1):
            assert out[k].fault is None and out[k].mode == "cloud-only" and out[k].cloud_tokens == len(out[k].token_ids)
            assert out[k].token_ids == first[k].token_ids  # greedy: the same answer alone or side by side
        assert cloud.num_sessions >= 1
    assert wait_for(lambda: cloud.num_sessions == 0)  # close() freed the session


def test_cut_between_calls_reconnects_and_cut_mid_call_faults_then_next_works(cloud, onnx_engine, chitchat):
    n = 40
    ids = chitchat[0]
    device_only = Client(engine=onnx_engine).complete(ids, max_new_tokens=n, mode="device-only").token_ids
    before = handshakes(cloud)
    # slower at prefill than the cloud: its first tokens come long before the device could take over
    with LinkProxyThread(cloud.url, None) as link, \
            Client(cloud_url=link.url, engine=onnx_engine, cloud_budget=None, profile=SLOW_DEVICE) as c:
        a = c.complete(ids, max_new_tokens=n)
        assert a.fault is None and a.token_ids == device_only and c.link.connections == 1
        assert link.cut() == 1  # between calls: the kept websocket dies
        assert wait_for(lambda: c.link.channel is None)  # and the client noticed (its reader saw the close)
        b = c.complete(ids, max_new_tokens=n)
        assert b.fault is None and b.token_ids == device_only and b.cloud_tokens >= 1
        assert c.link.connections == 2 and handshakes(cloud) - before == 2

        cut = {}
        stream = c.generate(ids, max_new_tokens=n)
        for ev in stream:
            if ev.index == 0 and not cut:  # mid-call: cut when the first token is shown
                cut["n"] = link.cut()
        mid = stream.result
        assert cut["n"] == 1
        assert mid.fault == "connection-lost" and mid.token_ids == device_only  # the device finished alone
        after = c.complete(ids, max_new_tokens=n)
        assert after.fault is None and after.token_ids == device_only and after.cloud_tokens >= 1
        assert c.link.connections == 3 and handshakes(cloud) - before == 3


def test_kv_handoff_from_the_batch_equals_reprefill(cloud, onnx_engine, chitchat):
    """The batched path exports the prompt's KV (float16) from its paged cache; the device imports
    it and prefills only the last prompt token; greedy tokens equal the device's own prefill."""
    llm = cloud.llm
    with Client(cloud_url=cloud.url, engine=onnx_engine, kv_handoff=True, cloud_budget=None) as handoff, \
            Client(cloud_url=cloud.url, engine=onnx_engine, kv_handoff=False, cloud_budget=None) as own:
        for ids in chitchat:
            a = handoff.complete(ids, max_new_tokens=MAX_NEW)
            b = own.complete(ids, max_new_tokens=MAX_NEW)
            assert a.fault is None and b.fault is None, (a.error, b.error)
            assert a.kv_imported_tokens == len(ids) - 1 and a.device_prompt_tokens == 1
            assert b.kv_imported_tokens == 0
            assert a.token_ids == b.token_ids
            # it ran in the batch: the batching engine knows the request
            assert any(k.endswith("/" + a.request_id) for k in llm.engine.stats)
    assert cloud.per_request.state() == {"running": 0}
    # every hand-off's charge was released: only the batching engine's pool stays charged
    assert wait_for(lambda: cloud.budget.used == llm.limits.kv_pool_bytes)


def test_batched_kv_export_matches_the_per_request_kv(torch_engine, chitchat):
    """`AsyncLLMEngine.generate(kv_from=k)` yields token 0, then the float16 KV of prompt positions
    [k, n - 1) copied from the paged cache: equal to the per-request engine's (fp16 rounding)."""
    from relayinfer.cloud.engine.interface import KVParts
    from relayinfer.cloud.engine.per_request import PerRequestEngine
    from relayinfer.protocol.model.decoding import SamplingParams

    ids, k = chitchat[1], 5
    params = SamplingParams(max_new_tokens=3)

    async def main():
        llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=32 << 20))
        per = PerRequestEngine(torch_engine, lambda: None)
        try:
            batched = [o async for o in llm.generate("b", ids, params, kv_from=k)]
            alone = [o async for o in per.generate("p", ids, params, kv_from=k)]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            per.shutdown()
        return batched, alone

    batched, alone = asyncio.run(main())
    assert [type(o).__name__ for o in batched] == [type(o).__name__ for o in alone] == \
        ["StepOutput", "KVParts", "StepOutput", "StepOutput"]
    kb, kp = batched[1], alone[1]
    assert isinstance(kb, KVParts) and kb.token_start == kp.token_start == k
    cfg = torch_engine.cfg
    assert kb.kv.dtype == np.float16 and kb.kv.shape == kp.kv.shape == (cfg.n_layers, 2, cfg.n_kv_heads,
                                                                         len(ids) - 1 - k, cfg.head_dim)
    assert np.allclose(kb.kv.astype(np.float32), kp.kv.astype(np.float32), atol=2e-2, rtol=1e-2)
    assert [o.token_id for o in batched if type(o).__name__ == "StepOutput"] == \
        [o.token_id for o in alone if type(o).__name__ == "StepOutput"]
    # the messages of the hand-off carry exactly those positions
    msgs = kb.messages
    assert msgs[0].token_start == k and sum(m.num_tokens for m in msgs) == len(ids) - 1 - k


def test_batched_kv_handoff_is_charged_to_the_memory_budget(torch_engine, chitchat):
    """A hand-off from the batch is charged its float16 copy while it is sent: with no room beyond
    the KV pool it is refused OVERLOADED naming the hand-off, a plain request of the same prompt runs."""
    from relayinfer.protocol.transport import ws as proto_ws

    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm,
                       memory_bytes=llm.limits.kv_pool_bytes + (1 << 20))
    ids = chitchat[2]

    async def ask(kv_from):
        ch = await proto_ws.open_channel(svc.url, torch_engine.fingerprint)
        try:
            await ch.send(Generate("r", ids, 2, kv_from=kv_from))
            while True:
                m = await ch.recv()
                if not isinstance(m, (Token, KVTransfer)):
                    return m
        finally:
            await ch.close()

    with ServiceThread(svc, http_port=None):
        refused = asyncio.run(ask(0))
        plain = asyncio.run(ask(None))
    assert refused.code == "overloaded" and "KV hand-off" in refused.message, refused
    assert isinstance(plain, Done) and plain.cloud_tokens == 2
    assert svc.metrics.registry.get_sample_value("relayinfer_memory_refusals_total", {"path": "kv_handoff"}) == 1


@pytest.mark.parametrize("end", ["cancel", "stop"])
def test_stop_or_cancel_mid_transfer_is_acted_on_before_the_transfer_ends(cloud, torch_engine, tokenizer, end):
    """A ~14 MB hand-off in 256 KiB pieces to a device that reads one piece, then sends Cancel (or
    Stop) and a Ping, and reads nothing more until the cloud's engine has dropped the request (its
    small receive buffer keeps the cloud from writing ahead). Then: the Pong comes before any
    further piece, no piece follows it, and one Done (reason cancel / stop; it may come before or
    after the Pong) ends the call with fewer pieces than the transfer has."""
    from relayinfer.protocol.transport import ws as proto_ws

    ids = chitchat_prompts_by_length(tokenizer, [600], seed=5)[0]
    rid = f"kv-{end}"
    llm = cloud.llm

    async def main():
        host, port = cloud.url.removeprefix("ws://").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # no autotuned 32 MB window
        sock.connect((host, int(port)))
        ch = await proto_ws.open_channel(cloud.url, torch_engine.fingerprint, sock=sock)
        frames = []
        try:
            await ch.send(Generate(rid, ids, 200, kv_from=0))
            while True:
                m = await asyncio.wait_for(ch.recv(), 60)
                frames.append(m)
                if isinstance(m, KVTransfer):
                    break
            await ch.send(Cancel(rid) if end == "cancel" else Stop(rid, 1))
            await ch.send(Ping(7, 0.0))
            # the cloud acted on it: the engine dropped the request (the device reads nothing meanwhile)
            acted = await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: not any(k.endswith("/" + rid) for k in llm.engine.seqs), 30.0)
            # the Stop's Done may overtake the Pong (both are answers to frames the cloud has read)
            while not (any(isinstance(m, Done) for m in frames) and any(isinstance(m, Pong) for m in frames)):
                frames.append(await asyncio.wait_for(ch.recv(), 60))
        finally:
            await ch.close()
        return frames, acted

    dropped0 = cloud.metrics.registry.get_sample_value("relayinfer_kv_pieces_total", {"outcome": "dropped"}) or 0
    frames, acted = asyncio.run(main())
    assert acted
    kinds = [type(m).__name__ for m in frames]
    pieces = [m for m in frames if isinstance(m, KVTransfer)]
    total = pieces[0].num_blocks
    per_token = pieces[0].kv.to_numpy()[:, :, :, :1].nbytes
    assert total * PIECE >= (len(ids) - 1) * per_token > 12e6  # a multi-MB transfer in many pieces
    assert "Pong" in kinds
    pong = kinds.index("Pong")
    assert "KVTransfer" not in kinds[pong:]  # nothing of the transfer after the Pong
    assert len(pieces) < total  # the transfer did not run to its end
    assert [m.block_index for m in pieces] == list(range(len(pieces)))  # in order, none skipped
    (done,) = [m for m in frames if isinstance(m, Done)]
    assert done.reason == end, done
    assert all(isinstance(m, (Token, KVTransfer, Pong, Done)) for m in frames)
    dropped = cloud.metrics.registry.get_sample_value("relayinfer_kv_pieces_total", {"outcome": "dropped"})
    assert dropped - dropped0 == total - len(pieces)


def test_paced_kv_handoff_lets_the_tokens_through_a_capped_link(cloud, torch_engine, tokenizer):
    """A ~3.7 MB hand-off over a link capped at 2 MB/s (a FIFO queue, as a radio link is). Unpaced,
    the pieces fill the link's queue and the tokens the cloud streams meanwhile arrive behind the
    last piece; paced at `kv_rate` 1.5 MB/s (pieces of about 20 ms of it), most of them arrive
    between two pieces, and every piece is within the paced size."""
    from relayinfer.protocol.kvhandoff import FRAME_MARGIN, paced_piece_bytes
    from relayinfer.protocol.transport import ws as proto_ws
    from relayinfer.sdk.linkem import LinkProfile

    ids = chitchat_prompts_by_length(tokenizer, [160], seed=5)[0]
    rate = 1.5e6

    async def run(link_url: str, kv_rate: float | None, rid: str):
        ch = await proto_ws.open_channel(link_url, torch_engine.fingerprint)
        frames = []
        try:
            await ch.send(Generate(rid, ids, 400, kv_from=0, kv_rate=kv_rate))
            while True:
                m = await asyncio.wait_for(ch.recv(), 60)
                frames.append(m)
                if isinstance(m, KVTransfer) and m.block_index in (-1, m.num_blocks - 1):
                    break
                assert not isinstance(m, Done), "the answer ended before the hand-off"
            await ch.send(Cancel(rid))
            while not isinstance(frames[-1], Done):
                frames.append(await asyncio.wait_for(ch.recv(), 60))
        finally:
            await ch.close()
        return frames

    profile = LinkProfile("capped", down_bytes_per_s=2e6)
    with LinkProxyThread(cloud.url, profile) as link:
        unpaced = asyncio.run(run(link.url, None, "kv-unpaced"))
        paced = asyncio.run(run(link.url, rate, "kv-paced"))

    def between(frames):  # tokens after token 0 that arrived before the last piece
        last = max(i for i, m in enumerate(frames) if isinstance(m, KVTransfer))
        return sum(1 for m in frames[:last] if isinstance(m, Token) and m.index > 0)

    pieces = [m for m in paced if isinstance(m, KVTransfer)]
    per_token = pieces[0].kv.to_numpy()[:, :, :, :1].nbytes
    limit = paced_piece_bytes(rate, PIECE, per_token + FRAME_MARGIN)
    assert len(pieces) == pieces[0].num_blocks and sum(p.num_tokens for p in pieces) == len(ids) - 1
    assert all(len(p.kv.data) <= limit for p in pieces) and limit < PIECE
    assert between(paced) >= 5 and between(paced) > 2 * between(unpaced), (between(paced), between(unpaced))


def _never_awaited(caught) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "never awaited" in str(w.message)]


def test_close_on_the_clients_own_loop_thread_closes_the_websocket(cloud, onnx_engine, chitchat):
    """`Client.close()` called on the client's own event-loop thread (from a callback there) closes
    the websocket on that thread and closes the loop, leaves no coroutine never awaited, and is
    idempotent; a later request opens a new loop and websocket; a loop stopped by someone else
    closes its websocket too (and `close()` after that is a no-op)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Client(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=4)
        first = c.complete(chitchat[0], max_new_tokens=4, mode="cloud-only")
        link, loop = c.link, c._rt.loop
        assert first.fault is None and link.channel is not None
        called = threading.Event()
        loop.call_soon_threadsafe(lambda: (c.close(), called.set()))
        assert called.wait(5.0)
        assert wait_for(lambda: loop.is_closed(), 5.0) and link.channel is None
        c.close()  # idempotent
        again = c.complete(chitchat[0], max_new_tokens=4, mode="cloud-only")
        assert again.token_ids == first.token_ids and c.link is not link and c.link.connections == 1
        link, loop = c.link, c._rt.loop
        loop.call_soon_threadsafe(loop.stop)  # stopped from outside the client
        assert wait_for(lambda: loop.is_closed(), 5.0) and link.channel is None
        c.close()
        del link, loop, c
        gc.collect()
    assert _never_awaited(caught) == []
    assert wait_for(lambda: cloud.num_sessions == 0, 5.0)


def test_blocking_calls_on_the_clients_own_loop_thread_raise_instead_of_deadlocking(cloud, onnx_engine, chitchat):
    """On the client's own event-loop thread the calls that wait for that loop raise RuntimeError
    naming themselves (complete, Conversation.send, iterating a Stream, check_cloud) instead of
    waiting for ever; `Conversation.close()` there is scheduled and closes the conversation's
    websocket; from another thread the client goes on working."""
    import warnings

    with warnings.catch_warnings(record=True) as caught, \
            Client(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=4) as c:
        warnings.simplefilter("always")
        conv = c.conversation(max_new_tokens=4, mode="cloud-only")
        assert conv.send("Hi there").fault is None and conv.link.channel is not None

        async def on_loop():
            out = {}
            for name, call in (("Client.complete", lambda: c.complete(chitchat[0], max_new_tokens=4)),
                               ("Conversation.send", lambda: conv.send("And then?")),
                               ("Client.check_cloud", c.check_cloud),
                               ("Client.generate", lambda: c.generate(chitchat[0], max_new_tokens=2).collect())):
                try:
                    call()
                    out[name] = None
                except RuntimeError as e:
                    out[name] = str(e)
            conv.close()  # scheduled on this loop, not waited for
            return out

        out = asyncio.run_coroutine_threadsafe(on_loop(), c._rt.loop).result(5.0)
        for name, msg in out.items():
            assert msg is not None and name in msg and "thread" in msg, (name, msg)
        assert wait_for(lambda: conv.link.channel is None, 5.0)
        assert len(conv.results) == 1  # the refused send added no turn
        assert c.complete(chitchat[0], max_new_tokens=4, mode="cloud-only").fault is None
    assert _never_awaited(caught) == []


def test_runtime_close_from_any_thread_awaits_the_link_close():
    """The client's runtime (its loop thread and websocket) closed from its own loop thread, after
    its loop was stopped by someone else, and from another thread while a generation is still
    running: each time the link's `aclose()` is awaited once, on the loop's thread, the loop ends
    closed, the pending work is cancelled, and no coroutine is left never awaited; a coroutine
    handed to a closed runtime is refused (RuntimeError naming the caller) without being made."""
    import gc
    import warnings

    from relayinfer.sdk.client import _Runtime

    class Link:  # a CloudLink's close, recorded
        def __init__(self):
            self.closed_on: list[str] = []

        async def aclose(self):
            await asyncio.sleep(0.01)
            self.closed_on.append(threading.current_thread().name)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = _Runtime()
        lt = rt.loop_()
        rt.link = own = Link()
        called = threading.Event()
        lt.loop.call_soon_threadsafe(lambda: (rt.close(1.0), called.set()))
        assert called.wait(2.0)
        lt.thread.join(3.0)
        assert own.closed_on == ["relayinfer-client"] and lt.loop.is_closed() and rt.current is None
        rt.close()  # idempotent

        lt = rt.loop_()
        rt.link = stopped = Link()
        lt.loop.call_soon_threadsafe(lt.loop.stop)
        lt.thread.join(3.0)
        rt.close()
        assert stopped.closed_on == ["relayinfer-client"] and lt.loop.is_closed() and rt.link is None

        lt = rt.loop_()
        rt.link = other = Link()
        running = lt.submit(lambda: asyncio.sleep(60), "test")
        t0 = time.monotonic()
        rt.close(1.0)
        assert other.closed_on == ["relayinfer-client"] and running.cancelled() and time.monotonic() - t0 < 2.0
        made = []
        with pytest.raises(RuntimeError, match="Client.generate: the client was closed"):
            lt.submit(lambda: made.append(1), "Client.generate")
        assert made == []
        del lt, rt
        gc.collect()
    assert _never_awaited(caught) == [] and not [w for w in caught if "unclosed event loop" in str(w.message)]
