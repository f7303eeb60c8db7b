"""The cloud prefill service of P/D-Device: a websockets stream endpoint plus an aiohttp HTTP side.

Per `Generate` the cloud prefills the prompt, sends the first `Token` at once, keeps decoding and
streaming tokens until the device sends `Stop` (it has taken over), the cloud token budget is spent,
or the answer ends; then it sends `Done` and frees the request's KV cache.

Model steps of all sessions run on one worker thread (a FIFO executor), so concurrent requests
interleave step by step and the event loop stays free for I/O. (Continuous batching replaces this
in the serving engine.) HTTP side: `/healthz`, `/metrics` (Prometheus text), `/v1/device-model`
(the exported ONNX file, `X-Content-SHA256` header) and `/v1/device-model/{name}` for the other
device files listed in `/v1/device-model/manifest`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl as _ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams, finish_reason, sample
from relayinfer.protocol.errors import ChannelClosed, ErrorCode, RelayInferError
from relayinfer.protocol.model.model_file import file_sha256
from relayinfer.protocol.kvhandoff import common_prefix, kv_messages
from relayinfer.protocol.transport.limits import (Charge, ConnectionGate, ConnectionLimits, GatedSite, MemoryBudget,
    quiet_accept_errors, runner_kwargs)
from relayinfer.protocol.messages import (MAX_FRAME_BYTES, Cancel, Done, Error, ExtendBudget, Generate, KVTransfer,
                                          Pong, RefinedPrompt, Stop, Token, encode)
from relayinfer.cloud.refine import WINDOW, select
from relayinfer.protocol.model.refine import TemplateMarkers
from relayinfer.protocol.transport.security import bearer_token, server_context, token_matches
from relayinfer.protocol.validate import MAX_STOP_IDS, FieldError, check, check_ids, check_vocab

log = logging.getLogger("relayinfer.cloud")

MAX_REQUEST_ID = 64  # characters
REUSE_WAIT_S = 1.0  # longest wait of a new turn for the previous, stopping turn's KV (per-request path)
KEEPALIVE_S = 10.0  # websocket ping interval and timeout: a black-holed device is dropped within ~20 s
REQUEST_MEMORY_MB = 512  # default share of the memory budget beyond the batching engine's KV pool (MiB)


def per_request_bytes(cfg, n_prompt: int, max_new_tokens: int, refine: bool = False,
                      kv_from: int | None = None) -> int:
    """Peak bytes a request on the per-request path (`TorchEngine`) holds, an upper estimate used
    to charge the memory budget:

    - KV cache: a float32 `StaticKV` of capacity max(256, n + 64) tokens that doubles when full,
      up to n + max_new_tokens; while it grows the old and new caches exist together;
    - prefill scratch: per prompt token, float32 hidden states (4 x dim), q/o (2 x heads x head_dim),
      k/v (2 x kv_heads x head_dim) and the SwiGLU gate/up/product (3 x ffn_dim), plus the logits;
    - refinement: the causal bool mask [n, n] and the observation logits (heads x 16 x n float32, x2);
    - KV hand-off (`kv_from`): the float32 slice, its float16 copy and the encoded frames of the
      n - 1 - kv_from handed-off tokens (2.5 x their float32 KV).
    """
    n, per_tok = n_prompt, cfg.kv_bytes_per_token
    cap = peak = max(256, n + 64)
    need = n + max_new_tokens
    while cap < need:
        new = max(need, 2 * cap)
        peak, cap = max(peak, cap + new), new
    hd = cfg.dim // cfg.n_heads
    total = per_tok * peak
    total += n * 4 * (4 * cfg.dim + 2 * cfg.n_heads * hd + 2 * cfg.n_kv_heads * hd + 3 * cfg.ffn_dim)
    total += 2 * cfg.vocab_size * 4
    if refine:
        total += n * n + 2 * cfg.n_heads * 16 * n * 4
    if kv_from is not None:
        total += int(2.5 * per_tok * max(n - 1 - kv_from, 0))
    return total


def split_frame_limit(context_length: int, vocab_size: int) -> int:
    """The largest frame a device sends to the split service (bytes), rounded up to KiB: a Generate
    with a whole context of the largest token ids, the longest request_id and all stop_ids."""
    big = vocab_size - 1
    g = Generate("r" * MAX_REQUEST_ID, [big] * context_length, context_length, 1.5, 0.5, big, 2**63 - 1,
                 context_length, 0.5, [big] * MAX_STOP_IDS)
    return -(-len(encode(g)) // 1024) * 1024


class Metrics:
    """Prometheus metrics of one service (own registry, so several services can share a process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("relayinfer_requests", "Generate requests by outcome", ["outcome"], registry=r)
        self.cloud_tokens = Counter("relayinfer_cloud_tokens", "Tokens streamed by the cloud", registry=r)
        from relayinfer.cloud.engine.metrics import LATENCY_BUCKETS

        self.prefill = Histogram("relayinfer_prefill_seconds", "Cloud prefill time, Generate to the first "
                                 "token (s)", registry=r, buckets=LATENCY_BUCKETS)
        self.active_sessions = Gauge("relayinfer_active_sessions", "Open device sessions", registry=r)
        self.active_requests = Gauge("relayinfer_active_requests", "Requests holding a KV cache", registry=r)
        self.errors = Counter("relayinfer_protocol_errors", "Errors sent to clients by code", ["code"], registry=r)
        self.memory_limit = Gauge("relayinfer_memory_budget_bytes", "Memory budget of all request paths (bytes)",
                                  registry=r)
        self.memory_used = Gauge("relayinfer_memory_used_bytes", "Bytes charged to the memory budget now "
                                 "(the batching engine's KV pool included)", registry=r)
        self.memory_refused = Counter("relayinfer_memory_refusals", "Requests refused for the memory budget",
                                      ["path"], registry=r)


@dataclass
class _Request:
    msg: Generate
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    budget: int | None = None
    stop_reason: str = "stop"
    batched: bool = False
    pending: int = 0  # prompt tokens counted in CloudService.pending_tokens until the first token
    cached: int = 0  # prompt tokens whose KV came from the session's previous turn
    session_kv: list | None = None  # the session's slot for its last KV (per-request path), see `_run`
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when its task is over
    charge: Charge | None = None  # its bytes in the memory budget (per-request path)


@dataclass
class _SessionKV:
    """The KV cache of a session's last finished request on the per-request path (multi-turn
    reuse): `ids` are the tokens whose K/V `kv` holds (prompt + the answer tokens the cloud decoded)."""

    ids: list[int]
    kv: object
    charge: Charge | None = None  # the kept cache's bytes in the memory budget


class CloudService:
    """Serves device sessions over websockets with a `TorchEngine` (or anything with the
    `prefill`/`decode` engine interface, `eos_id`, `context_length`, `cfg.vocab_size`).

    Args:
        engine: the cloud runtime.
        fingerprint: sha256 of the model file; a device with another fingerprint is refused
            (FINGERPRINT_MISMATCH).
        auth_token: bearer token devices must present, or None for none.
        device_model_dir: directory of exported device files served on `/v1/device-model`.
        step_delay_ms: extra wait before each decode step (simulates a slower or loaded cloud in
            tests and benchmarks; 0 in production).
        max_frame_bytes: largest frame accepted from a device after the handshake (bytes); larger
            ones get FRAME_TOO_LARGE. Default: the largest real message, a Generate of a whole
            context (`split_frame_limit`, 25 KiB for an 8k context); before the handshake the
            limit is `HANDSHAKE_MAX_BYTES` (4 KiB).
        max_sessions: open device sessions at most, counted from the websocket upgrade (before the
            Hello: an open websocket that has not said Hello holds a slot); a device beyond it is
            refused with OVERLOADED and `retry_after_ms` (it runs device-only meanwhile).
        memory_bytes: the memory budget of every request path (bytes; `protocol.transport.limits.MemoryBudget`).
            The batching engine's KV pool is charged from the start (its size, for good); each
            request on the per-request path (refinement, KV hand-off `kv_from`, every request
            without `llm`) is charged `per_request_bytes` while it runs, a kept multi-turn KV cache
            its size while kept, and OpenAI `echo` prompt logprobs their logits while computed.
            A request that does not fit gets OVERLOADED with `retry_after_ms` (websocket) or 503
            with `Retry-After` (HTTP). Default: the KV pool + `REQUEST_MEMORY_MB` (512 MiB). Its
            use is on /metrics (`relayinfer_memory_*`).
        limits: connection limits of both ports together (`protocol.transport.limits.ConnectionLimits`:
            open connections in all and per client address, request-head / handshake / Hello
            timeouts, keep-alive idle timeout); default `ConnectionLimits()`.
        max_requests_per_session: concurrent Generates per session at most (OVERLOADED beyond).
        max_queued_tokens: prompt tokens of admitted requests still waiting for their first token, at
            most (a request arriving when the queue is not empty and would pass this gets
            OVERLOADED: a device then runs on its own instead of waiting behind the queue; the
            queue's wait grows with these tokens at the engine's prefill rate).
        max_queue_wait_ms: the expected wait before a new request's first token, at most (ms): the
            waiting prompt tokens plus its own, over the batching engine's measured prefill rate
            (`LLMEngine.prefill_tok_s`, an EWMA of prefill tokens per second of step time). Beyond
            it the request gets OVERLOADED at once (the on-demand admission of P/D-Serve, arXiv
            2408.08147, applied to one instance): a device answers sooner on its own than behind
            the queue. Not applied before the rate is known, nor on the per-request path.
        retry_after_ms: the back-off hint sent with OVERLOADED (ms).
        history: Done messages kept in `completed` (the most recent ones; for tests and benches).
        max_kept_tokens: multi-turn reuse on the per-request path keeps each session's last KV
            cache for its next turn; at most this many tokens of such caches are kept over all
            sessions (beyond it a turn's cache is freed and the next turn prefills in full).
        special_ids: chat-template token ids that prompt refinement always keeps (default: the
            CONTROL tokens of the engine's model file).
        llm: an `AsyncLLMEngine` (continuous batching over a paged KV cache). When given, requests
            without refinement join its batch and the HTTP side also serves the OpenAI-compatible
            API; requests with refinement take the per-request path (the batched runner does not
            compute attention scores).
        model_name: the model id of the OpenAI-compatible API.
        metrics_public: serve `/metrics` without the token (for a scraper on a private network).

    Auth (when `auth_token` is set): devices present the token in their Hello (websocket port);
    HTTP clients send `Authorization: Bearer <token>` on every route but `/healthz` (and
    `/metrics` with `metrics_public`); both compare in constant time. A missing or wrong token
    gets 401 in OpenAI's error shape with `WWW-Authenticate: Bearer`. `/healthz` answers
    `{"status": "ok"}` to anyone and adds the model fingerprint, model id and engine state only
    for an authorized caller. TLS: `start(..., ssl=...)` or `certfile`/`keyfile` serve both ports
    over TLS (`wss://`, `https://`).
    """

    drain_s = 5.0  # on stop(): seconds open HTTP requests get before they are cancelled

    def __init__(self, engine, fingerprint: str, auth_token: str | None = None,
                 device_model_dir: str | Path | None = None, step_delay_ms: float = 0.0,
                 max_frame_bytes: int | None = None, special_ids: frozenset[int] | None = None,
                 llm=None, model_name: str = "smollm2-135m-instruct", metrics_public: bool = False,
                 max_sessions: int = 256, max_requests_per_session: int = 4, retry_after_ms: float = 5000.0,
                 max_queued_tokens: int = 4096, max_queue_wait_ms: float = 2000.0,
                 history: int = 1000, max_kept_tokens: int = 8192, limits: ConnectionLimits | None = None,
                 memory_bytes: int | None = None):
        self.engine, self.fingerprint, self.auth_token = engine, fingerprint, auth_token
        self.metrics_public = metrics_public
        self._ssl, self._host = None, "127.0.0.1"
        self.device_model_dir = Path(device_model_dir) if device_model_dir else None
        self._manifest: dict | None = None
        self.step_delay_ms = step_delay_ms
        self.max_frame_bytes = max_frame_bytes or split_frame_limit(engine.context_length, engine.cfg.vocab_size)
        self.max_sessions, self.max_requests_per_session = max_sessions, max_requests_per_session
        self.retry_after_ms = retry_after_ms
        self.max_queued_tokens, self.max_queue_wait_ms = max_queued_tokens, max_queue_wait_ms
        self.pending_tokens = 0  # prompt tokens of requests waiting for their first token
        self.num_sessions = 0  # open device sessions (from the websocket upgrade on, see `_admit`)
        self.gate = ConnectionGate(limits)  # open connections of both ports
        self._special_ids = special_ids
        self.llm, self.model_name = llm, model_name
        self.metrics = Metrics()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloud-model")
        self.ws_port = self.http_port = None
        self._ws_server = self._http_runner = None
        self.completed: deque[Done] = deque(maxlen=history)  # the last Done of recent requests
        self.max_kept_tokens = max_kept_tokens  # multi-turn reuse: session KV kept at most (tokens, all sessions)
        self.kept_tokens = 0
        pool = self._kv_pool_bytes()
        self.budget = MemoryBudget(memory_bytes if memory_bytes is not None else pool + (REQUEST_MEMORY_MB << 20))
        if pool:
            self.budget.reserve("kv_pool", pool)  # ValueError naming both sizes when the pool alone passes it
        self.metrics.memory_limit.set(self.budget.limit_bytes)
        self.metrics.memory_used.set_function(lambda: self.budget.used)

    def _kv_pool_bytes(self) -> int:
        """Bytes of the batching engine's preallocated paged KV cache in this process (0 without one,
        or when the blocks live elsewhere, as the P/D instances' do)."""
        e = getattr(self.llm, "engine", None)
        if e is None or not hasattr(e, "block_manager"):
            return 0
        return e.num_blocks * e.block_size * self.engine.cfg.kv_bytes_per_token

    def _charge(self, msg: Generate) -> Charge | Error:
        """Charge a per-request-path Generate to the memory budget, or the OVERLOADED Error."""
        path = "refine" if msg.refine is not None else "kv_handoff" if msg.kv_from is not None else "per_request"
        need = per_request_bytes(self.engine.cfg, len(msg.prompt_ids), msg.max_new_tokens, msg.refine is not None,
                                 msg.kv_from)
        charge = self.budget.try_charge(path, need)
        if charge is not None:
            return charge
        self.metrics.memory_refused.labels(path).inc()
        self.metrics.errors.labels(ErrorCode.OVERLOADED.value).inc()
        what = f"a {len(msg.prompt_ids)}-token prompt" + {"refine": " with refinement",
                                                          "kv_handoff": " with a KV hand-off"}.get(path, "")
        return Error(ErrorCode.OVERLOADED.value, f"{self.budget.refusal(what, need)}; retry after "
                     f"{self.retry_after_ms:.0f} ms", msg.request_id, self.retry_after_ms)

    # --- websockets side ------------------------------------------------------------------------

    async def _session(self, channel: proto_ws.ServerChannel) -> None:
        """One device connection: dispatch messages, run each Generate as its own task."""
        if not channel.hello.model_fingerprint:  # a device without the model asked where it is (Welcome): done
            return
        requests: dict[str, _Request] = {}
        tasks: set[asyncio.Task] = set()
        kept: list[_SessionKV] = []  # at most one: the last turn's KV (per-request path), taken by the next
        try:
            async for msg in channel:
                if isinstance(msg, Generate):
                    err = self._validate(msg, requests)
                    if err:
                        self.metrics.errors.labels(err.code).inc()
                        await channel.send(err)
                        continue
                    charge = None if self._batched(msg) else self._charge(msg)
                    if isinstance(charge, Error):
                        await channel.send(charge)
                        continue
                    req = requests[msg.request_id] = _Request(msg, budget=msg.cloud_budget, charge=charge)
                    req.batched = self._batched(msg)
                    req.pending = len(msg.prompt_ids)
                    self.pending_tokens += req.pending
                    req.session_kv = kept
                    run = self._run_batched if req.batched else self._run
                    task = asyncio.create_task(run(channel, req, requests))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif isinstance(msg, Pong):
                    continue  # a liveness answer: nothing to do
                elif isinstance(msg, (Stop, Cancel)):
                    req = requests.get(msg.request_id)
                    if req is None:
                        continue  # finished already: the Done crossed the Stop on the wire
                    self._stop(req, "stop" if isinstance(msg, Stop) else "cancel")
                elif isinstance(msg, ExtendBudget):
                    req = requests.get(msg.request_id)
                    try:
                        check("cloud_budget", msg.cloud_budget)
                    except FieldError as e:
                        await channel.send(Error(ErrorCode.BAD_REQUEST.value, str(e), msg.request_id))
                        continue
                    if req is not None:  # capped at max_new_tokens, which admission checked
                        req.budget = min(msg.cloud_budget, req.msg.max_new_tokens)
                        if req.batched:
                            self.llm.set_budget(msg.request_id, req.budget)
                else:  # a request-level error when the message names a request, else the connection ends
                    rid = getattr(msg, "request_id", None)
                    err = Error(ErrorCode.BAD_REQUEST.value, f"unexpected {type(msg).__name__} from a device", rid)
                    await channel.send(err)
                    if rid is None:  # a connection-level Error: the protocol says the sender closes
                        break
        except RelayInferError as e:  # protocol violation already answered, or peer gone
            if not isinstance(e, ChannelClosed):
                self.metrics.errors.labels(e.code.value).inc()
            log.info("session %s ended: %s", channel.session_id, e)
        finally:
            for req in list(requests.values()):  # peer gone: free every request's KV cache
                self._stop(req, "cancel")
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self.kept_tokens -= sum(len(s.ids) for s in kept)
            for s in kept:
                s.kv = None
                if s.charge is not None:
                    s.charge.release()
            kept.clear()  # the session's kept KV cache is freed with it

    def _admit(self) -> Error | None:
        """Right after the websocket upgrade, before the Hello: OVERLOADED (with the back-off hint)
        when `max_sessions` are open, else the connection is counted as a session (until `_release`)."""
        if self.num_sessions >= self.max_sessions:
            self.metrics.errors.labels(ErrorCode.OVERLOADED.value).inc()
            return Error(ErrorCode.OVERLOADED.value, f"the server holds its limit of {self.max_sessions} device "
                         f"sessions; retry after {self.retry_after_ms:.0f} ms", None, self.retry_after_ms)
        self.num_sessions += 1
        self.metrics.active_sessions.inc()
        return None

    def _release(self) -> None:
        """An admitted connection ended (after its Hello or without one)."""
        self.num_sessions -= 1
        self.metrics.active_sessions.dec()

    def max_request_tokens(self, batched: bool) -> int:
        """Prompt + answer tokens one request may hold: min(context length, KV cache capacity)."""
        return self.llm.engine.max_model_len if batched else self.engine.context_length

    def _validate(self, msg: Generate, requests: dict) -> Error | None:
        """A request-level Error for a Generate we will not run, else None."""
        rid = msg.request_id
        n, vocab = len(msg.prompt_ids), self.engine.cfg.vocab_size
        if len(rid) > MAX_REQUEST_ID:
            return Error(ErrorCode.BAD_REQUEST.value, f"request_id longer than {MAX_REQUEST_ID} characters", rid[:MAX_REQUEST_ID])
        if rid in requests:
            return Error(ErrorCode.BAD_REQUEST.value, f"request_id {rid!r} is already running", rid)
        if len(requests) >= self.max_requests_per_session:
            return Error(ErrorCode.OVERLOADED.value, f"this session already runs {len(requests)} requests, the "
                         f"limit per session; retry after {self.retry_after_ms:.0f} ms", rid, self.retry_after_ms)
        dead = self.health()
        if dead is not None:
            return Error(ErrorCode.INTERNAL.value, dead, rid)
        batched = self._batched(msg)
        limit = self.max_request_tokens(batched)
        try:  # every field by the shared rules (`protocol.validate`), token ids by this model's vocabulary
            check_ids("prompt_ids", msg.prompt_ids, vocab - 1, min_len=1)
            check("cloud_budget", msg.cloud_budget, optional=True)
            check("refine", msg.refine, optional=True)
            if msg.kv_from is not None and n < 2:
                raise FieldError("kv_from", "left out for a one-token prompt (no prompt KV to hand off)", msg.kv_from)
            # the hand-off carries tokens [kv_from, n - 1): at least one
            check("kv_from", msg.kv_from, hi=n - 2, optional=True)
            if msg.kv_from is not None and msg.refine is not None:
                raise FieldError("kv_from", "left out when refine is given (they cannot be combined)", msg.kv_from)
            check_vocab(vocab, self._params(msg).stop_ids)
        except FieldError as e:
            return Error(ErrorCode.BAD_REQUEST.value, str(e), rid)
        if n + msg.max_new_tokens > limit:
            what = (f"the limit of {limit} tokens per request (min of the context length, {self.engine.context_length}, "
                    f"and the KV cache capacity, {self.llm.engine.num_blocks * self.llm.engine.block_size})"
                    if batched else f"the context length of {limit} tokens")
            return Error(ErrorCode.PROMPT_TOO_LONG.value,
                         f"prompt too long: {n} prompt tokens + {msg.max_new_tokens} new tokens exceed {what}", rid)
        if self.pending_tokens:  # last: a request that is wrong gets its own error first
            rate = getattr(self.llm.engine, "prefill_tok_s", None) if batched else None
            wait_ms = (self.pending_tokens + n) / rate * 1e3 if rate else 0.0
            why = (f"{self.pending_tokens} prompt tokens are waiting for prefill (limit {self.max_queued_tokens})"
                   if self.pending_tokens + n > self.max_queued_tokens else
                   f"the expected wait for a first token is {wait_ms:.0f} ms ({self.pending_tokens} prompt tokens "
                   f"waiting at {rate:.0f} tokens/s; limit {self.max_queue_wait_ms:.0f} ms)"
                   if wait_ms > self.max_queue_wait_ms else None)
            if why:
                self.metrics.errors.labels(ErrorCode.OVERLOADED.value).inc()
                return Error(ErrorCode.OVERLOADED.value, f"{why}; retry after {self.retry_after_ms:.0f} ms", rid,
                             self.retry_after_ms)
        return None

    def _batched(self, msg: Generate) -> bool:
        """Whether a request joins the continuous batch: not with refinement (the batched runner
        computes no attention scores) nor with a KV hand-off (its KV lives in paged blocks)."""
        return self.llm is not None and msg.refine is None and msg.kv_from is None

    def _dequeue(self, req: _Request) -> None:
        """The request got its first token (or ended): its prompt no longer waits for prefill."""
        self.pending_tokens -= req.pending
        req.pending = 0

    def _stop(self, req: _Request, reason: str) -> None:
        """Stop/Cancel: the request ends at its next step and its KV cache is freed."""
        if req.stop.is_set():
            return
        req.stop_reason = reason
        req.stop.set()
        if req.batched:
            self.llm.abort(req.msg.request_id)

    async def _run_batched(self, channel, req: _Request, requests: dict) -> None:
        """One request inside the continuous batch: stream its tokens as the engine emits them."""
        msg, t0 = req.msg, time.perf_counter()
        self.metrics.active_requests.inc()
        sent, reason, prefill_ms, outcome = 0, "length", 0.0, "error"
        try:
            # a zero budget streams nothing (as on the per-request path), nor does a request whose
            # Stop/Cancel came before its task started (no await between this check and the add)
            gen = _nothing() if req.budget == 0 or req.stop.is_set() else \
                self.llm.generate(msg.request_id, msg.prompt_ids, self._params(msg), req.budget)
            if req.budget == 0:
                reason = "budget"
            async for out in gen:
                self._dequeue(req)
                if sent == 0:
                    prefill_ms = (time.perf_counter() - t0) * 1e3
                    self.metrics.prefill.observe(prefill_ms / 1e3)
                    stats_of = getattr(self.llm.engine, "request_stats", None)  # the P/D view has none
                    stats = stats_of(msg.request_id) if stats_of is not None else None
                    req.cached = stats.prefix_hit_tokens if stats is not None else 0
                end = out.finish_reason if out.finish_reason != "budget" else None  # a budget cut is no end
                await channel.send(Token(msg.request_id, out.token_id, out.index, (time.perf_counter() - t0) * 1e3,
                                         req.cached if sent == 0 else 0, end))
                sent += 1
                self.metrics.cloud_tokens.inc()
                if out.finish_reason:
                    reason = out.finish_reason
            if req.stop.is_set():
                reason = req.stop_reason
            done = Done(msg.request_id, reason, sent, prefill_ms, req.cached)
            self.completed.append(done)
            outcome = reason
            await channel.send(done)
        except RelayInferError:
            outcome = "disconnected"
        except Exception as e:  # this request alone ends: the error names what failed
            log.exception("request %s failed", msg.request_id)
            try:
                await channel.send(Error(ErrorCode.INTERNAL.value, _internal(e), msg.request_id))
            except RelayInferError:
                pass
        finally:
            self._dequeue(req)
            self.llm.abort(msg.request_id)  # no-op when finished; frees the KV blocks otherwise
            requests.pop(msg.request_id, None)
            self.metrics.requests.labels(outcome).inc()
            self.metrics.active_requests.dec()

    @property
    def special_ids(self) -> frozenset[int]:
        if self._special_ids is None:
            from relayinfer.protocol.model.tokenizer import Tokenizer

            self._special_ids = Tokenizer.from_gguf(self.engine.model_path).special_ids
        return self._special_ids

    @property
    def markers(self) -> TemplateMarkers:
        """The chat template's scaffold that refinement keeps whole (read from the model's tokenizer;
        `special_ids`, when given to the constructor, replaces its control ids)."""
        if getattr(self, "_markers", None) is None:
            from dataclasses import replace

            from relayinfer.protocol.model.tokenizer import Tokenizer

            m = TemplateMarkers.from_tokenizer(Tokenizer.from_gguf(self.engine.model_path))
            self._markers = m if self._special_ids is None else replace(m, special_ids=frozenset(self._special_ids))
        return self._markers

    def _prefill(self, msg: Generate, past: _SessionKV | None = None):
        """Prefill; with refinement also the kept prompt indices (SnapKV-style scores). Returns
        (logits, kv, kept indices or None, reused tokens). Without refinement the KV of the session's
        previous turn (`past`) is reused for the longest common prefix of its ids and the prompt
        (at most all prompt tokens but the last, whose logits are needed); only the rest is prefilled."""
        if msg.refine is None:
            ids = msg.prompt_ids
            k = min(common_prefix(past.ids, ids), len(ids) - 1) if past is not None else 0
            if k > 0 and hasattr(past.kv, "length"):
                kv = past.kv
                kv.length = k  # keep the first k cached tokens (StaticKV is overwritten from `length` on)
                logits, kv = self.engine.prefill(ids[k:], kv)
            else:
                k = 0
                logits, kv = self.engine.prefill(ids)
            return logits, kv, None, k
        logits, kv, scores = self.engine.prefill_scored(msg.prompt_ids, WINDOW)
        return logits, kv, select(scores, msg.prompt_ids, msg.refine, self.markers), 0  # SELECTION

    def _kv_transfer(self, msg: Generate, kv) -> list[KVTransfer]:
        """The KV hand-off to the device: prompt tokens [kv_from, n - 1) as float16 [layers, 2,
        kv_heads, tokens, head_dim] (the ONNX past-KV layout per layer, keys after RoPE) in
        `KVTransfer` messages of at most MAX_FRAME_BYTES each, the limit every device accepts."""
        import torch

        start, end = msg.kv_from, len(msg.prompt_ids) - 1
        with torch.inference_mode():
            t = torch.stack([kv.k[:, 0, :, start:end], kv.v[:, 0, :, start:end]], dim=1)
            arr = t.to(torch.float16).cpu().numpy()
        return kv_messages(msg.request_id, arr, start, MAX_FRAME_BYTES)

    @staticmethod
    def _params(msg: Generate) -> SamplingParams:
        return SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, seed=msg.seed,
                              max_new_tokens=msg.max_new_tokens, stop_ids=tuple(msg.stop_ids),
                              presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                              repetition_penalty=msg.repetition_penalty, min_tokens=msg.min_tokens)

    async def _run(self, channel, req: _Request, requests: dict) -> None:
        """Prefill, stream tokens until Stop/Cancel/budget/EOS/length, send Done; keep the KV cache
        for the session's next turn (`req.session_kv`, one slot) when the request ended normally,
        else free it."""
        msg, loop, session_kv = req.msg, asyncio.get_running_loop(), req.session_kv
        params, t0 = self._params(msg), time.perf_counter()
        ms = lambda: (time.perf_counter() - t0) * 1e3  # noqa: E731
        self.metrics.active_requests.inc()
        kv, sent, reason, prefill_ms, outcome = None, 0, "length", 0.0, "error"
        out_ids: list[int] = []
        try:
            ending = [r.ended for r in requests.values() if r is not req and not r.batched and r.stop.is_set()]
            if session_kv is not None and not session_kv and ending:  # the previous turn is stopping: its KV comes
                waits = [asyncio.create_task(e.wait()) for e in ending]
                try:
                    await asyncio.wait(waits, timeout=REUSE_WAIT_S)
                finally:
                    for w in waits:
                        w.cancel()
            past = session_kv.pop() if session_kv else None  # taken: no two requests share a cache
            if past is not None:
                self.kept_tokens -= len(past.ids)
                if past.charge is not None:  # this request's own charge covers the cache from now on
                    past.charge.release()
            logits, kv, kept, req.cached = await loop.run_in_executor(self.worker, self._prefill, msg, past)
            del past
            self._dequeue(req)
            prefill_ms = ms()
            self.metrics.prefill.observe(prefill_ms / 1e3)
            for i in range(params.max_new_tokens):
                if req.stop.is_set():
                    reason = req.stop_reason
                    break
                if req.budget is not None and sent >= req.budget:
                    reason = "budget"
                    break
                tok = sample(logits, params, i, msg.prompt_ids + out_ids if params.adjusts_logits else (),
                             len(msg.prompt_ids), self.engine.eos_id)
                out_ids.append(tok)
                end = finish_reason(tok, i + 1, params, self.engine.eos_id)
                await channel.send(Token(msg.request_id, tok, i, ms(), req.cached if i == 0 else 0, end))
                if kept is not None and i == 0:  # right after the first token
                    await channel.send(RefinedPrompt(msg.request_id, kept))
                if msg.kv_from is not None and i == 0:  # the KV hand-off, right after the first token
                    await channel.send_large(await loop.run_in_executor(self.worker, self._kv_transfer, msg, kv))
                sent += 1
                self.metrics.cloud_tokens.inc()
                if end:
                    reason = end
                    break
                if self.step_delay_ms:
                    await asyncio.sleep(self.step_delay_ms / 1e3)
                logits, kv = await loop.run_in_executor(self.worker, self.engine.decode, tok, kv)
            done = Done(msg.request_id, reason, sent, prefill_ms, req.cached)
            self.completed.append(done)
            outcome = reason
            keep = (msg.prompt_ids + out_ids)[:kv.length]
            if (session_kv is not None and msg.refine is None and not session_kv
                    and self.kept_tokens + len(keep) <= self.max_kept_tokens):
                kept_charge = self.budget.try_charge("kept_kv", self.engine.cfg.kv_bytes_per_token
                                                     * getattr(kv, "capacity", kv.length))
                if kept_charge is not None:  # kept only when the budget holds it
                    session_kv.append(_SessionKV(keep, kv, kept_charge))  # the next turn's prefix
                    self.kept_tokens += len(keep)
            await channel.send(done)
        except RelayInferError:
            outcome = "disconnected"  # the device hung up (it may have finished on its own)
        except Exception as e:  # this request alone ends: the error names what failed
            log.exception("request %s failed", msg.request_id)
            outcome = "error"
            try:
                await channel.send(Error(ErrorCode.INTERNAL.value, _internal(e), msg.request_id))
            except RelayInferError:
                pass
        finally:
            self._dequeue(req)
            del kv  # the request's KV cache is freed here (unless kept for the session's next turn)
            if req.charge is not None:
                req.charge.release()
            requests.pop(msg.request_id, None)
            req.ended.set()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.active_requests.dec()

    # --- HTTP side --------------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        """True when no token is set or the request carries `Authorization: Bearer <the token>`
        (constant-time comparison)."""
        return self.auth_token is None or token_matches(bearer_token(request.headers.get("Authorization")),
                                                        self.auth_token)

    def http_app(self) -> web.Application:
        """The HTTP side: `/healthz`, `/metrics`, `/v1/device-model*` and (with `llm`) the OpenAI
        API, every route but `/healthz` (and `/metrics` with `metrics_public`) behind the token."""

        @web.middleware
        async def auth(request: web.Request, handler):
            public = request.path == "/healthz" or (self.metrics_public and request.path == "/metrics")
            if public or self.authorized(request):
                return await handler(request)
            return _unauthorized(request)

        app = web.Application(middlewares=[auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/device-model", self._device_model)
        app.router.add_get("/v1/device-model/manifest", self._manifest_handler)
        app.router.add_get("/v1/device-model/{name}", self._device_model)
        if self.llm is not None:
            from relayinfer.cloud.serve.openai.api_server import openai_routes
            from relayinfer.protocol.model.tokenizer import Tokenizer

            path = Path(self.engine.model_path)  # the GGUF's own name is an alias of the model id
            openai_routes(app, self.llm, Tokenizer.from_gguf(path), self.model_name, aliases=(path.name, path.stem),
                          budget=self.budget, retry_after_s=self.retry_after_ms / 1e3)
        return app

    def health(self) -> str | None:
        """None while the service can serve; else why not (the batching engine's thread died)."""
        err = getattr(self.llm, "error", None) if self.llm is not None else None
        return None if err is None else f"engine failed: {type(err).__name__}: {err}"

    async def _healthz(self, request):
        """Liveness for anyone (200 `{"status": "ok"}`, or 503 `{"status": "error"}` once the engine
        died); the reason, model fingerprint, model id and engine state only for an authorized caller."""
        dead, details = self.health(), self.authorized(request)
        if dead is not None:
            return web.json_response({"status": "error", **({"reason": dead} if details else {})}, status=503)
        return web.json_response({"status": "ok", **(self._health_details() if details else {})})

    def _health_details(self) -> dict:
        d = {"model_fingerprint": self.fingerprint, "model": self.model_name,
             "sessions": int(self.metrics.active_sessions._value.get()),
             "requests": int(self.metrics.active_requests._value.get())}
        if self.llm is not None:
            e = self.llm.engine
            d["engine"] = {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                           "kv_blocks_used": e.block_manager.num_used_blocks, "kv_blocks_total": e.num_blocks}
        return d

    async def _metrics(self, request):
        body = generate_latest(self.metrics.registry)
        if self.llm is not None:
            body += generate_latest(self.llm.metrics.registry)
        return web.Response(body=body,
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def _manifest_data(self) -> dict:
        """The export manifest (file name -> sha256), read once; side files of exports made before
        their hashes were recorded are hashed here, once."""
        if self._manifest is None:
            if self.device_model_dir is None or not (self.device_model_dir / "manifest.json").is_file():
                raise web.HTTPNotFound(text="this service has no exported device model")
            from relayinfer.cloud.export import SIDE_FILES

            m = json.loads((self.device_model_dir / "manifest.json").read_text())
            for name in SIDE_FILES:
                m["files"].setdefault(name, file_sha256(self.device_model_dir / name))
            self._manifest = m
        return self._manifest

    async def _manifest_handler(self, request):
        return web.json_response(self._manifest_data())

    async def _device_model(self, request):
        files = self._manifest_data()["files"]
        name = request.match_info.get("name") or self._manifest_data().get("default_onnx", "model.fp32.onnx")
        if name not in files:
            raise web.HTTPNotFound(text=f"no device file {name!r}; available: {sorted(files)}")
        return web.FileResponse(self.device_model_dir / name, headers={"X-Content-SHA256": files[name]})

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", ws_port: int = 0, http_port: int | None = 0, *,
                    ssl: _ssl.SSLContext | None = None, certfile: str | Path | None = None,
                    keyfile: str | Path | None = None) -> None:
        """Listen on `host` (websockets on `ws_port`, HTTP on `http_port`; 0 = a free port, None =
        no HTTP side). The bound ports are in `self.ws_port` / `self.http_port`, the URLs in
        `self.url` / `self.http_url`.

        TLS: pass a server `ssl.SSLContext`, or `certfile` (PEM chain) and `keyfile` (its key; None
        when it is inside `certfile`): both ports then speak TLS (`wss://`, `https://`).

        HTTP handlers are cancelled when their client disconnects (aiohttp's `handler_cancellation`),
        so an OpenAI request whose client left is aborted in the engine at its next step.

        Raises:
            ValueError: both `ssl` and `certfile`, a `keyfile` without `certfile`, or a certificate
                that does not load (the message names the file and the reason).
            OSError: a port is in use.
        """
        if certfile is not None:
            if ssl is not None:
                raise ValueError("give either an ssl context or certfile/keyfile, not both")
            ssl = server_context(certfile, keyfile)
        elif keyfile is not None:
            raise ValueError("keyfile given without certfile")
        self._ssl = ssl
        self._host = "127.0.0.1" if host in ("", "0.0.0.0", "::", None) else host
        loop = asyncio.get_running_loop()
        if hasattr(self.engine, "warmup"):  # first forward allocates; keep that out of the first TTFT
            await loop.run_in_executor(self.worker, self.engine.warmup)
        if self.llm is not None:  # the batching engine's runner allocates on its first steps too
            await loop.run_in_executor(self.worker, self.llm.engine.generate, [list(range(16, 48))],
                                       SamplingParams(max_new_tokens=2))
        quiet_accept_errors()
        if http_port is not None:  # first: the Welcome names its /v1/device-model URL
            self._http_runner = web.AppRunner(self.http_app(), access_log=None, handler_cancellation=True,
                                              shutdown_timeout=self.drain_s, **runner_kwargs(self.gate.limits))
            await self._http_runner.setup()
            site = GatedSite(self._http_runner, host, http_port, self.gate, ssl_context=ssl)
            await site.start()
            self.http_port = site.port
        self._ws_server = await proto_ws.serve(self._session, host, ws_port, expected_fingerprint=self.fingerprint,
                                               auth_token=self.auth_token, server="relayinfer-cloud",
                                               max_frame_bytes=self.max_frame_bytes, admit=self._admit,
                                               release=self._release, gate=self.gate,
                                               ping_interval=KEEPALIVE_S, ping_timeout=KEEPALIVE_S,
                                               device_model_url=self.device_model_url or "",
                                               **({"ssl": ssl} if ssl is not None else {}))
        self.ws_port = self._ws_server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening, close every connection and stop the engine. Bounded: open HTTP requests
        get `drain_s` s before they are cancelled, websocket sessions `drain_s` + 10 s (the close
        handshake) to end."""
        if self._ws_server is not None:
            self._ws_server.close()
            try:
                await asyncio.wait_for(self._ws_server.wait_closed(), self.drain_s + 10.0)
            except asyncio.TimeoutError:
                log.warning("websocket sessions did not end within %.0f s of the stop", self.drain_s + 10.0)
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        if self.llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.llm.shutdown)
        self.worker.shutdown(wait=False, cancel_futures=True)

    @property
    def device_model_url(self) -> str | None:
        """`<http_url>/v1/device-model`, sent in every Welcome (a device without the model fetches it
        from there); None without an HTTP side or an exported device model. A host bound to all
        interfaces is named 127.0.0.1 here: the client puts the host it dialled in its place."""
        if self.http_url is None or self.device_model_dir is None:
            return None
        return f"{self.http_url}/v1/device-model"

    def _netloc(self, port) -> str:
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    @property
    def url(self) -> str:
        """The websocket URL devices connect to (`wss://` when serving TLS)."""
        return f"{'wss' if self._ssl is not None else 'ws'}://{self._netloc(self.ws_port)}"

    @property
    def http_url(self) -> str | None:
        """Base URL of the HTTP side (`https://` when serving TLS), None without one."""
        if self.http_port is None:
            return None
        return f"{'https' if self._ssl is not None else 'http'}://{self._netloc(self.http_port)}"


def _internal(e: BaseException) -> str:
    """The message of an INTERNAL error sent for a request that failed while being served."""
    return f"internal error while generating: {type(e).__name__}: {e}"


async def _nothing():
    """An empty async iterator (a request with a zero cloud budget)."""
    return
    yield


class ServiceThread:
    """Run a `CloudService` on its own event loop in a daemon thread (embedded cloud of `relayinfer
    demo`, tests, benchmarks). Use as a context manager; it stops the service on exit."""

    def __init__(self, service: CloudService, host: str = "127.0.0.1", ws_port: int = 0, http_port: int | None = 0,
                 ssl: _ssl.SSLContext | None = None):
        self.service, self._args, self._ssl = service, (host, ws_port, http_port), ssl
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cloud-service", daemon=True)

    def __enter__(self) -> CloudService:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.service.start(*self._args, ssl=self._ssl), self.loop).result(30)
        return self.service

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _unauthorized(request: web.Request) -> web.Response:
    """401 in OpenAI's error shape, with the RFC 6750 challenge."""
    if bearer_token(request.headers.get("Authorization")) is None:
        msg = "Missing API key: send the service token as 'Authorization: Bearer <token>'"
        challenge = 'Bearer realm="relayinfer"'
    else:
        msg = "Incorrect API key provided"
        challenge = 'Bearer realm="relayinfer", error="invalid_token"'
    return web.json_response({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                        "code": "invalid_api_key"}}, status=401,
                             headers={"WWW-Authenticate": challenge})
