"""The cloud prefill service of P/D-Device: a websockets stream endpoint plus an aiohttp HTTP side.

Per `Generate` the cloud prefills the prompt, sends the first `Token` at once, keeps decoding and
streaming tokens until the device sends `Stop` (it has taken over), the cloud token budget is spent,
or the answer ends; then it sends `Done` and frees the request's KV cache.

Every request runs on an `EngineClient` (`cloud.engine.interface`): the batching engine (`llm`:
`AsyncLLMEngine`, or the P/D gateway's `PDEngine`) for plain requests, the per-request engine
(`PerRequestEngine` over the `TorchEngine`, its model steps on one worker thread) for prompt
refinement, the KV hand-off when the batching engine cannot export KV (`exports_kv`), and every
request of a service without `llm`. A KV hand-off goes out in pieces (`kv_piece_bytes`) that
interleave with the connection's other frames. One token loop
(`CloudService._run`) turns the engine's outputs into messages; each session's
`RequestTable(Role.CLOUD)` decides what a device message means for its request (Stop, Cancel,
ExtendBudget, their crossings with Done, id reuse). Admission (`Admission`), the HTTP port
(`HttpSide`) and the kept multi-turn KV (`KeptKVStore`) are the service's collaborators.

HTTP side: `/healthz`, `/metrics` (Prometheus text), `/v1/device-model` (the exported ONNX file,
`X-Content-SHA256` header) and `/v1/device-model/{name}` for the other device files listed in
`/v1/device-model/manifest`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl as _ssl
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from relayinfer.cloud.engine.interface import EngineClient, EngineLimits, KVParts, RefinedIndices
from relayinfer.cloud.engine.per_request import KeptKVStore, PerRequestEngine, SessionSlot
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import params_of
from relayinfer.protocol.model.grammar import grammar_text
from relayinfer.protocol.errors import ChannelClosed, ErrorCode, RelayInferError
from relayinfer.protocol.transport.limits import (Charge, ConnectionGate, ConnectionLimits, GatedSite, MemoryBudget,
    quiet_accept_errors, runner_kwargs)
from relayinfer.protocol.kvhandoff import FRAME_MARGIN, KV_WIRES, KVPacer, kv_pieces, paced_piece_bytes, wire_bytes_per_token
from relayinfer.protocol.messages import (MAX_FRAME_BYTES, Cancel, Done, Error, ExtendBudget, Generate, Pong,
                                          RefinedPrompt, Stop, Token, encode)
from relayinfer.protocol.model.model_file import DEFAULT_MODEL_FILE, KNOWN_MODELS, file_sha256
from relayinfer.protocol.model.refine import TemplateMarkers
from relayinfer.protocol.requests import RequestState, RequestTable, RequestViolation, Role, Transition
from relayinfer.protocol.transport.security import bearer_token, server_context, token_matches
from relayinfer.protocol.validate import MAX_STOP_IDS, FieldError, check, check_ids, check_vocab

log = logging.getLogger("relayinfer.cloud")

MAX_REQUEST_ID = 64  # characters
KEEPALIVE_S = 10.0  # websocket ping interval and timeout: a black-holed device is dropped within ~20 s
REQUEST_MEMORY_MB = 512  # default share of the memory budget beyond the batching engine's KV pool (MiB)
KV_PIECE_BYTES = 1 << 20  # default largest KVTransfer frame of a KV hand-off (bytes): 1 MiB
DEFAULT_MODEL_ID = "smollm2-135m-instruct"


def model_id(model_path: str | Path) -> str:
    """The OpenAI API's model id of a GGUF file: `DEFAULT_MODEL_ID` for the default model, the
    `KNOWN_MODELS` name of another known file ('gemma3-270m'), else the file's stem in lower case
    (the file's name and stem are accepted as aliases either way)."""
    name = Path(model_path).name
    if name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_ID
    known = [k for k, (_, file, _) in KNOWN_MODELS.items() if file == name]
    return known[0] if known else Path(name).stem.lower()


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
    hd = cfg.head_dim
    total = per_tok * peak
    total += n * 4 * (4 * cfg.dim + 2 * cfg.n_heads * hd + 2 * cfg.n_kv_heads * hd + 3 * cfg.ffn_dim)
    total += 2 * cfg.vocab_size * 4
    if refine:
        total += n * n + 2 * cfg.n_heads * 16 * n * 4
    if kv_from is not None:
        total += int(2.5 * per_tok * max(n - 1 - kv_from, 0))
    return total


def kv_handoff_bytes(cfg, n_prompt: int, kv_from: int, piece_bytes: int = KV_PIECE_BYTES) -> int:
    """Bytes a KV hand-off from the batching engine holds beyond its paged KV pool (which the
    budget holds already), an upper estimate charged to the memory budget while it is sent: the
    float16 copy of the n - 1 - kv_from handed-off tokens (`ModelRunner.export_kv`), one layer of
    the cache's float32 gather while it is converted, and two pieces (`piece_bytes`: the one being
    encoded and the one in the socket's write buffer)."""
    tokens = max(n_prompt - 1 - kv_from, 0)
    f32 = cfg.kv_bytes_per_token
    return tokens * f32 // 2 + -(-tokens * f32 // cfg.n_layers) + 2 * piece_bytes


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
        self.sessions = Counter("relayinfer_sessions", "Device sessions handshaken (Hello answered with a "
                                "Welcome; a client that keeps its websocket across requests counts once)", registry=r)
        self.kv_pieces = Counter("relayinfer_kv_pieces", "KVTransfer pieces sent by outcome (sent; dropped: "
                                 "not sent after the device's Stop or Cancel)", ["outcome"], registry=r)
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
    """One admitted Generate of a session: `key` names it in its engine (unique over sessions),
    `pending` its prompt tokens still waiting for a first token, `charge` its bytes in the memory
    budget (per-request path), `kv_charge` those of a KV hand-off from the batch while it is sent,
    `refused` the request-level Error it ends with when a control message for it broke a rule (its
    engine request is aborted; the Error goes after the tokens already produced), `answer_ended`
    the cloud's answer ended by itself (a KV hand-off still under way is then of no use: no
    further piece is sent)."""

    msg: Generate
    key: str
    client: EngineClient
    budget: int | None
    pending: int = 0
    charge: Charge | None = None
    kv_charge: Charge | None = None
    refused: Error | None = None
    answer_ended: bool = False
    t0: float = field(default_factory=time.perf_counter)


@dataclass
class _Session:
    """One device connection: its request table (the per-request rules), the admitted requests by
    id, their tasks and the slot of its kept KV (multi-turn reuse on the per-request path)."""

    session_id: str
    table: RequestTable
    slot: SessionSlot
    requests: dict[str, _Request] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)


class Admission:
    """Who gets served: sessions (`max_sessions`), requests per session, the prefill queue (prompt
    tokens waiting for their first token: `max_queued_tokens`, `max_queue_wait_ms` at the engine's
    prefill rate) and the memory budget of the per-request path. Refusals are request-level Errors
    (OVERLOADED with `retry_after_ms`, BAD_REQUEST naming the field, PROMPT_TOO_LONG naming the limit),
    counted in `metrics`. See `CloudService` for the arguments."""

    def __init__(self, metrics: Metrics, budget: MemoryBudget, max_sessions: int, max_requests_per_session: int,
                 max_queued_tokens: int, max_queue_wait_ms: float, retry_after_ms: float):
        self.metrics, self.budget = metrics, budget
        self.max_sessions, self.max_requests_per_session = max_sessions, max_requests_per_session
        self.max_queued_tokens, self.max_queue_wait_ms = max_queued_tokens, max_queue_wait_ms
        self.retry_after_ms = retry_after_ms
        self.pending_tokens = 0  # prompt tokens of requests waiting for their first token
        self.num_sessions = 0  # open device sessions (from the websocket upgrade on, see `admit`)

    def _overloaded(self, why: str, rid: str | None) -> Error:
        self.metrics.errors.labels(ErrorCode.OVERLOADED.value).inc()
        return Error(ErrorCode.OVERLOADED.value, f"{why}; retry after {self.retry_after_ms:.0f} ms", rid,
                     self.retry_after_ms)

    def admit(self) -> Error | None:
        """Right after the websocket upgrade, before the Hello: OVERLOADED (with the back-off hint)
        when `max_sessions` are open, else the connection is counted as a session (until `release`)."""
        if self.num_sessions >= self.max_sessions:
            return self._overloaded(f"the server holds its limit of {self.max_sessions} device sessions", None)
        self.num_sessions += 1
        self.metrics.active_sessions.inc()
        return None

    def release(self) -> None:
        """An admitted connection ended (after its Hello or without one)."""
        self.num_sessions -= 1
        self.metrics.active_sessions.dec()

    def check(self, msg: Generate, n_live: int, dead: str | None, limits: EngineLimits,
              prefill_tok_s: float | None) -> Error | None:
        """A request-level Error for a Generate we will not run on an engine with `limits`, else None
        (`n_live`: the session's running requests; `dead`: why the service cannot serve, or None)."""
        rid, n = msg.request_id, len(msg.prompt_ids)
        if n_live >= self.max_requests_per_session:
            return self._overloaded(f"this session already runs {n_live} requests, the limit per session", rid)
        if dead is not None:
            return Error(ErrorCode.INTERNAL.value, dead, rid)
        try:  # every field by the shared rules (`protocol.validate`), token ids by this model's vocabulary
            _check_fields(msg, limits.vocab_size)
        except FieldError as e:
            return Error(ErrorCode.BAD_REQUEST.value, str(e), rid)
        limit = limits.max_request_tokens
        if n + msg.max_new_tokens > limit:
            what = (f"the context length of {limit} tokens" if limits.kv_capacity_tokens is None else
                    f"the limit of {limit} tokens per request (min of the context length, {limits.context_length}, "
                    f"and {limits.kv_what}, {limits.kv_capacity_tokens})")
            return Error(ErrorCode.PROMPT_TOO_LONG.value,
                         f"prompt too long: {n} prompt tokens + {msg.max_new_tokens} new tokens exceed {what}", rid)
        return self._queue_check(rid, n, prefill_tok_s)  # last: a request that is wrong gets its own error first

    def _queue_check(self, rid: str, n: int, rate: float | None) -> Error | None:
        if not self.pending_tokens:
            return None
        wait_ms = (self.pending_tokens + n) / rate * 1e3 if rate else 0.0
        if self.pending_tokens + n > self.max_queued_tokens:
            return self._overloaded(f"{self.pending_tokens} prompt tokens are waiting for prefill (limit "
                                    f"{self.max_queued_tokens})", rid)
        if wait_ms > self.max_queue_wait_ms:
            return self._overloaded(f"the expected wait for a first token is {wait_ms:.0f} ms ({self.pending_tokens} "
                                    f"prompt tokens waiting at {rate:.0f} tokens/s; limit "
                                    f"{self.max_queue_wait_ms:.0f} ms)", rid)
        return None

    def charge(self, msg: Generate, cfg, batched: bool = False, piece_bytes: int = KV_PIECE_BYTES) -> Charge | Error:
        """Charge a Generate to the memory budget, or the OVERLOADED Error: on the per-request path
        `per_request_bytes` of the model config `cfg`; a KV hand-off from the batching engine
        (`batched`) `kv_handoff_bytes` (its KV lives in the pool, already charged)."""
        path = "refine" if msg.refine is not None else "kv_handoff" if msg.kv_from is not None else "per_request"
        need = (kv_handoff_bytes(cfg, len(msg.prompt_ids), msg.kv_from, piece_bytes) if batched else
                per_request_bytes(cfg, len(msg.prompt_ids), msg.max_new_tokens, msg.refine is not None, msg.kv_from))
        charge = self.budget.try_charge(path, need)
        if charge is not None:
            return charge
        self.metrics.memory_refused.labels(path).inc()
        what = f"a {len(msg.prompt_ids)}-token prompt" + {"refine": " with refinement",
                                                          "kv_handoff": " with a KV hand-off"}.get(path, "")
        return self._overloaded(self.budget.refusal(what, need), msg.request_id)

    def enqueue(self, req: _Request) -> None:
        req.pending = len(req.msg.prompt_ids)
        self.pending_tokens += req.pending

    def dequeue(self, req: _Request) -> None:
        """The request got its first token (or ended): its prompt no longer waits for prefill."""
        self.pending_tokens -= req.pending
        req.pending = 0


def _check_fields(msg: Generate, vocab: int) -> None:
    """Raise FieldError naming the first field of `msg` outside the shared rules or the vocabulary."""
    n = len(msg.prompt_ids)
    check_ids("prompt_ids", msg.prompt_ids, vocab - 1, min_len=1)
    check("cloud_budget", msg.cloud_budget, optional=True)
    check("refine", msg.refine, optional=True)
    if msg.kv_from is not None and n < 2:
        raise FieldError("kv_from", "left out for a one-token prompt (no prompt KV to hand off)", msg.kv_from)
    # the hand-off carries tokens [kv_from, n - 1): at least one
    check("kv_from", msg.kv_from, hi=n - 2, optional=True)
    if msg.kv_from is not None and msg.refine is not None:
        raise FieldError("kv_from", "left out when refine is given (they cannot be combined)", msg.kv_from)
    check("kv_rate", msg.kv_rate, optional=True)
    if msg.kv_wire not in KV_WIRES:
        raise FieldError("kv_wire", f"one of {', '.join(KV_WIRES)}", msg.kv_wire)
    if msg.kv_from is None:  # both shape a KV hand-off only: refused rather than ignored without one
        if msg.kv_rate is not None:
            raise FieldError("kv_rate", "left out without kv_from (it paces a KV hand-off)", msg.kv_rate)
        if msg.kv_wire != "float16":
            raise FieldError("kv_wire", "left out (or float16) without kv_from (it formats a KV hand-off)",
                             msg.kv_wire)
    params = params_of(msg)  # SamplingParams checks the sampling fields
    check_vocab(vocab, params.stop_ids, params.logit_bias)


class HttpSide:
    """The HTTP port: `/healthz`, `/metrics`, `/v1/device-model*` and (with a batching engine) the
    OpenAI API, every route but `/healthz` (and `/metrics` with `metrics_public`) behind the token.
    Health and engine details come from `service` (`health_response`). With `web_dir` (`cloud serve
    --web`) the demo page's static folder is served, without the token, on `/web/` (the page sends
    the token itself), and `/web/config.json` names the websocket port."""

    web_dir: Path | None = None

    def __init__(self, service: "CloudService", auth_token: str | None, metrics_public: bool,
                 device_model_dir: str | Path | None):
        self.service, self.auth_token, self.metrics_public = service, auth_token, metrics_public
        self.device_model_dir = Path(device_model_dir) if device_model_dir else None
        self._manifest: dict | None = None

    def authorized(self, request: web.Request) -> bool:
        """True when no token is set or the request carries `Authorization: Bearer <the token>`
        (constant-time comparison)."""
        return self.auth_token is None or token_matches(bearer_token(request.headers.get("Authorization")),
                                                        self.auth_token)

    def app(self) -> web.Application:
        """The aiohttp application of the HTTP port."""

        @web.middleware
        async def auth(request: web.Request, handler):
            public = request.path == "/healthz" or (self.metrics_public and request.path == "/metrics")
            public = public or (self.web_dir is not None and (request.path + "/").startswith("/web/"))
            if public or self.authorized(request):
                return await handler(request)
            return _unauthorized(request)

        app = web.Application(middlewares=[auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/device-model", self._device_model)
        app.router.add_get("/v1/device-model/manifest", self._manifest_handler)
        app.router.add_get("/v1/device-model/{name}", self._device_model)
        if self.web_dir is not None:
            app.router.add_get("/web/config.json", self._web_config)
            app.router.add_get("/web", self._web_index)
            app.router.add_get("/web/", self._web_index)
            app.router.add_static("/web/", self.web_dir)
        svc = self.service
        if svc.llm is not None:
            from relayinfer.cloud.serve.openai.api_server import openai_routes
            from relayinfer.protocol.model.tokenizer import Tokenizer

            path = Path(svc.engine.model_path)  # the GGUF's own name is an alias of the model id
            openai_routes(app, svc.llm, Tokenizer.from_gguf(path), svc.model_name, aliases=(path.name, path.stem),
                          budget=svc.budget, retry_after_s=svc.admission.retry_after_ms / 1e3,
                          body_timeout_s=svc.gate.limits.idle_timeout_s)
        return app

    async def _healthz(self, request):
        body, status = self.service.health_response(self.authorized(request))
        return web.json_response(body, status=status)

    async def _web_index(self, request):
        if request.path == "/web":
            raise web.HTTPFound("/web/")
        return web.FileResponse(self.web_dir / "index.html")

    async def _web_config(self, request):
        svc = self.service
        return web.json_response({"ws_port": svc.ws_port, "ws_scheme": "wss" if svc._net.ssl is not None else "ws"})

    async def _metrics(self, request):
        svc = self.service
        body = generate_latest(svc.metrics.registry)
        registry = svc.llm.metrics_registry if svc.llm is not None else None
        if registry is not None:
            body += generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

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


@dataclass
class _Listeners:
    """The two listening ports and how they were opened."""

    ssl: _ssl.SSLContext | None = None
    host: str = "127.0.0.1"
    ws_server: object = None
    http_runner: web.AppRunner | None = None
    ws_port: int | None = None
    http_port: int | None = None


class CloudService:
    """Serves device sessions over websockets: every request runs on an `EngineClient` (the batching
    engine `llm`, or the per-request engine over `engine`) and one token loop (`_run`) streams its
    outputs; the per-request rules (Stop, Cancel, ExtendBudget and their crossings, id reuse) are
    the session's `RequestTable(Role.CLOUD)`.

    Args:
        engine: the cloud runtime: a `TorchEngine` (or anything with its `prefill` / `prefill_scored`
            / `decode` / `warmup` interface, `eos_id`, `context_length`, `cfg`), run by
            `PerRequestEngine` for the requests that do not join the batch.
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
            request on the per-request path (refinement, KV hand-off `kv_from` without `llm`, every
            request without `llm`) is charged `per_request_bytes` while it runs, a KV hand-off from
            the batching engine `kv_handoff_bytes` while it is sent, a kept multi-turn KV cache
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
        llm: a batching `EngineClient` (`AsyncLLMEngine`: continuous batching over a paged KV cache;
            `PDEngine`: the P/D pools). When given, requests
            without refinement join its batch (a KV hand-off too, when it `exports_kv`: the KV is
            copied out of the paged cache) and the HTTP side also serves the OpenAI-compatible
            API; requests with refinement take the per-request path (the batched runner does not
            compute attention scores).
        kv_piece_bytes: largest `KVTransfer` frame of a KV hand-off (bytes, default 1 MiB): the
            hand-off goes out in pieces of at most this size, interleaved with the connection's
            other frames (Pongs, other requests' Tokens, websocket pings); after the device's Stop
            or Cancel no further piece is sent (docs/PROTOCOL.md, "KV hand-off"). Raises ValueError
            below one token's KV plus `protocol.kvhandoff.FRAME_MARGIN`, or above MAX_FRAME_BYTES.
        model_name: the model id of the OpenAI-compatible API (default `model_id` of the engine's
            model file).
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
                 llm: EngineClient | None = None, model_name: str | None = None,
                 metrics_public: bool = False, max_sessions: int = 256, max_requests_per_session: int = 4,
                 retry_after_ms: float = 5000.0, max_queued_tokens: int = 4096, max_queue_wait_ms: float = 2000.0,
                 history: int = 1000, max_kept_tokens: int = 8192, limits: ConnectionLimits | None = None,
                 memory_bytes: int | None = None, kv_piece_bytes: int = KV_PIECE_BYTES):
        self.engine, self.fingerprint, self.llm = engine, fingerprint, llm
        path = getattr(engine, "model_path", None)
        self.model_name = model_name or (model_id(path) if path is not None else DEFAULT_MODEL_ID)
        self._markers = _MarkersOf(engine, special_ids)
        self.per_request = PerRequestEngine(engine, self._markers.get, step_delay_ms)
        self.max_frame_bytes = max_frame_bytes or split_frame_limit(engine.context_length, engine.cfg.vocab_size)
        least = FRAME_MARGIN + engine.cfg.kv_bytes_per_token // 2  # one float16 token and the message's fields
        if not least <= kv_piece_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"kv_piece_bytes={kv_piece_bytes}: a KVTransfer piece holds at least one token "
                             f"({least} bytes with its fields) and at most MAX_FRAME_BYTES ({MAX_FRAME_BYTES})")
        self.kv_piece_bytes = kv_piece_bytes
        self.gate = ConnectionGate(limits)  # open connections of both ports
        self.metrics = Metrics()
        pool = llm.limits.kv_pool_bytes if llm is not None else 0  # the batching engine's KV cache, for good
        budget = MemoryBudget(memory_bytes if memory_bytes is not None else pool + (REQUEST_MEMORY_MB << 20))
        if pool:
            budget.reserve("kv_pool", pool)  # ValueError naming both sizes when the pool alone passes it
        self.metrics.memory_limit.set(budget.limit_bytes)
        self.metrics.memory_used.set_function(lambda: budget.used)
        self.admission = Admission(self.metrics, budget, max_sessions, max_requests_per_session, max_queued_tokens,
                                   max_queue_wait_ms, retry_after_ms)
        self.kept = KeptKVStore(budget, max_kept_tokens, lambda: engine.cfg.kv_bytes_per_token)
        self.http = HttpSide(self, auth_token, metrics_public, device_model_dir)
        self.completed: deque[Done] = deque(maxlen=history)  # the last Done of recent requests
        self._net = _Listeners()

    # --- what tests, benches and the CLI read ------------------------------------------------------

    @property
    def budget(self) -> MemoryBudget:
        """The memory budget of every request path (`protocol.transport.limits.MemoryBudget`)."""
        return self.admission.budget

    @property
    def num_sessions(self) -> int:
        """Open device sessions (counted from the websocket upgrade)."""
        return self.admission.num_sessions

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens of admitted requests still waiting for their first token."""
        return self.admission.pending_tokens

    @property
    def kept_tokens(self) -> int:
        """Tokens of the KV caches kept for the sessions' next turns (per-request path)."""
        return self.kept.kept_tokens

    @property
    def max_kept_tokens(self) -> int:
        return self.kept.max_kept_tokens

    @property
    def worker(self) -> ThreadPoolExecutor:
        """The thread that runs the per-request engine's model steps (benches pin it to a core)."""
        return self.per_request.worker

    @property
    def markers(self) -> TemplateMarkers:
        """The chat template's scaffold that refinement keeps whole (read from the model's tokenizer;
        `special_ids`, when given to the constructor, replaces its control ids)."""
        return self._markers.get()

    @property
    def device_model_dir(self) -> Path | None:
        return self.http.device_model_dir

    def authorized(self, request: web.Request) -> bool:
        """True when no token is set or the request carries the service token (see `HttpSide`)."""
        return self.http.authorized(request)

    def max_request_tokens(self, batched: bool) -> int:
        """Prompt + answer tokens one request may hold on the batching (`batched`) or the
        per-request engine: min(context length, KV cache capacity)."""
        return (self.llm if batched else self.per_request).limits.max_request_tokens

    def health(self) -> str | None:
        """None while the service can serve; else why not (the batching engine or the per-request
        engine's model failed)."""
        return (self.llm.health() if self.llm is not None else None) or self.per_request.health()

    def health_response(self, details: bool) -> tuple[dict, int]:
        """/healthz: (body, status). Liveness for anyone (200 `{"status": "ok"}`, or 503
        `{"status": "error"}` once the engine died); the reason, model fingerprint, model id and
        engine state only with `details` (an authorized caller)."""
        dead = self.health()
        if dead is not None:
            return {"status": "error", **({"reason": dead} if details else {})}, 503
        return {"status": "ok", **(self._health_details() if details else {})}, 200

    def placement(self) -> dict:
        """Where the engine runs: {'device': 'cpu' | 'cuda:0' | ..., 'dtype': 'float32' | 'bfloat16' |
        'float16'}; the keys an engine does not tell are left out."""
        dev, dt = getattr(self.engine, "device", None), getattr(self.engine, "dtype", None)
        return ({"device": str(dev)} if dev is not None else {}) | (
            {"dtype": str(dt).removeprefix("torch.")} if dt is not None else {})

    def _health_details(self) -> dict:
        d = {"model_fingerprint": self.fingerprint, "model": self.model_name, **self.placement(),
             "sessions": int(self.metrics.active_sessions._value.get()),
             "requests": int(self.metrics.active_requests._value.get())}
        if self.llm is not None:
            d["engine"] = self.llm.state()
        return d

    def http_app(self) -> web.Application:
        """The HTTP side (see `HttpSide`)."""
        return self.http.app()

    # --- websockets side ------------------------------------------------------------------------

    async def _session(self, channel: proto_ws.ServerChannel) -> None:
        """One device connection: feed each message to the session's request table and act on the
        legal ones; every admitted Generate runs as its own task (`_run`)."""
        if not channel.hello.model_fingerprint:  # a device without the model asked where it is (Welcome): done
            return
        sess = _Session(channel.session_id, RequestTable(Role.CLOUD), self.kept.slot())
        self.metrics.sessions.inc()
        try:
            async for msg in channel:
                if not await self._dispatch(channel, sess, msg):
                    break
        except RelayInferError as e:  # protocol violation already answered, or peer gone
            if not isinstance(e, ChannelClosed):
                self.metrics.errors.labels(e.code.value).inc()
            log.info("session %s ended: %s", channel.session_id, e)
        finally:
            for rid, req in list(sess.requests.items()):  # peer gone: every request ends, its KV freed
                sess.table.receive(Cancel(rid))  # a task not started yet streams nothing
                req.client.abort(req.key)
            if sess.tasks:
                await asyncio.gather(*sess.tasks, return_exceptions=True)
            sess.slot.close()  # the session's kept KV cache is freed with it

    async def _dispatch(self, channel, sess: _Session, msg) -> bool:
        """Act on one message from the device; False when the session must end (a connection-level
        Error was sent)."""
        if isinstance(msg, Generate):
            await self._on_generate(channel, sess, msg)
        elif isinstance(msg, Stop) and self._refuse_control(sess, msg, "handoff_index", msg.handoff_index):
            pass
        elif isinstance(msg, (Stop, Cancel)):
            ev = sess.table.receive(msg)
            req = sess.requests.get(msg.request_id)
            if isinstance(ev, Transition) and not ev.ignored and req is not None:
                req.client.abort(req.key)  # it ends at its next step; Done says stop / cancel
        elif isinstance(msg, ExtendBudget):
            await self._on_extend(channel, sess, msg)
        elif not isinstance(msg, Pong):  # a Pong is a liveness answer: nothing to do
            ev = sess.table.receive(msg)  # not a device's request message: a violation, or no request's
            rid = ev.request_id if ev is not None else None
            why = f": {ev.reason}" if isinstance(ev, RequestViolation) else ""
            await channel.send(Error(ErrorCode.BAD_REQUEST.value, f"unexpected {type(msg).__name__} from a "
                                     f"device{why}", rid))
            return rid is not None  # a connection-level Error: the protocol says the sender closes
        return True

    def _refuse_control(self, sess: _Session, msg, field_name: str, value) -> bool:
        """Check `value` of a Stop / ExtendBudget by its rule (`protocol.validate`). When it breaks
        the rule the message does nothing but end its live request with a BAD_REQUEST naming the
        field (a request-level Error ends the request at both ends: it cannot go on after it);
        for a request that is not live it is ignored, as any control message for it. True when
        refused."""
        try:
            check(field_name, value)
            return False
        except FieldError as e:
            err = Error(ErrorCode.BAD_REQUEST.value, str(e), msg.request_id)
        req = sess.requests.get(msg.request_id)
        if req is not None and req.refused is None:
            self.metrics.errors.labels(err.code).inc()
            req.refused = err
            req.client.abort(req.key)  # it ends at its next step; `_run` sends the Error last
        return True

    async def _on_generate(self, channel, sess: _Session, msg: Generate) -> None:
        """Admit a Generate (the table decides whether its id is free) and start its task, or answer
        the request-level Error."""
        rid = msg.request_id
        if not 1 <= len(rid) <= MAX_REQUEST_ID:
            self.metrics.errors.labels(ErrorCode.BAD_REQUEST.value).inc()
            await channel.send(Error(ErrorCode.BAD_REQUEST.value, f"request_id must be a string of 1..{MAX_REQUEST_ID} "
                                     f"characters, got {len(rid)}", rid[:MAX_REQUEST_ID]))
            return
        ev = sess.table.receive(msg)
        if isinstance(ev, RequestViolation):  # the id is running: that request goes on
            self.metrics.errors.labels(ev.code.value).inc()
            await channel.send(ev.error)
            return
        err = None
        if msg.grammar is not None:  # compiled and checked on a worker thread: the other streams go on
            try:
                await asyncio.to_thread(grammar_text, msg.grammar)
            except FieldError as e:
                err = Error(ErrorCode.BAD_REQUEST.value, str(e), rid)
        client = self.llm if self._batched(msg) else self.per_request
        if err is None:
            err = self.admission.check(msg, len(sess.requests), self.health(), client.limits, client.prefill_tok_s)
        if err is None and msg.refine is not None:
            try:
                self._markers.get()
            except ValueError as e:  # a chat template whose turns cannot be found: no refinement, said so
                err = Error(ErrorCode.BAD_REQUEST.value, f"refine: this model's prompts cannot be refined ({e}); "
                                                         "leave refine out", rid)
        charge = kv_charge = None
        if err is None and client is self.per_request:
            charge = self.admission.charge(msg, self.engine.cfg)
        elif err is None and msg.kv_from is not None:  # the hand-off's copy, while it is sent
            kv_charge = self.admission.charge(msg, self.engine.cfg, batched=True, piece_bytes=self.kv_piece_bytes)
        for c in (charge, kv_charge):
            if isinstance(c, Error):
                err = c
        if err is not None:
            if err.code != ErrorCode.OVERLOADED.value:  # OVERLOADED ones are counted where decided
                self.metrics.errors.labels(err.code).inc()
            sess.table.send(err)
            await channel.send(err)
            return
        req = sess.requests[rid] = _Request(msg, f"{sess.session_id}/{rid}", client, msg.cloud_budget, charge=charge,
                                            kv_charge=kv_charge)
        self.admission.enqueue(req)
        task = asyncio.create_task(self._run(channel, req, sess))
        sess.tasks.add(task)
        task.add_done_callback(sess.tasks.discard)

    async def _on_extend(self, channel, sess: _Session, msg: ExtendBudget) -> None:
        """A larger (or smaller) cloud budget, capped at max_new_tokens, which admission checked."""
        if self._refuse_control(sess, msg, "cloud_budget", msg.cloud_budget):
            return
        ev = sess.table.receive(msg)
        req = sess.requests.get(msg.request_id)
        if isinstance(ev, Transition) and not ev.ignored and req is not None:
            req.budget = min(msg.cloud_budget, req.msg.max_new_tokens)
            req.client.set_budget(req.key, req.budget)

    def _batched(self, msg: Generate) -> bool:
        """Whether a request joins the batching engine: not with refinement (the batched runner
        computes no attention scores); with a KV hand-off when the engine exports KV from its paged
        cache (`exports_kv`: `AsyncLLMEngine` does, the P/D gateway does not) and the request fits
        its KV capacity (a longer one takes the per-request path, whose cache grows to the context)."""
        if self.llm is None or msg.refine is not None:
            return False
        return msg.kv_from is None or (getattr(self.llm, "exports_kv", False) is True and
                                       len(msg.prompt_ids) + msg.max_new_tokens <= self.llm.limits.max_request_tokens)

    # --- the token loop ---------------------------------------------------------------------------

    async def _run(self, channel, req: _Request, sess: _Session) -> None:
        """One request from its engine's first output to its Done (or Error): stream the outputs,
        free what it holds, end it in the table, count its outcome."""
        rid = req.msg.request_id
        self.metrics.active_requests.inc()
        outcome, end = "error", None
        try:
            try:
                end = await self._stream(channel, req, sess)
                end = req.refused or end
            except RequestViolation as e:  # our own bug: the table refused what we were about to send
                log.error("request %s: %s", rid, e)
                end = Error(ErrorCode.INTERNAL.value, _internal(e), rid)
            except RelayInferError:
                outcome = "disconnected"  # the device hung up (it may have finished on its own)
            except Exception as e:  # this request alone ends: the error names what failed
                log.exception("request %s failed", rid)
                end = Error(ErrorCode.INTERNAL.value, _internal(e), rid)
            finally:
                self._release(req, sess)
            if end is not None:
                sess.table.send(end)  # from here on the id may be used again
                if isinstance(end, Done):
                    self.completed.append(end)
                    outcome = end.reason
                try:
                    await channel.send(end)
                except RelayInferError:
                    outcome = "disconnected" if isinstance(end, Done) else outcome
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.metrics.active_requests.dec()

    def _release(self, req: _Request, sess: _Session) -> None:
        """The request's stream is over: free its engine state, budget charge and queue share."""
        self.admission.dequeue(req)
        req.client.abort(req.key)  # no-op when finished; frees the KV otherwise
        for c in (req.charge, req.kv_charge):
            if c is not None:
                c.release()
        req.kv_charge = None
        if sess.requests.get(req.msg.request_id) is req:
            del sess.requests[req.msg.request_id]

    def _outputs(self, req: _Request, sess: _Session):
        """The request's engine outputs. A zero budget streams nothing, nor does a request whose
        Stop/Cancel came before its task started (no await between this check and the engine's add)."""
        msg = req.msg
        if req.budget == 0 or sess.table.state(msg.request_id) in (RequestState.STOPPING, RequestState.CANCELLING):
            return _nothing()
        params = params_of(msg)
        if req.client is self.per_request:
            return self.per_request.generate(req.key, msg.prompt_ids, params, req.budget, refine=msg.refine,
                                             kv_from=msg.kv_from, session=sess.slot)
        if msg.kv_from is not None:
            return req.client.generate(req.key, msg.prompt_ids, params, req.budget, kv_from=msg.kv_from)
        return req.client.generate(req.key, msg.prompt_ids, params, req.budget)

    async def _stream(self, channel, req: _Request, sess: _Session) -> Done:
        """Send every output of the request as its message (each recorded in the table first);
        returns its Done. The token that ends the answer carries its finish reason (a budget cut is
        no end); Done's reason is that, else stop / cancel (the table's state), else budget / length.
        A KV hand-off goes out from its own task (`_send_kv`) while the tokens keep streaming; the
        Done waits for its last piece, or for the pieces sent before a Stop / Cancel or the
        answer's own end cut it short."""
        msg, table = req.msg, sess.table
        rid, sent, last, prefill_ms, cached = msg.request_id, 0, None, 0.0, 0

        async def send(m) -> None:
            table.send(m)
            await channel.send(m)

        kv_task: asyncio.Task | None = None
        try:
            async for out in self._outputs(req, sess):
                if isinstance(out, RefinedIndices):
                    await send(RefinedPrompt(rid, out.kept))
                    continue
                if isinstance(out, KVParts):  # sent beside the tokens: they keep streaming meanwhile
                    kv_task = asyncio.create_task(self._send_kv(channel, req, sess, out))
                    continue
                ms = (time.perf_counter() - req.t0) * 1e3
                if sent == 0:
                    self.admission.dequeue(req)
                    prefill_ms = ms
                    self.metrics.prefill.observe(prefill_ms / 1e3)
                    stats = req.client.request_stats(req.key)
                    cached = stats.prefix_hit_tokens if stats is not None else 0
                end = out.finish_reason if out.finish_reason != "budget" else None
                await send(Token(rid, out.token_id, out.index, ms, cached if sent == 0 else 0, end))
                sent += 1
                self.metrics.cloud_tokens.inc()
                last = out.finish_reason
            if kv_task is not None:  # Done comes after the last piece (or after the pieces a Stop cut short)
                req.answer_ended = last not in (None, "budget")  # the whole answer is out: no more pieces
                await kv_task
        finally:
            if kv_task is not None and not kv_task.done():
                kv_task.cancel()
                await asyncio.gather(kv_task, return_exceptions=True)
        if sent == 0:  # what the prefill reused counts also when no token came (stopped first)
            stats = req.client.request_stats(req.key)
            cached = stats.prefix_hit_tokens if stats is not None else 0
        state = table.state(rid)
        reason = last or {RequestState.STOPPING: "stop", RequestState.CANCELLING: "cancel"}.get(state) or (
            "budget" if req.budget is not None and sent >= req.budget else "length")
        return Done(rid, reason, sent, prefill_ms, cached)

    async def _send_kv(self, channel, req: _Request, sess: _Session, out: KVParts) -> None:
        """Send a KV hand-off as `KVTransfer` pieces of at most `kv_piece_bytes` each, in token
        order, in the format `Generate.kv_wire` asks for (float16, or int8 with per-token
        scales), each built only when it is its turn (`protocol.kvhandoff.kv_pieces`). Between two
        pieces the loop yields, so the session's reader acts on what the device sent (Stop, Cancel,
        Ping: its Pong goes out before the next piece) and the other requests' frames interleave;
        a piece is sent only while the request is neither stopping nor cancelling (checked with no
        await before its write): after the device's Stop or Cancel no piece follows, and the Done
        comes with fewer pieces than `num_blocks` (the device then prefills). With `Generate.kv_rate`
        the pieces are about `PACED_PIECE_MS` of that rate each and go out at that average rate
        (`protocol.kvhandoff.KVPacer`). The hand-off's memory charge is released once it is sent or
        dropped."""
        rid, table, rate, wire = req.msg.request_id, sess.table, req.msg.kv_rate, req.msg.kv_wire
        piece_bytes = self.kv_piece_bytes
        pacer = KVPacer(rate) if rate else None
        if pacer is not None:  # pieces of about PACED_PIECE_MS at the asked rate (at least one token)
            c = self.engine.cfg
            one = wire_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, wire) + FRAME_MARGIN
            piece_bytes = paced_piece_bytes(rate, self.kv_piece_bytes, one)
        pieces = kv_pieces(rid, out.kv, out.token_start, piece_bytes, wire)
        del out
        sent = total = 0
        loop = asyncio.get_running_loop()
        try:
            for m in pieces:
                total = m.num_blocks if m.block_index >= 0 else 1
                if pacer is not None:  # the device's rate: its tokens pass between two pieces on the link
                    wait = pacer.delay_s(loop.time(), len(m.kv.data))
                    if wait > 0:
                        await asyncio.sleep(wait)
                if req.answer_ended or table.state(rid) in (RequestState.STOPPING, RequestState.CANCELLING):
                    break
                table.send(m)
                await channel.send_large([m])
                sent += 1
                await asyncio.sleep(0)  # let the reader run: a Stop/Cancel is acted on before the next piece
        finally:
            del pieces
            self.metrics.kv_pieces.labels("sent").inc(sent)
            if total > sent:
                self.metrics.kv_pieces.labels("dropped").inc(total - sent)
            if req.kv_charge is not None:
                req.kv_charge.release()
                req.kv_charge = None

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
        net = self._net
        net.ssl, net.host = ssl, "127.0.0.1" if host in ("", "0.0.0.0", "::", None) else host
        await self.per_request.warmup()  # first forward allocates; keep that out of the first TTFT
        if self.llm is not None:  # the batching engine's runner allocates on its first steps too
            await self.llm.warmup()
        quiet_accept_errors()
        if http_port is not None:  # first: the Welcome names its /v1/device-model URL
            net.http_runner = web.AppRunner(self.http_app(), access_log=None, handler_cancellation=True,
                                            shutdown_timeout=self.drain_s, **runner_kwargs(self.gate.limits))
            await net.http_runner.setup()
            site = GatedSite(net.http_runner, host, http_port, self.gate, ssl_context=ssl)
            await site.start()
            net.http_port = site.port
        net.ws_server = await proto_ws.serve(self._session, host, ws_port, expected_fingerprint=self.fingerprint,
                                             auth_token=self.http.auth_token, server="relayinfer-cloud",
                                             max_frame_bytes=self.max_frame_bytes, admit=self.admission.admit,
                                             release=self.admission.release, gate=self.gate,
                                             ping_interval=KEEPALIVE_S, ping_timeout=KEEPALIVE_S,
                                             device_model_url=self.device_model_url or "",
                                             **({"ssl": ssl} if ssl is not None else {}))
        net.ws_port = net.ws_server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening, close every connection and stop the engines. Bounded: open HTTP requests
        get `drain_s` s before they are cancelled, websocket sessions `drain_s` + 10 s (the close
        handshake) to end."""
        net = self._net
        self.gate.close()  # TLS handshakes under way: their connections belong to no listener's close
        if net.ws_server is not None:
            net.ws_server.close()
            try:
                await asyncio.wait_for(net.ws_server.wait_closed(), self.drain_s + 10.0)
            except asyncio.TimeoutError:
                log.warning("websocket sessions did not end within %.0f s of the stop", self.drain_s + 10.0)
        if net.http_runner is not None:
            await net.http_runner.cleanup()
        if self.llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.llm.shutdown)
        self.per_request.shutdown()

    @property
    def ws_port(self) -> int | None:
        return self._net.ws_port

    @property
    def http_port(self) -> int | None:
        return self._net.http_port

    @property
    def device_model_url(self) -> str | None:
        """`<http_url>/v1/device-model`, sent in every Welcome (a device without the model fetches it
        from there); None without an HTTP side or an exported device model. A host bound to all
        interfaces is named 127.0.0.1 here: the client puts the host it dialled in its place."""
        if self.http_url is None or self.device_model_dir is None:
            return None
        return f"{self.http_url}/v1/device-model"

    def _netloc(self, port) -> str:
        host = self._net.host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def url(self) -> str:
        """The websocket URL devices connect to (`wss://` when serving TLS)."""
        return f"{'wss' if self._net.ssl is not None else 'ws'}://{self._netloc(self.ws_port)}"

    @property
    def http_url(self) -> str | None:
        """Base URL of the HTTP side (`https://` when serving TLS), None without one."""
        if self.http_port is None:
            return None
        return f"{'https' if self._net.ssl is not None else 'http'}://{self._netloc(self.http_port)}"


class _MarkersOf:
    """The chat template's scaffold of `engine`'s model, read from its tokenizer on first use;
    `special_ids` (when given) replaces its control ids."""

    def __init__(self, engine, special_ids: frozenset[int] | None):
        self._engine, self._special_ids = engine, special_ids
        self._markers: TemplateMarkers | None = None

    def get(self) -> TemplateMarkers:
        if self._markers is None:
            from dataclasses import replace

            from relayinfer.protocol.model.tokenizer import Tokenizer

            m = TemplateMarkers.from_tokenizer(Tokenizer.from_gguf(self._engine.model_path))
            self._markers = m if self._special_ids is None else replace(m, special_ids=frozenset(self._special_ids))
        return self._markers


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
    from relayinfer.cloud.serve.openai.protocol import error_body

    return web.json_response(error_body(msg, code="invalid_api_key"), status=401,
                             headers={"WWW-Authenticate": challenge})
