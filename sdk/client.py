"""The public API: `Client.generate` / `agenerate` over the cloud -> device split.

    from relayinfer.sdk import Client
    client = Client(cloud_url="ws://127.0.0.1:8765", target_tpot_ms=50)
    stream = client.generate("What is the capital of France?", max_new_tokens=64)
    for ev in stream:                       # TokenEvent(text, token_id, source, shown_at_ms, index)
        print(ev.text, end="", flush=True)
    print(stream.result.mode, stream.result.ttft_ms)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator, Sequence

from relayinfer.protocol.errors import RemoteError
from relayinfer.device.settings import CloudEstimate
from relayinfer.device.split import GenerationResult, SplitOptions, SplitSession, TokenEvent
from relayinfer.sdk.checks import check_cloud_url
from relayinfer.protocol.validate import check_prompt_text
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.grammar import json_schema_grammar
from relayinfer.protocol.validate import FieldError, check_ids, check_vocab

_END = object()
CLOUD_FAULTS = ("cloud-unreachable", "cloud-refused", "cloud-overloaded")  # the cloud did not take the request
log = logging.getLogger("relayinfer.sdk")


class Stream:
    """Iterator of `TokenEvent`s as they are shown; `result` (a `GenerationResult`) once exhausted.
    Errors raised by the generation are re-raised from the iteration.

    With `loop` (the client's `_LoopThread`) the generation runs there. Raises RuntimeError
    naming `what` when that loop is closed meanwhile (the generation never starts), and from the
    iteration when it runs on that loop's own thread (it would wait for itself for ever)."""

    def __init__(self, run, loop: "_LoopThread | None" = None, what: str = "Client.generate"):
        self._q: queue.Queue = queue.Queue()
        self.result: GenerationResult | None = None
        self._thread = None
        self._lt, self._what = loop, what
        if loop is not None:  # on a running loop (the client's): no thread of its own
            fut = loop.submit(lambda: run(self._q.put), what)

            def done(f):
                if f.cancelled():
                    self._q.put(asyncio.CancelledError())
                elif f.exception() is not None:
                    self._q.put(f.exception())
                else:
                    self.result = f.result()
                    self._q.put(_END)
            fut.add_done_callback(done)
            return

        def target():
            try:
                self.result = asyncio.run(run(self._q.put))
                self._q.put(_END)
            except BaseException as e:  # surfaced to the consumer
                self._q.put(e)

        self._thread = threading.Thread(target=target, name="relayinfer-generate", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._lt is not None and self._lt.on_thread():
            raise RuntimeError(f"iterating the Stream of {self._what} on the client's own event-loop thread would "
                               "deadlock (its generation runs on that thread): use Client.agenerate there, or "
                               "iterate from another thread")
        while True:
            item = self._q.get()
            if item is _END:
                if self._thread is not None:
                    self._thread.join()
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def collect(self) -> GenerationResult:
        """Consume the stream and return the final result. Raises what the iteration raises."""
        for _ in self:
            pass
        return self.result


class AsyncStream:
    """Async iterator of `TokenEvent`s; `result` once exhausted. With `loop` (the client's event
    loop, where its websocket lives) the generation runs there and its events cross to the caller's
    loop in order; cancelling the iteration's task cancels the generation."""

    def __init__(self, run, loop: "_LoopThread | None" = None, what: str = "Client.agenerate"):
        self._q: asyncio.Queue = asyncio.Queue()
        self.result: GenerationResult | None = None
        here = asyncio.get_running_loop()
        if loop is None or loop.loop is here:
            self._task = here.create_task(self._go(run))
        else:
            self._task = here.create_task(self._go_on(run, loop, here, what))

    async def _go(self, run):
        try:
            self.result = await run(self._q.put_nowait)
            self._q.put_nowait(_END)
        except BaseException as e:
            self._q.put_nowait(e)

    async def _go_on(self, run, loop: "_LoopThread", here, what: str):
        put = lambda ev: here.call_soon_threadsafe(self._q.put_nowait, ev)  # noqa: E731  FIFO: before the end
        try:  # RuntimeError (from the iteration) when the client's loop closed meanwhile
            self.result = await asyncio.wrap_future(loop.submit(lambda: run(put), what))
            self._q.put_nowait(_END)
        except BaseException as e:
            self._q.put_nowait(e)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._q.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.result


def _refuse_in_running_loop(what: str) -> None:
    """Raise RuntimeError naming `what` when this thread runs an event loop: `what` runs an event
    loop of its own (`asyncio.run`) and blocks, which cannot be done there (checked before any
    coroutine is made, so none is left never awaited)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} blocks and cannot be called on a thread that runs an event loop (the client's "
                       "own included): call it from another thread, e.g. `await asyncio.to_thread(...)`")


def device_model_url(cloud_url: str, token: str | None = None, ssl=None, timeout_s: float = 5.0) -> str | None:
    """Where the cloud at `cloud_url` (ws:// or wss://) serves its device model: the HTTP base URL
    (http(s)://HOST:PORT, the form `device.fetch` takes) of the `device_model_url` its Welcome
    names, asked with an empty-fingerprint Hello (the cloud closes after the Welcome). A loopback
    or unspecified host in it (a cloud bound to all interfaces names itself 127.0.0.1) is replaced
    by the host dialled. None when the cloud serves no device model.

    Raises:
        RemoteError: the cloud refused the handshake (UNAUTHORIZED, OVERLOADED, ...).
        OSError, TimeoutError: the cloud cannot be reached within `timeout_s` (s).
        RuntimeError: called on a thread that runs an event loop (it blocks; nothing is sent)."""
    from urllib.parse import urlsplit, urlunsplit

    _refuse_in_running_loop("device_model_url")

    from relayinfer.protocol.transport import ws as proto_ws

    async def ask():
        ch = await proto_ws.open_channel(cloud_url, "", token, client="relayinfer-device", open_timeout=timeout_s,
                                         **({"ssl": ssl} if ssl is not None else {}))
        try:
            return ch.welcome.device_model_url
        finally:
            await asyncio.wait_for(ch.close(), timeout_s)

    url = asyncio.run(asyncio.wait_for(ask(), 2 * timeout_s + 1.0))
    if not url:
        return None
    u, dialled = urlsplit(url), urlsplit(cloud_url)
    host = u.hostname or ""
    if host in ("127.0.0.1", "localhost", "0.0.0.0", "::", "::1") and dialled.hostname not in (None, host):
        h = f"[{dialled.hostname}]" if ":" in dialled.hostname else dialled.hostname
        u = u._replace(netloc=f"{h}:{u.port}" if u.port else h)
    path = u.path[:-len("/v1/device-model")] if u.path.endswith("/v1/device-model") else u.path
    return urlunsplit(u._replace(path=path.rstrip("/")))


class Client:
    """Split-inference client: the device runtime plus an optional cloud prefill service.

    Args:
        cloud_url: ws:// or wss:// (TLS) URL of `relayinfer cloud serve` (None = device-only).
        model: GGUF path (default SmolLM2-135M-Instruct); its exported ONNX model is used on device.
        target_tpot_ms: the TPOT shown to the user (ms per token).
        token: bearer token for the cloud.
        mode: 'split' (default), 'device-only' or 'cloud-only'.
        threads: ONNX Runtime intra-op threads (device default 1).
        quantize: device weights of a locally exported model: None / 'gguf' (the GGUF's own blocks),
            'gguf-q8' (the MLP and 8-bit blocks on int8 activations) or 'fp32' (`protocol.model.device_model.WEIGHTS`).
        cloud_budget: most tokens the cloud streams per request: 'auto' (the settings algorithm
            chooses it from the device timing and the cloud estimates), an int, or None (until the
            device takes over).
        profile: device profile ('local', 'phone', a JSON path, or a `DeviceProfile`) pacing the device engine.
        engine: an already loaded device engine to share (tests, load generators); `model`,
            `quantize` and `threads` are then refused (ValueError).
        ca: PEM file of the CA that signed the cloud's certificate (a private or self-signed CA)
            for a wss:// cloud; None = the system CAs.
        verify: False turns certificate and host-name verification off for wss:// (a warning is
            logged; the token can then be intercepted).
        cloud_http_url: http:// or https:// URL of the cloud's HTTP side (`cloud serve --http-port`),
            an override: without it and without a local export, the Client asks the cloud at
            `cloud_url` where its device model is (`device_model_url`, the handshake's Welcome).
            Either way, with no `model`, the device model (ONNX, tokenizer, config) comes from the cloud's
            `/v1/device-model`: cached by the model fingerprint in `cache_dir()/models/`, every
            file's sha256 checked, an interrupted download resumed (`device.fetch`). Without it the
            model must already be exported locally (`relayinfer export`). Neither path imports torch.
        progress: `progress(file_name, done_bytes, total_bytes)` during a download (the CLI's bar).
        kv_handoff: the cloud sends the prompt's KV instead of the device prefilling it: 'auto'
            (where the link bandwidth makes it faster, `protocol.kvhandoff.kv_handoff_pays`), True
            or False (`SplitOptions.kv_handoff`).
        kv_wire: the KV's format on the wire: 'auto' (float16 where that pays, else int8 where
            that does), 'float16' or 'int8' (`SplitOptions.kv_wire`).
        link_bytes_per_s: the link's bandwidth (bytes/s) for that choice; None = unknown (no KV
            hand-off under 'auto') until `measure_link()` measures it.
        reconnect_attempts, reconnect_backoff_s: how the client's websocket is opened again after
            it was lost (`device.link.CloudLink`): more tries after a transport failure, the first
            wait (s, doubling).

    One session per client: every `generate` / `agenerate` / `complete` of a Client uses one
    websocket (`link`, a `device.link.CloudLink`), opened by the first request that needs the cloud
    and kept across calls, so only the first request pays the TCP handshake, the websocket upgrade
    and the Hello/Welcome (three round trips) before its Generate leaves. All of them run on the
    client's own event loop (a daemon thread). Calls may overlap, from any threads or event loops:
    they are multiplexed over that one websocket by request id (the cloud runs them side by side,
    up to its per-session limit, `CloudService.max_requests_per_session`, OVERLOADED beyond it), and
    their device engine calls take turns on the client's one device thread. A request in flight
    when the connection is lost ends as before (the device finishes alone, `fault`
    'connection-lost'); the next request opens a new connection (retried as above). `close()` (or
    leaving `with Client(...) as c:`) closes the websocket and stops the loop; a Client that is
    garbage-collected closes them too. Each `Conversation` keeps a websocket of its own (the cloud
    keeps a conversation's KV per session).

    A wss:// cloud whose certificate does not verify is treated like an unreachable one: the
    answer comes from the device (`fault` 'cloud-unreachable', `error` naming the certificate
    problem), or `cloud-only` raises the `ssl.SSLCertVerificationError`. A cloud that cannot be
    reached (or refuses, or is overloaded) is logged once as a warning on the `relayinfer.sdk`
    logger, `cloud unreachable at URL: falling back to the device (reason)` (`cloud refused the
    session at ...`, `cloud is overloaded at ...`; a fingerprint refusal says the cloud serves
    another model), and again only after
    it was reachable in between; `check_cloud()` tries it without generating.

    Raises:
        ValueError: `cloud_url` is not ws://HOST[:PORT] or wss://HOST[:PORT] (checked before the
            model loads; an http:// URL gets a hint at the websocket port); `ca` is missing or holds
            no PEM certificate.
        ModelFileError: no model file and no `cloud_http_url`, no exported device model, or a
            downloaded file whose sha256 does not match the cloud's manifest.
        RemoteError: UNAUTHORIZED when the cloud's HTTP side refuses `token`.
        urllib.error.URLError: `cloud_http_url` cannot be reached (or has no device model: 404).
    """

    def __init__(self, cloud_url: str | None = None, model: str | os.PathLike | None = None,
                 target_tpot_ms: float = 50.0, token: str | None = None, mode: str = "split", threads: int | None = None,
                 quantize: str | None = None, cloud_budget: int | None | str = "auto", connect_timeout_s: float = 5.0,
                 profile=None, engine=None, ca: str | os.PathLike | None = None, verify: bool = True,
                 cloud_http_url: str | None = None, progress=None, kv_handoff: bool | str = "auto",
                 link_bytes_per_s: float | None = None, reconnect_attempts: int = 2,
                 reconnect_backoff_s: float = 0.1, kv_wire: str = "auto"):
        from relayinfer.protocol.transport.security import context_for_url

        if cloud_url is not None:
            cloud_url = check_cloud_url(cloud_url)
        self.cloud_url, self.token = cloud_url, token
        self._cloud_down = False  # a cloud fault was logged and the cloud has not answered since
        self.ssl = context_for_url(cloud_url, ca, verify)  # ssl.SSLContext for wss://, None for ws://
        self.options = SplitOptions(mode=mode, target_tpot_ms=target_tpot_ms, cloud_budget=cloud_budget,
                                    connect_timeout_s=connect_timeout_s, kv_handoff=kv_handoff,
                                    kv_wire=kv_wire, link_bytes_per_s=link_bytes_per_s)
        self.cloud_http_url, self._ca, self._verify = cloud_http_url, ca, verify
        self._rt = _Runtime()  # the client's event loop and websocket (`_client_loop`, `link`)
        self._reconnect = (reconnect_attempts, reconnect_backoff_s)
        if reconnect_attempts < 0 or not reconnect_backoff_s >= 0:
            raise ValueError(f"reconnect_attempts must be >= 0 and reconnect_backoff_s >= 0 (s), got "
                             f"{reconnect_attempts}, {reconnect_backoff_s}")
        weakref.finalize(self, self._rt.close, 1.0)
        if cloud_http_url is not None and not cloud_http_url.startswith(("http://", "https://")):
            raise ValueError(f"cloud_http_url must be http://HOST:PORT or https://HOST:PORT, got {cloud_http_url!r}")
        from relayinfer.protocol.model.device_model import check_weights

        check_weights(quantize, "quantize")
        if engine is not None:
            given = [n for n, v in (("model", model), ("quantize", quantize), ("threads", threads)) if v is not None]
            if given:
                raise ValueError(f"{given[0]} does not apply with engine= (the engine is already loaded); pass one or "
                                 "the other")
        if engine is None:
            from relayinfer.device.onnx_engine import OnnxEngine, device_model_dir, onnx_file_name
            from relayinfer.protocol.model.errors import ModelFileError

            if cloud_http_url is not None and model is None:
                if quantize:
                    raise ValueError("quantize applies to a locally exported model; the cloud serves its default device "
                                         "model (the GGUF's own blocks)")
                from relayinfer.device.fetch import cached_device_model

                d = cached_device_model(cloud_http_url, token, context_for_url(cloud_http_url, ca, verify),
                                        progress=progress)
            else:  # a local export (`relayinfer export`); the Client never exports (that needs torch)
                try:
                    d = device_model_dir(model)
                    if not (d / onnx_file_name(quantize)).is_file():  # the model file but no export
                        raise ModelFileError(f"no exported device model in {d}; run `relayinfer export`")
                except ModelFileError as e:
                    if model is not None:
                        raise
                    url = device_model_url(cloud_url, token, self.ssl, connect_timeout_s) if cloud_url else None
                    if not url:
                        raise ModelFileError(f"{e.message}; or fetch the device model from the cloud: "
                                             "Client(cloud_url=...) of a cloud that serves it, or "
                                             "Client(cloud_http_url=...), `relayinfer chat --cloud-http URL`") from None
                    if quantize:
                        raise ValueError("quantize applies to a locally exported model; the cloud serves its default device "
                                         "model (the GGUF's own blocks)")
                    from relayinfer.device.fetch import cached_device_model

                    d = cached_device_model(url, token, context_for_url(url, ca, verify), progress=progress)
            engine = OnnxEngine(d, quantize=quantize, threads=threads or 1)
            engine.warmup()
        self.engine = engine
        self.tokenizer = engine.tokenizer()
        self.profile = None
        if profile:
            from relayinfer.device.profiles import DeviceProfile, PacedEngine, load_profile

            self.profile = profile if isinstance(profile, DeviceProfile) else load_profile(profile)
            self.engine = PacedEngine(engine, self.profile)
        self.cloud = CloudEstimate()
        self._device_timing = None
        self.fingerprint = self.engine.fingerprint
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-model")

    def prompt_ids(self, prompt: str | Sequence[dict]) -> list[int]:
        """Chat-templated prompt ids for a user string or a list of {role, content} messages."""
        return self.tokenizer.encode_chat(prompt)

    def check_cloud(self) -> str | None:
        """Try the cloud once (connect + handshake, bounded by `connect_timeout_s`) without
        generating: None when it answers, else the reason in words (also logged once, as for a
        request). Without a cloud URL: None. Raises RuntimeError when called on a thread that
        runs an event loop (it blocks)."""
        if self.cloud_url is None:
            return None
        _refuse_in_running_loop("Client.check_cloud")
        from relayinfer.protocol.transport import ws as proto_ws

        async def probe():
            ch = await proto_ws.open_channel(self.cloud_url, self.fingerprint, self.token, client="relayinfer-device",
                                             open_timeout=self.options.connect_timeout_s,
                                             **({"ssl": self.ssl} if self.ssl is not None else {}))
            await asyncio.wait_for(ch.close(), 1.0)

        try:
            asyncio.run(asyncio.wait_for(probe(), 2 * self.options.connect_timeout_s + 1.0))
        except Exception as e:  # unreachable, refused, TLS, timeout: the device answers alone
            reason = cloud_problem(e)
            self._note_cloud(reason, "cloud-refused" if isinstance(e, RemoteError) else "cloud-unreachable")
            return reason
        self._note_cloud(None)
        return None

    def _note_cloud(self, problem: str | None, fault: str | None = "cloud-unreachable") -> None:
        """Log a cloud that did not take a request, once until it answers again: unreachable,
        refused (with a hint when it serves another model) or overloaded (`fault`)."""
        if problem is None:
            self._cloud_down = False
        elif not self._cloud_down:
            self._cloud_down = True
            what = {"cloud-refused": "refused the session", "cloud-overloaded": "is overloaded"}.get(fault, "unreachable")
            if "fingerprint" in problem:
                problem += "; the cloud serves another model: start it with the same --model as this device"
            log.warning("cloud %s at %s: falling back to the device (%s)", what, self.cloud_url, problem)

    def _runner(self, prompt, sampling: dict, link=None, past=None, keep=None):
        """The coroutine function of one generation; `link`/`past`/`keep` (a conversation's shared
        websocket, its device cache, and where to put the new one) come from `Conversation`."""
        check_prompt_text(prompt)  # one rule for empty input (CLI, Client, HTTP API): raises here, not in the stream
        ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else self.prompt_ids(prompt)
        opts = dict(vars(self.options))
        if "json_schema" in sampling:  # structured output's shorthand: the answer is JSON under this schema
            if sampling.get("grammar") is not None:
                raise FieldError("json_schema", "left out when grammar is given", sampling["json_schema"])
            sampling["grammar"] = json_schema_grammar(sampling.pop("json_schema"))
        for k in ("mode", "target_tpot_ms", "cloud_budget", "refine", "kv_handoff", "kv_wire"):
            if k in sampling:
                opts[k] = sampling.pop(k)
        unknown = sorted(set(sampling) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            raise FieldError(unknown[0], f"one of the sampling fields {', '.join(SamplingParams.__dataclass_fields__)} "
                             "or mode, target_tpot_ms, cloud_budget, refine, kv_handoff, kv_wire", sampling[unknown[0]])
        params = SamplingParams(**{**sampling, "stop_ids": tuple(sampling.get("stop_ids", ()))})
        if params.logprobs is not None:  # the device returns none, nor does the split protocol carry them
            raise FieldError("logprobs", "left out: the SDK returns no logprobs (the OpenAI HTTP API does)",
                             params.logprobs)
        vocab = self.tokenizer.vocab_size
        check_ids("prompt", ids, vocab - 1, min_len=1)  # the shared rules (`protocol.validate`), as the cloud's
        check_vocab(vocab, params.stop_ids, params.logit_bias)
        options = SplitOptions(**opts)
        auto = options.mode == "split" and (options.cloud_budget == "auto" or
                                            (options.kv_handoff == "auto" and options.link_bytes_per_s is not None))
        timing = self.device_timing() if auto else None
        session = SplitSession(self.engine, self.tokenizer, self.cloud_url, self.fingerprint, self.token,
                               options, self._executor, timing, self.cloud, ssl=self.ssl, link=link)

        async def run(on_token):
            try:
                res = await session.run(ids, params, on_token, past=past)
            finally:
                if keep is not None:
                    keep(session.cache)
            if self.cloud_url is not None and options.mode != "device-only":
                self._note_cloud(res.error if res.fault in CLOUD_FAULTS else None, res.fault)
            return res
        return run

    def device_timing(self) -> tuple[float, float, float]:
        """(prefill ms base, prefill ms per token, decode ms per token) of this device: the local
        calibration (cached per model, `device.calibrate`), never faster than the profile's pacing
        (`device.settings.device_fit`: the line through the envelope of the two)."""
        if self._device_timing is None:
            from relayinfer.device.calibrate import calibrated

            from relayinfer.device.settings import device_fit

            local = calibrated(self.engine.engine if self.profile else self.engine)
            fit = lambda x: (x.prefill_ms_base, x.prefill_ms_per_token, x.decode_ms_per_token)  # noqa: E731
            self._device_timing = device_fit(fit(local), fit(self.profile) if self.profile else None)
        return self._device_timing

    def measure_link(self, name: str = "tokenizer.json", timeout_s: float = 30.0) -> float:
        """Measure the link's bandwidth (bytes/s) by downloading one device-model file (default
        the tokenizer, ~3.5 MB) from `cloud_http_url` (or where the cloud's Welcome says); sets `link_bytes_per_s` for the KV hand-off
        choice and returns it. The time includes the HTTP round trip, so a small file reads low
        (the hand-off is then chosen less often, not wrongly more often).

        Raises:
            ValueError: no `cloud_http_url` and the cloud names no device-model URL.
            urllib.error.URLError / RemoteError: the file cannot be fetched.
        """
        import time
        import urllib.request

        from relayinfer.protocol.transport.security import context_for_url

        base = self.cloud_http_url or (device_model_url(self.cloud_url, self.token, self.ssl) if self.cloud_url else None)
        if base is None:
            raise ValueError("measure_link needs a cloud that serves the device model (cloud_http_url, or a "
                             "cloud_url whose Welcome names its device_model_url)")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        req = urllib.request.Request(f"{base}/v1/device-model/{name}", headers=headers)
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout_s,
                                    context=context_for_url(base, self._ca, self._verify)) as r:
            n = len(r.read())
        bw = n / max(time.perf_counter() - t0, 1e-6)
        self.options.link_bytes_per_s = bw
        return bw

    def _client_loop(self) -> "_LoopThread":
        """The event loop (a daemon thread) on which every request of this client runs, so that
        its websocket outlives each request; started on first use (thread-safe)."""
        return self._rt.loop_()

    _conversation_loop = _client_loop

    def _refuse_on_loop_thread(self, what: str) -> None:
        """Raise RuntimeError naming `what` when called on the client's own event-loop thread (a
        callback or coroutine running there): `what` waits for work of that loop, so it would wait
        for ever."""
        if self._rt.on_loop_thread():
            raise RuntimeError(f"{what} blocks on the client's own event loop and would deadlock when called on its "
                               "thread (a callback or coroutine running there): use Client.agenerate, or call it "
                               "from another thread")

    @property
    def link(self):
        """The client's `device.link.CloudLink` (one websocket for all its `generate` calls), None
        without a cloud URL. Its `connections` counts the websockets opened so far."""
        if self.cloud_url is None:
            return None
        with self._rt.lock:
            if self._rt.link is None:
                n, backoff = self._reconnect
                from relayinfer.device.link import CloudLink

                self._rt.link = CloudLink(self.cloud_url, self.fingerprint, self.token, self.ssl,
                                          self.options.connect_timeout_s, n, backoff)
            return self._rt.link

    def conversation(self, system: str | None = None, reuse: bool = True, **sampling) -> "Conversation":
        """A multi-turn chat (`Conversation`): one websocket for all its turns, and with `reuse`
        the device's KV cache of the previous turns (the cloud keeps its own per session). `system`:
        an optional system message; `sampling`: defaults for every turn (as for `generate`)."""
        return Conversation(self, system, reuse, sampling)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the client's websocket (and its open conversations' websockets) and stop its event
        loop; generations still running there are cancelled (their streams raise CancelledError).
        Bounded by `timeout_s` (s). Callable from any thread: on the client's own event-loop thread
        (from a callback or coroutine running there) it returns at once and the websockets close on
        that thread right after the current callback, when the loop stops. Idempotent; a later
        `generate` starts a new loop. Raises nothing (a close that fails is logged at debug level)."""
        self._rt.close(timeout_s)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | Sequence[dict] | list[int], **sampling) -> Stream:
        """Start generating; returns a `Stream` of `TokenEvent`s (its `.result` once exhausted).

        `prompt`: a user string, a list of chat messages, or prompt token ids. `sampling`:
        max_new_tokens, temperature, top_p, top_k, seed, stop_ids; structured output: `grammar`
        (a `protocol.messages.Grammar`: JSON schema, regex or Lark) or `json_schema` (a dict, the
        answer is JSON under it), kept by the cloud and the device alike across the hand-off;
        per-request mode, target_tpot_ms, cloud_budget, refine (keep ratio of prompt refinement,
        e.g. 0.5).

        Raises (here, before anything runs):
            ValueError: an empty prompt (an empty or blank string, no messages or none with text, no
                token ids: the rule of `protocol.validate.check_prompt_text`); `FieldError` (a
                ValueError whose `.field` names the field) for a sampling or split value outside the
                shared rules of `protocol.validate` (its message gives the allowed range), a prompt
                token id outside the vocabulary, or an unknown keyword.
            PromptTooLongError: the prompt and `max_new_tokens` do not fit the model's context.

        The request uses the client's websocket (see the class docstring: one per client, calls
        multiplexed over it).
        """
        return Stream(self._runner(prompt, dict(sampling), link=self.link), loop=self._client_loop(),
                      what="Client.generate")

    def agenerate(self, prompt: str | Sequence[dict] | list[int], **sampling) -> AsyncStream:
        """`generate` for asyncio code: an async iterator of `TokenEvent`s (call inside a running
        loop). The request runs on the client's loop, over its websocket. Raises as `generate`."""
        return AsyncStream(self._runner(prompt, dict(sampling), link=self.link), loop=self._client_loop(),
                           what="Client.agenerate")

    def complete(self, prompt, **sampling) -> GenerationResult:
        """Generate to the end and return the `GenerationResult`. Raises as `generate`, and
        RuntimeError (before anything runs) when called on the client's own event-loop thread
        (it would wait for itself)."""
        self._refuse_on_loop_thread("Client.complete")
        return self.generate(prompt, **sampling).collect()


class Conversation:
    """A multi-turn chat over one `Client` (from `Client.conversation`).

    `send(text)` appends the user turn, generates the answer to the whole conversation (chat
    template over `messages`) and appends it. With `reuse` the device keeps its KV cache from turn
    to turn: turn k+1 prefills only the tokens after the longest common prefix of the cached ids
    (turn k's prompt and answer) and the new prompt, and the settings algorithm plans with those
    uncached tokens only; the cloud reuses its own cache the same way (the session's last KV on the
    per-request path, the prefix cache of the batched engine). Greedy answers equal the answers
    without reuse (tested). All turns use one websocket (`link`, the conversation's own, not the
    client's); without `reuse` each turn opens its own websocket and prefills everything.

    Attributes: messages ({role, content} dicts), results (one `GenerationResult` per turn), link
    (the `device.link.CloudLink`, None without a cloud or without reuse).
    """

    def __init__(self, client: Client, system: str | None, reuse: bool, sampling: dict):
        from relayinfer.device.link import CloudLink

        self.client, self.reuse, self.sampling = client, reuse, dict(sampling)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.results: list[GenerationResult] = []
        self.cache = None  # the device's `DeviceCache` after the last turn
        self.link = (CloudLink(client.cloud_url, client.fingerprint, client.token, client.ssl,
                               client.options.connect_timeout_s) if client.cloud_url and reuse else None)
        if self.link is not None:  # closed with the client's loop if the conversation is not closed first
            client._rt.links.add(self.link)

    def _keep(self, cache) -> None:
        self.cache = cache if self.reuse else None

    def stream(self, text: str, **sampling) -> Stream:
        """Send the user turn `text`; a `Stream` of the answer's `TokenEvent`s. The answer joins
        `messages` once the stream is exhausted. Raises as `Client.generate` (empty text, ...)."""
        check_prompt_text(text)
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = self.client.prompt_ids(msgs)
        run = self.client._runner(ids, {**self.sampling, **sampling}, link=self.link,
                                  past=self.cache if self.reuse else None, keep=self._keep)

        async def turn(on_token):
            res = await run(on_token)
            self.messages[:] = msgs + [{"role": "assistant", "content": res.text}]
            self.results.append(res)
            return res
        return Stream(turn, loop=self.client._conversation_loop(), what="Conversation.stream")

    def send(self, text: str, **sampling) -> GenerationResult:
        """`stream(text)` to the end: the turn's `GenerationResult`. Raises as `stream`, and
        RuntimeError (before anything runs) when called on the client's own event-loop thread
        (it would wait for itself)."""
        self.client._refuse_on_loop_thread("Conversation.send")
        return self.stream(text, **sampling).collect()

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the conversation's websocket (bounded by `timeout_s`, s) and drop its device
        cache. Callable from any thread: on the client's own event-loop thread the close is
        scheduled there (it runs after the current callback) and this returns at once; when the
        client's loop is not running the websocket was closed when it stopped. Idempotent.
        Raises what closing the websocket raises (`CloudLink.aclose`: nothing in practice)."""
        self.cache = None
        link = self.link
        if link is None:
            return
        rt = self.client._rt
        lt = rt.current
        fut = lt.submit(lambda: asyncio.wait_for(link.aclose(), timeout_s), "Conversation.close",
                        refuse=False) if lt is not None else None
        if fut is None:  # no loop: nothing open (a loop's end closes the links it served)
            rt.links.discard(link)
            return
        if lt.on_thread():  # scheduled; the link stays registered, so a stop that comes first closes it too
            fut.add_done_callback(lambda f: rt.links.discard(link))
            return
        try:
            fut.result(timeout_s + 1.0)
        except concurrent.futures.CancelledError:  # the loop stopped meanwhile: its end closed the link
            pass
        finally:
            rt.links.discard(link)

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LoopThread:
    """One event loop of a client on its daemon thread ('relayinfer-client'). `submit` hands it a
    coroutine from any thread; when the loop stops (`_Runtime.close`, or anyone's `loop.stop()`)
    its thread closes the links handed to it (`closing`, bounded), cancels the tasks left, and
    closes the loop, so no coroutine is left never awaited and no websocket open."""

    def __init__(self, rt: "_Runtime"):
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()
        self.accepting = True  # False once the loop's end began: `submit` refuses
        self.closing: list = []  # links to close when the loop stops
        self.close_timeout_s = 5.0
        self.thread = threading.Thread(target=rt._serve, args=(self,), name="relayinfer-client", daemon=True)

    def on_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, make, what: str, refuse: bool = True):
        """Run the coroutine `make()` on the loop (from any thread): its `concurrent.futures.Future`.
        `make` is called only when the loop takes it, so a refused coroutine is never made (none
        is left never awaited). Once the loop is ending: RuntimeError naming `what`, or None when
        not `refuse`."""
        with self.lock:
            if self.accepting:
                return asyncio.run_coroutine_threadsafe(make(), self.loop)
        if not refuse:
            return None
        raise RuntimeError(f"{what}: the client was closed (its event loop stopped); nothing was started")

    def stop(self, links: list, timeout_s: float) -> None:
        """Have the loop stop; `links` are closed on its thread, bounded by `timeout_s` (s)."""
        with self.lock:
            self.closing.extend(links)
            self.close_timeout_s = timeout_s
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed already: its end ran (and took what it had to close)
            pass


class _Runtime:
    """A client's event loop thread and its websocket (`CloudLink`), apart from the `Client` so
    that a finalizer can close them without keeping the client alive. `links`: the open
    conversations' websockets (closed with the loop)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.current: _LoopThread | None = None
        self.link = None
        self.links: weakref.WeakSet = weakref.WeakSet()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        lt = self.current
        return None if lt is None else lt.loop

    def loop_(self) -> _LoopThread:
        with self.lock:
            if self.current is None:
                self.current = _LoopThread(self)
                self.current.thread.start()
            return self.current

    def on_loop_thread(self) -> bool:
        lt = self.current
        return lt is not None and lt.on_thread()

    def _take(self) -> list:
        """The links to close with the current loop (under `lock`): the client's and the open
        conversations'; the client's is forgotten (the next request opens a new one)."""
        link, self.link = self.link, None
        return ([link] if link is not None else []) + list(self.links)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop; its thread closes the websockets (each bounded by `timeout_s`, s) and
        then the loop. From another thread, waits for that (bounded); from the loop's own thread,
        returns at once (the close runs when the current callback returns). Idempotent; raises
        nothing."""
        with self.lock:
            lt, self.current = self.current, None
            if lt is None:
                return
            lt.stop(self._take(), timeout_s)  # under `lock`: the loop's end sees these links
        if not lt.on_thread():
            lt.thread.join(timeout_s + 2.0)
            if lt.thread.is_alive():
                log.debug("the client's event loop did not end within %.1f s", timeout_s + 2.0)

    def _serve(self, lt: _LoopThread) -> None:
        loop = lt.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            with self.lock:
                if self.current is lt:  # stopped by someone else than `close`: this runtime forgets it
                    self.current = None
                    lt.closing.extend(self._take())
                with lt.lock:
                    lt.accepting = False
                    links, lt.closing = lt.closing, []
            try:
                loop.run_until_complete(self._wind_down(links, lt.close_timeout_s))
            except BaseException as e:  # the loop closes anyway
                log.debug("ending the client's event loop: %s: %s", type(e).__name__, e)
            finally:
                loop.close()

    @staticmethod
    async def _wind_down(links: list, timeout_s: float) -> None:
        """On the stopped loop: the coroutines submitted before the stop start, the links close
        (bounded by `timeout_s`, s), then every task left is cancelled (bounded) and the async
        generators are finalised."""
        await asyncio.sleep(0)
        if links:
            try:
                await asyncio.wait_for(asyncio.gather(*(link.aclose() for link in links), return_exceptions=True),
                                       timeout_s)
            except Exception as e:  # a close that hangs: the loop ends anyway
                log.debug("closing the client's websocket: %s: %s", type(e).__name__, e)
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me]
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=1.0)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().shutdown_asyncgens(), 1.0)
        except Exception as e:
            log.debug("finalising the client's async generators: %s: %s", type(e).__name__, e)


def cloud_problem(e: BaseException) -> str:
    """A connection failure in words, with a hint when the URL points at the HTTP port."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if type(e).__name__ in ("InvalidStatus", "InvalidMessage", "InvalidHandshake", "InvalidUpgrade"):
        text += " (is this the HTTP port? devices connect to the websocket port, `cloud serve --port`, default 8765)"
    return text
