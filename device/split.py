"""The split session: the device side of P/D-Device (cloud prefill -> device decode hand-off).

Three coroutines share one answer list:

* receiver: appends the cloud's tokens (index order) until the hand-off; records Done/faults.
* device worker: prefills the prompt on ONNX Runtime, then the cloud tokens received so far in one
  batch (amortized), again and again until it has covered every token received. At that moment (an
  atomic check on the event loop) it fixes the hand-off index h = len(answer), sends `Stop{h}`, and
  decodes tokens h, h+1, ... itself. Cloud tokens with index >= h are ignored.
* display: shows answer tokens in order through the `SpeedController`.

The shown stream is answer[0:h] from the cloud then answer[h:] from the device: no gap, no duplicate.
With greedy sampling the cloud and the device agree on every token, so the split answer equals the
cloud-only and device-only answers (fp32; tested). Seeded sampling draws position i with the same
generator on both sides (see `protocol.model.decoding.sample`).

Faults (every one ends the request in a bounded time; `GenerationResult.fault` records which):

* cloud unreachable or refusing at start -> device-only ('cloud-unreachable', 'cloud-refused');
* the cloud overloaded (OVERLOADED at the handshake or for the request) -> device-only, and the
  client stays device-only for the `retry_after_ms` the cloud asked for ('cloud-overloaded');
* connection lost, a request-level Error, or no frame within the progress timeout (a stalled
  server or a black-holed network; checked while the device is not working towards a hand-off,
  since such a device hands off without waiting for the cloud) -> the device takes over from the
  tokens it has: it prefills what it has not yet of the prompt and the tokens received, then
  decodes the rest ('connection-lost', 'cloud-error', 'cloud-stalled'). This holds also when the
  settings had planned the cloud to the end. In cloud-only mode (or when the device runtime failed) the answer ends
  with the tokens received and finish_reason 'error';
* device runtime error -> the cloud streams to the end if it still can ('device-error').

What was *planned* is not a fault: `GenerationResult.plan` / `plan_reason` record what the request
and the settings chose before it started ('split'; 'cloud-to-the-end' when the device cannot catch
up within the answer; 'device-only' when asked for or without a cloud URL; 'cloud-only' when asked
for), and `mode` what happened. A split whose answer ended before the device caught up is
`mode` 'cloud-only' with `fault` None; one whose device was ready before the first cloud token is
'device-only' with `fault` None.

Under the cloud-to-the-end plan the device still works, in the background: it prefills the prompt
and then the cloud tokens received, in chunks of `BACKGROUND_CHUNK` tokens on its own low-priority
thread (`background_executor`), and holds (no hand-off) while the plan stands. A cloud fault (or a
re-plan that finds a hand-off feasible, `_Run.replan_idle`, also tried when the background prompt
prefill is done) releases it: the device then prefills only what is left at full priority and takes
over, so a fault costs the prefill left, not the whole prefill (`GenerationResult.prefill_left_at_fault`).
When the answer ends first, the background work stops after its chunk in flight (bounded), and its
cache is the conversation's next `DeviceCache`.

The progress timeout is derived per request from the client's cloud estimates (see
`SplitOptions.progress_timeout`).

Multi-turn reuse (`SplitSession.run(..., past=DeviceCache)`, used by `sdk.client.Conversation`):
the device starts from the previous turn's KV cut to the longest common prefix of its ids and the
new prompt, and prefills (and plans with) only the rest. KV hand-off (`SplitOptions.kv_handoff`,
`protocol.kvhandoff`): the Generate asks for the KV of the uncached prompt tokens but the last
(`kv_from`); the device waits for the `KVTransfer` (bounded by the progress timeout; without it
the device prefills as usual), imports it and prefills only the last prompt token.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams, check_prompt, finish_reason, sample
from relayinfer.protocol.errors import ErrorCode, RelayInferError, RemoteError
from relayinfer.protocol.kvhandoff import common_prefix, kv_bytes_per_token, kv_handoff_pays, kv_layers
from relayinfer.protocol.messages import (Cancel, Done, Error, ExtendBudget, Generate, KVTransfer, RefinedPrompt, Stop,
                                         Token)
from relayinfer.protocol.model.refine import TemplateMarkers, check_refine, choose_refine, system_prefix_len
from relayinfer.protocol.validate import FieldError, check

from .settings import CatchUp, Timing, choose_settings
from .speed import SpeedController, tpot_from_arrivals

MODES = ("split", "device-only", "cloud-only")
SEND_TIMEOUT_S = 1.0  # bound on a best-effort Stop/Cancel/ExtendBudget send and on closing the channel

BACKGROUND_CHUNK = 32  # tokens per low-priority prefill call while the plan keeps the device idle
BACKGROUND_NICE = 10  # niceness added to the background prefill thread (Linux: per thread)
INFLIGHT_WAIT_S = 10.0  # bound on waiting for an engine call in flight when the answer has ended

log = logging.getLogger("relayinfer.device")
_background: ThreadPoolExecutor | None = None
_background_lock = threading.Lock()


def _lower_thread_priority() -> None:
    """Raise this thread's niceness by BACKGROUND_NICE (at most 19). Linux only: there a thread is
    a task with its own nice value; elsewhere `setpriority(PRIO_PROCESS, ...)` would name a process,
    so the thread keeps its priority and only the small chunks keep the background work polite."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError) as e:  # a sandbox without setpriority: normal priority
        log.debug("background prefill thread keeps its priority: %s", e)


def background_executor() -> ThreadPoolExecutor:
    """The process-wide single low-priority thread that runs background prefill chunks (the device
    idle under a cloud-to-the-end plan). Created on first use; its niceness is raised once (a thread
    cannot lower it again without privileges, so foreground work stays on the session's executor)."""
    global _background
    with _background_lock:
        if _background is None:
            _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-background",
                                             initializer=_lower_thread_priority)
        return _background


@dataclass
class TokenEvent:
    """One token as shown to the user. shown_at_ms: ms since the request started; index: position
    in the answer; source: 'cloud' or 'device'."""

    text: str
    token_id: int
    source: str
    shown_at_ms: float
    index: int


@dataclass
class GenerationResult:
    """The outcome of one generation.

    text: the joined texts of the `TokenEvent`s shown, byte for byte (control tokens such as EOS
    add no text but stay in `token_ids`; a character cut by `max_new_tokens` is dropped).

    mode: 'split' (cloud then device), 'device-only' or 'cloud-only'. ttft_ms / tpot_ms_*: as shown
    to the user (ms). stalls: gaps > 2x target TPOT. cloud_tokens / device_tokens: shown tokens by
    source. handoff_index: answer index of the first device token (None if no hand-off).
    cloud_streamed: tokens the cloud sent, including ones computed after the hand-off and dropped.
    device_prefill_ms: wall ms from the device's first prefill call to the hand-off (prompt +
    catch-up). device_prompt_tokens: prompt tokens the device prefilled (fewer with refinement).
    cloud_budget / budget_extensions / interval_ms: the settings used (see `device.settings`).
    fault: what went wrong, None when nothing did: 'cloud-unreachable', 'cloud-refused',
    'cloud-overloaded', 'connection-lost', 'cloud-error', 'cloud-stalled' or 'device-error' (see the
    module docstring); error: the message behind the fault.
    plan: what was planned before the request started: 'split', 'cloud-to-the-end' (the settings
    found the device cannot catch up within the answer), 'device-only' (asked for, or no cloud URL)
    or 'cloud-only' (asked for); plan_reason: why, in words. `mode` differs from `plan` without a
    fault when the answer ended before the device caught up ('cloud-only') or the device was ready
    before the first cloud token ('device-only').
    """

    text: str
    token_ids: list[int]
    mode: str
    ttft_ms: float
    tpot_ms_p50: float
    tpot_ms_max: float
    stalls: int
    cloud_tokens: int
    device_tokens: int
    handoff_index: int | None
    finish_reason: str = "length"
    prompt_ids: list[int] = field(default_factory=list)
    cloud_streamed: int = 0
    device_prefill_ms: float = 0.0
    device_prompt_tokens: int = 0
    cloud_budget: int | None = None
    budget_extensions: int = 0
    interval_ms: float = 0.0
    fault: str | None = None
    error: str | None = None
    plan: str = "split"
    plan_reason: str = ""
    device_cached_tokens: int = 0
    kv_imported_tokens: int = 0
    device_prompt_ms: float = 0.0
    cloud_cached_tokens: int = 0
    request_id: str = ""
    prefill_left_at_fault: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# GenerationResult, multi-turn and KV hand-off fields: device_cached_tokens: prompt tokens whose KV the
# device reused from the conversation's previous turn; kv_imported_tokens: prompt tokens whose KV came
# from the cloud (`Generate.kv_from`) instead of a device prefill; device_prompt_ms: wall ms of the
# device's prompt work (prefill of the uncached tokens, or waiting for and importing the KV), before
# the catch-up; cloud_cached_tokens: prompt tokens the cloud reused (its first `Token.cached_tokens`;
# 0 when the device answered before that token arrived: the cloud's `Done.cached_tokens` then has it);
# request_id: the id of the request on the wire (the cloud's logs and `Done` name it);
# prefill_left_at_fault: tokens (prompt + cloud tokens received) the device still had to prefill when the
# cloud fault came (None without a cloud fault, or after the hand-off); under the cloud-to-the-end plan the
# background prefill makes it less than the prompt.


@dataclass
class DeviceCache:
    """The device KV cache kept between the turns of a conversation: `kv` (the engine's cache) holds
    the K/V of `ids` (len(ids) == kv.length: the previous prompt and the answer tokens decoded)."""

    ids: list[int]
    kv: object


def takes_positions(engine) -> bool:
    """Whether `engine.prefill` takes `positions` (int64 RoPE positions of the new tokens, the KV
    cache staying contiguous), so a refined prompt can keep its original positions. A wrapper
    (`.engine`, e.g. `PacedEngine`) takes them only if the engine it wraps does."""
    try:
        own = "positions" in inspect.signature(engine.prefill).parameters
    except (TypeError, ValueError):
        return False
    inner = vars(engine).get("engine") if hasattr(engine, "__dict__") else None
    return own and (inner is None or takes_positions(inner))


def prefill_at(engine, ids: Sequence[int], kv, positions: Sequence[int] | None):
    """`engine.prefill(ids, kv)` with the new tokens at RoPE `positions` (len(ids) ints; None or
    empty: the engine's own contiguous count). Returns (logits float32 [vocab], kv)."""
    if not positions:
        return engine.prefill(ids, kv)
    return engine.prefill(ids, kv, positions=np.asarray(positions, dtype=np.int64))


@dataclass
class SplitOptions:
    """mode: one of MODES. target_tpot_ms: pace shown to the user. cloud_budget: most tokens the
    cloud may stream: 'auto' (the settings algorithm, `device.settings`, chooses it and the display
    interval from the device timing and the cloud estimates, and extends it during the request if
    needed), an int, or None (until the device takes over). connect_timeout_s: handshake bound.
    prefill_chunk: prompt tokens per device prefill call. refine: prompt refinement, None (off),
    'auto' (a keep ratio by prompt length from the measured table, `protocol.model.refine.choose_refine`)
    or a keep ratio in (0, 1] (used on prompts of at least `MIN_REFINE_TOKENS` tokens): the device
    prefills the system turn at once, then only the prompt tokens the cloud keeps (`RefinedPrompt`,
    sent right after the first token), at their original positions where its engine takes
    `positions`. progress_timeout_s: longest
    wait for the next frame from the cloud before the device takes over (s); None derives it per
    wait from the cloud estimates: `progress_floor_s + progress_factor x` the expected TTFT (before
    the first token) or TPOT (after it). kv_handoff: the cloud sends the uncached prompt's KV
    (`Generate.kv_from`) instead of the device prefilling it: 'auto' where the link is fast enough
    (`protocol.kvhandoff.kv_handoff_pays`: `link_bytes_per_s`, the measured link bandwidth in
    bytes/s, None = unknown = never; `kv_overhead_ms`, encode + decode + import), True always,
    False never."""

    mode: str = "split"
    target_tpot_ms: float = 50.0
    cloud_budget: int | None | str = "auto"
    connect_timeout_s: float = 5.0
    prefill_chunk: int = 256
    refine: float | str | None = None
    progress_timeout_s: float | None = None
    progress_floor_s: float = 3.0
    progress_factor: float = 5.0
    kv_handoff: bool | str = "auto"
    link_bytes_per_s: float | None = None
    kv_overhead_ms: float = 20.0

    def __post_init__(self):
        """Raises ValueError (`FieldError` for numbers, by `protocol.validate`) naming a bad field."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        check_refine(self.refine)
        if self.cloud_budget != "auto":
            self.cloud_budget = check("cloud_budget", self.cloud_budget, optional=True)
        for name in ("target_tpot_ms", "connect_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise FieldError(name, "a finite number > 0", v)
        self.prefill_chunk = check("max_new_tokens", self.prefill_chunk, "prefill_chunk")
        if self.progress_timeout_s is not None and not self.progress_timeout_s > 0:
            raise ValueError(f"progress_timeout_s must be > 0, got {self.progress_timeout_s}")
        if self.kv_handoff not in (True, False, "auto"):
            raise ValueError(f"kv_handoff must be True, False or 'auto', got {self.kv_handoff!r}")
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 (bytes/s), got {self.link_bytes_per_s}")

    def progress_timeout(self, cloud: "CloudEstimate", prompt_tokens: int, first: bool) -> float:
        """Seconds to wait for the next cloud frame (see the class docstring)."""
        if self.progress_timeout_s is not None:
            return self.progress_timeout_s
        expected_ms = cloud.ttft_ms(prompt_tokens) if first else cloud.tpot_ms
        return self.progress_floor_s + self.progress_factor * expected_ms / 1e3


@dataclass
class CloudEstimate:
    """Running estimates of the cloud as this device sees it (ms): TTFT = ttft_base_ms +
    prefill_ms_per_token * prompt tokens (round trip included), fitted by least squares over the
    last `window` requests (base and slope together), and TPOT by exponential averaging. The
    defaults, used until two prompt lengths were seen, are deliberately pessimistic."""

    ttft_base_ms: float = 150.0
    prefill_ms_per_token: float = 1.0
    tpot_ms: float = 40.0
    alpha: float = 0.5
    window: int = 32
    samples: list = field(default_factory=list)
    retry_at: float = 0.0  # time.monotonic() before which the cloud asked not to be called (OVERLOADED)

    def back_off(self, retry_after_ms: float | None) -> None:
        """Honour an OVERLOADED hint: no cloud for `retry_after_ms` (default 1 s, at most 10 min)."""
        ms = 1000.0 if retry_after_ms is None else min(max(retry_after_ms, 0.0), 600_000.0)
        self.retry_at = max(self.retry_at, time.monotonic() + ms / 1e3)

    def ttft_ms(self, prompt_tokens: int) -> float:
        return self.ttft_base_ms + self.prefill_ms_per_token * prompt_tokens

    def update(self, prompt_tokens: int, ttft_ms: float | None, tpot_ms: float | None) -> None:
        if ttft_ms is not None:
            self.samples = (self.samples + [(prompt_tokens, ttft_ms)])[-self.window:]
            xs = np.array([x for x, _ in self.samples], float)
            ys = np.array([y for _, y in self.samples], float)
            if np.ptp(xs) > 0:
                slope, base = np.polyfit(xs, ys, 1)
                self.prefill_ms_per_token, self.ttft_base_ms = max(0.0, slope), max(0.0, base)
            else:  # one prompt length so far: keep the slope, move the base
                self.ttft_base_ms = max(0.0, float(ys.mean()) - self.prefill_ms_per_token * xs[0])
        if tpot_ms is not None:
            self.tpot_ms += self.alpha * (tpot_ms - self.tpot_ms)


class SplitSession:
    """Runs one request across cloud and device.

    Args:
        engine: the device `OnnxEngine` (anything with prefill/decode/eos_id/context_length).
        tokenizer: for the text of each token (incremental UTF-8 safe decoding).
        cloud_url: ws:// URL of the cloud prefill service (None = device-only).
        fingerprint: sha256 of the model file, checked by the cloud at handshake.
        token: bearer token for the cloud, if it needs one.
        executor: the single thread that runs ONNX Runtime (shared by sessions of one client).
        device_timing: (prefill ms base, prefill ms per token, decode ms per token) of this device,
            for the settings algorithm (`cloud_budget='auto'`); None turns the algorithm off.
        cloud: the client's running cloud estimates, updated after the request.
        ssl: `ssl.SSLContext` used for a wss:// cloud (CA and verification chosen by the caller).
        link: a `device.link.CloudLink` whose websocket the request uses (kept open across the
            turns of a conversation); None opens one websocket for the request.

    After `run`, `cache` is the device KV cache to pass as `past` to the conversation's next turn.
    """

    def __init__(self, engine, tokenizer, cloud_url: str | None, fingerprint: str, token: str | None = None,
                 options: SplitOptions | None = None, executor: ThreadPoolExecutor | None = None,
                 device_timing: tuple[float, float, float] | None = None, cloud: CloudEstimate | None = None,
                 ssl=None, link=None):
        self.link, self.cache = link, None
        self.engine, self.tokenizer = engine, tokenizer
        self.ssl = ssl  # ssl.SSLContext for wss:// (None: the default context for wss, none for ws)
        self.cloud_url, self.fingerprint, self.token = cloud_url, fingerprint, token
        self.opt = options or SplitOptions()
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-model")
        self.device_timing, self.cloud = device_timing, cloud or CloudEstimate()

    async def run(self, prompt_ids: Sequence[int], params: SamplingParams,
                  on_token: Callable[[TokenEvent], None] | None = None,
                  past: DeviceCache | None = None) -> GenerationResult:
        """Generate the answer to `prompt_ids`; `on_token` is called for each token as it is shown.

        `past`: the device cache of the conversation's previous turn (`self.cache` after it): the
        device keeps the K/V of the longest common prefix of `past.ids` and the prompt (at most all
        prompt tokens but the last) and prefills only the rest; refinement is then off.

        Raises:
            PromptTooLongError: prompt + max_new_tokens exceed the model's context.
            RemoteError: the cloud refused the request itself (e.g. PROMPT_TOO_LONG) in cloud-only mode.
            ValueError: `params` sets logit_bias or logprobs (the split protocol does not carry them).
        """
        check_prompt(len(prompt_ids), params.max_new_tokens, self.engine.context_length)
        if params.logit_bias or params.logprobs is not None:  # not carried by the split protocol
            raise ValueError("logit_bias and logprobs are not supported by SplitSession "
                             "(use the cloud's OpenAI API for them)")
        run = _Run(self, list(prompt_ids), params, on_token, past)
        try:
            return await run.go()
        finally:
            self.cache = run.cache()


class _Run:
    """State of one request (see the module docstring for the three coroutines)."""

    def __init__(self, s: SplitSession, prompt: list[int], params: SamplingParams, on_token,
                 past: DeviceCache | None = None):
        self.s, self.prompt, self.params, self.on_token = s, prompt, params, on_token
        self.past = past if past is not None and past.kv is not None else None
        self.reused = min(common_prefix(self.past.ids, prompt), len(prompt) - 1) if self.past else 0
        self.kv = None  # the device cache after the last engine call (`_KeepKV`)
        self.kv_from: int | None = None  # Generate.kv_from: the cloud sends the KV of the prompt from there
        self.kv_parts: list[KVTransfer] = []
        self.got_kv = asyncio.Event()
        self.kv_imported = 0
        self.device_prompt_ms = 0.0
        self.cloud_cached = 0  # Token 0's cached_tokens
        self.waiting_kv = False  # the device worker waits for the cloud's KV (not working on its own)
        self.mode = s.opt.mode if s.cloud_url or s.opt.mode == "device-only" else "device-only"
        self.planned = self.mode  # 'cloud-to-the-end' once the settings find the device cannot catch up
        self.plan_reason = (f"asked for (mode {s.opt.mode!r})" if s.opt.mode != "split" else
                            "no cloud URL" if self.mode == "device-only" else
                            "the cloud streams until the device takes over" if s.opt.cloud_budget is None else
                            f"the cloud streams at most {s.opt.cloud_budget} tokens, then the device takes over"
                            if s.opt.cloud_budget != "auto" else "no device timing: the device takes over when ready")
        self.answer: list[int] = []
        self.source: list[str] = []
        self.ready_ms: list[float] = []
        self.handoff: int | None = None
        self.complete = False
        self.finish_reason = "length"
        self.changed = asyncio.Event()
        self.cloud_streamed = 0
        self.cloud_done: Done | None = None
        self.fault: str | None = None
        self.error: str | None = None
        self.device_prefill_ms = 0.0
        self.device_prompt_tokens = len(prompt) - self.reused  # fewer once a refined prompt is used
        self.channel = None
        self.budget: int | None = None
        self.auto = False
        self.device_idle = False
        self.extended = 0
        self.device_prompt_est = len(prompt)
        self.refine_wanted = False
        self.kept: list[int] | None = None
        self.got_refined = asyncio.Event()
        self.request_id = uuid.uuid4().hex[:12]
        self.speed = SpeedController(s.opt.target_tpot_ms)
        self.decoder = s.tokenizer.stream_decoder()
        self.events: list[TokenEvent] = []
        self.tasks: list[asyncio.Task] = []  # receiver and device worker (the display is awaited apart)
        self.device_task: asyncio.Task | None = None
        self.device_failed = False
        self.wake = asyncio.Event()  # a cloud token, a cloud fault or a re-plan: wakes a device held by the plan
        self.prompt_left = len(prompt) - self.reused  # prompt tokens the device has still to prefill
        self.covered = 0  # answer tokens the device has prefilled
        self.prefill_left_at_fault: int | None = None
        self.inflight = None  # the engine call running on a worker thread (concurrent.futures.Future)
        self.kv_unsafe = False  # an engine call outlived the request: its cache is not handed on

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def append(self, tok: int, source: str) -> None:
        """Commit answer token `len(answer)`; mark the answer complete on a stop token or length."""
        self.answer.append(tok)
        self.source.append(source)
        self.ready_ms.append(self.now())
        reason = finish_reason(tok, len(self.answer), self.params, self.s.engine.eos_id)
        if reason:
            self.complete, self.finish_reason = True, reason
        self.changed.set()
        self.wake.set()

    def timing(self, start_ms: float = 0.0, ttft_ms: float | None = None, tpot_ms: float | None = None) -> Timing:
        a, b, d = self.s.device_timing
        c = self.s.cloud
        return Timing(a, b, d, ttft_ms if ttft_ms is not None else c.ttft_ms(len(self.prompt)),
                      tpot_ms if tpot_ms is not None else c.tpot_ms, start_ms)

    def plan(self) -> None:
        """Initial settings: cloud budget and display interval (settings algorithm)."""
        opt = self.s.opt
        self.budget = opt.cloud_budget if opt.cloud_budget != "auto" else None
        self.auto = opt.cloud_budget == "auto" and self.s.device_timing is not None and self.mode == "split"
        if not self.auto:
            return
        n = len(self.prompt) - self.reused  # multi-turn: only the uncached tokens cost device prefill
        refine = choose_refine(n, opt.refine) if not self.reused and self.kv_from is None else None
        self.device_prompt_est = max(1, int(n * refine)) if refine else n
        t = self.timing()
        if self.kv_from is not None:  # the KV hand-off: after the first token and the transfer, 1 token to prefill
            self.device_prompt_est = 1
            t = self.timing(start_ms=t.cloud_ttft_ms + self.kv_transfer_ms())
        if refine:  # the refined prompt comes right after the first cloud token
            t = self.timing(start_ms=t.cloud_ttft_ms)
        st = choose_settings(t, self.device_prompt_est, self.params.max_new_tokens, opt.target_tpot_ms)
        self.speed.interval_ms = st.interval_ms
        self.budget = st.cloud_budget
        self.device_idle = st.cloud_budget is None  # cannot catch up: the cloud streams to the end
        if self.device_idle:
            self.planned = "cloud-to-the-end"
            self.plan_reason = (
                f"the device cannot catch up: its prefill takes {t.prefill_ms_per_token:.0f} ms a token, not less "
                f"than the {st.interval_ms:.0f} ms display interval" if t.prefill_ms_per_token >= st.interval_ms else
                f"the device cannot catch up within {self.params.max_new_tokens} tokens (prompt of "
                f"{self.device_prompt_est} tokens: about {t.prefill_ms_base + t.prefill_ms_per_token * self.device_prompt_est:.0f} ms "
                f"to prefill on the device)")
        else:
            self.plan_reason = (f"the cloud streams at most {st.cloud_budget} tokens, then the device takes over "
                                f"(settings: display interval {st.interval_ms:.0f} ms)")

    async def replan(self, prompt_left: int) -> None:
        """Re-plan from now with `prompt_left` prompt tokens still to prefill and the measured cloud
        TTFT/TPOT; extend the cloud budget if more tokens are needed (and it is not too late)."""
        if (not self.auto or self.budget is None or self.channel is None or not self.ready_ms
                or self.cloud_done is not None or self.handoff is not None):
            return
        tpot = tpot_from_arrivals(self.ready_ms)
        st = choose_settings(self.timing(self.now(), self.ready_ms[0], tpot), prompt_left,
                             self.params.max_new_tokens, self.s.opt.target_tpot_ms, margin=0.1)
        want = st.cloud_budget if st.cloud_budget is not None else self.params.max_new_tokens
        if want > self.budget:
            self.budget = want
            self.extended += 1
            await self.send_quietly(ExtendBudget(self.request_id, want))

    def replan_idle(self, force: bool = False) -> None:
        """While a cloud-to-the-end plan keeps the device idle (prefilling in the background), re-plan
        after cloud tokens 1, 2, 4, 8, ... (and, `force`, when the background prompt prefill is
        done) with the measured cloud TTFT and TPOT, the device going on now with the prompt tokens it
        has left: if a hand-off has become feasible (the cloud is slower than estimated, or the prompt
        is prefilled), release the device to take over when it catches up (the cloud keeps streaming
        to the end until the device's Stop)."""
        k = len(self.ready_ms)
        if (not self.auto or not self.device_idle or self.complete or self.channel is None or not k
                or (k & (k - 1) and not force)):
            return
        tpot = tpot_from_arrivals(self.ready_ms)
        st = choose_settings(self.timing(self.now(), self.ready_ms[0], tpot),
                             min(self.device_prompt_est, self.prompt_left),
                             self.params.max_new_tokens, self.s.opt.target_tpot_ms)
        if st.cloud_budget is None:
            return
        self.device_idle = False
        self.speed.interval_ms = max(self.speed.interval_ms, st.interval_ms)
        self.plan_reason += (f"; re-planned after {k} cloud token{'s' * (k > 1)} (measured TTFT "
                             f"{self.ready_ms[0]:.0f} ms, TPOT {tpot or 0:.0f} ms, {self.prompt_left} prompt tokens "
                             f"left to prefill): the device takes over when it catches up")
        self.wake.set()
        self.start_device()

    def prefill_left(self) -> int:
        """Tokens the device has still to prefill before it can take over: the prompt tokens left
        and the cloud tokens received that it has not prefilled (tokens)."""
        return self.prompt_left + len(self.answer) - self.covered

    def release_device(self) -> None:
        """The cloud will not finish the answer (fault, or its stream ended): a device held by the
        cloud-to-the-end plan goes on at full priority and takes over; one not yet running starts."""
        self.device_idle = False
        self.wake.set()
        self.start_device()

    def kv_bpt(self) -> int:
        """KV bytes per token on the wire (fp16) for the device model."""
        c = self.s.engine.cfg
        return kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)

    def kv_transfer_ms(self) -> float:
        """Expected ms from the cloud's first token to the imported KV: bytes over the measured link
        (`SplitOptions.link_bytes_per_s`; none known: only the overhead) plus `kv_overhead_ms`."""
        opt, n = self.s.opt, len(self.prompt) - 1 - self.reused
        return (n * self.kv_bpt() / opt.link_bytes_per_s * 1e3 if opt.link_bytes_per_s else 0.0) + opt.kv_overhead_ms

    def choose_kv(self) -> int | None:
        """`Generate.kv_from` (the first prompt token whose KV the cloud sends) or None (the device
        prefills). Only in split mode, without refinement, with an engine that imports KV; with
        kv_handoff 'auto' only where `protocol.kvhandoff.kv_handoff_pays` (measured link bandwidth,
        device prefill fit, expected cloud TTFT); True always, False never."""
        s, opt = self.s, self.s.opt
        n = len(self.prompt) - 1 - self.reused  # tokens to send: all uncached prompt tokens but the last
        if (opt.kv_handoff is False or self.mode != "split" or n <= 0 or not hasattr(s.engine, "kv_import")
                or (not self.reused and choose_refine(len(self.prompt), opt.refine) is not None)):
            return None
        if opt.kv_handoff is True:
            return self.reused
        if s.device_timing is None:
            return None
        a, b, _ = s.device_timing
        pays = kv_handoff_pays(n, self.kv_bpt(), opt.link_bytes_per_s, s.cloud.ttft_ms(n + 1), a, b, opt.kv_overhead_ms)
        return self.reused if pays else None

    def cache(self) -> DeviceCache | None:
        """The device cache after this request, for the next turn: the last KV the engine returned
        and the ids it holds; the previous turn's cache when the device never ran; None after a
        refined (gapped) prompt."""
        if self.kv_unsafe:
            return None  # an engine call may still write into these buffers
        if self.kv is None:
            return self.past
        length = getattr(self.kv, "length", None)  # an engine whose cache has no length is not reused
        if self.refine_wanted or length is None:
            return None
        return DeviceCache((self.prompt + self.answer)[:length], self.kv)

    async def go(self) -> GenerationResult:
        self.t0 = time.perf_counter()
        self.kv_from = self.choose_kv()
        self.plan()
        if self.mode != "device-only":
            await self.connect()
        display = asyncio.create_task(self.display())
        if self.channel is not None:
            self.tasks.append(asyncio.create_task(self.receive()))
        if self.channel is None:
            self.device_idle = False  # no cloud: nothing to hold the device for
        if self.mode != "cloud-only":  # held in the background while a cloud-to-the-end plan keeps it idle
            self.start_device()
        try:
            await display  # the display ends when the answer is complete and shown
        finally:
            display.cancel()
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(display, *self.tasks, return_exceptions=True)
            await self.settle()
            if self.channel is not None:
                await self.close_channel()
        return self.result()

    async def settle(self) -> None:
        """Wait for the engine call still running on a worker thread (a chunk the answer's end
        interrupted), at most INFLIGHT_WAIT_S: its writes into the KV buffers must end before the
        cache goes to the next turn. Past the bound the cache is not handed on."""
        f = self.inflight
        if f is None or f.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(f)), INFLIGHT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("request %s: a device engine call outlived the request by %.0f s; its cache is dropped",
                        self.request_id, INFLIGHT_WAIT_S)
            self.kv_unsafe = True
        except Exception:  # the call failed: the request has ended anyway
            pass

    async def call(self, fn, *args):
        """Run an engine call on the device thread: the low-priority background one while the plan
        keeps the device idle, else the session's executor. The call is noted (`settle`)."""
        ex = background_executor() if self.device_idle else self.s.executor
        self.inflight = ex.submit(fn, *args)
        return await asyncio.wrap_future(self.inflight)

    def start_device(self) -> None:
        """Run the device worker (once)."""
        if self.device_task is None:
            self.device_task = asyncio.create_task(self.device())
            self.tasks.append(self.device_task)

    async def send_quietly(self, msg) -> bool:
        """Best-effort send to the cloud, bounded by SEND_TIMEOUT_S; False if it did not go."""
        try:
            await asyncio.wait_for(self.channel.send(msg), SEND_TIMEOUT_S)
            return True
        except (RelayInferError, asyncio.TimeoutError, OSError):
            return False

    async def close_channel(self) -> None:
        if self.s.link is not None:  # the conversation's websocket stays open unless this request failed on it
            self.s.link.release(self.request_id, broken=self.fault is not None and self.fault != "device-error")
            return
        try:  # a black-holed peer never answers the close handshake: bounded
            await asyncio.wait_for(self.channel.close(), SEND_TIMEOUT_S)
        except (RelayInferError, asyncio.TimeoutError, OSError):
            self.channel.ws.transport.abort() if getattr(self.channel.ws, "transport", None) else None

    def cloud_fault(self, fault: str, error: str) -> None:
        """The cloud stream ended early (lost, refused, stalled): record why, and finish the answer
        on the device from the tokens received; without a usable device (cloud-only mode, device
        runtime failed) end it with the tokens received."""
        if self.complete or self.handoff is not None:
            return  # the device already took over: the cloud is no longer needed
        self.fault, self.error = self.fault or fault, self.error or error
        log.info("request %s: cloud %s (%s); %s", self.request_id, fault, error,
                 "ending with the tokens received" if self.mode == "cloud-only" or self.device_failed
                 else "the device takes over")
        if self.mode == "cloud-only" or self.device_failed:
            self.complete, self.finish_reason = True, "error"
            self.changed.set()
        else:
            if self.prefill_left_at_fault is None:
                self.prefill_left_at_fault = self.prefill_left()
            self.release_device()

    async def connect(self) -> None:
        """Handshake and send Generate; on failure fall back to device-only (split) or raise."""
        s = self.s
        try:
            wait_ms = (s.cloud.retry_at - time.monotonic()) * 1e3
            if wait_ms > 0:  # the cloud said OVERLOADED: honour its retry-after hint
                raise RemoteError(ErrorCode.OVERLOADED, f"the cloud asked to retry after {wait_ms:.0f} more ms",
                                  retry_after_ms=wait_ms)
            if s.link is not None:  # the conversation's websocket, opened once
                self.channel = await s.link.request(self.request_id)
            else:
                self.channel = await proto_ws.open_channel(s.cloud_url, s.fingerprint, s.token,
                                                           client="relayinfer-device",
                                                           open_timeout=s.opt.connect_timeout_s,
                                                           **({"ssl": s.ssl} if s.ssl is not None else {}))
            budget = self.budget if self.mode == "split" else None
            p = self.params
            refine = (choose_refine(len(self.prompt), s.opt.refine)
                      if self.mode == "split" and not self.reused and self.kv_from is None else None)
            await self.channel.send(Generate(self.request_id, self.prompt, p.max_new_tokens, p.temperature, p.top_p,
                                             p.top_k, p.seed, budget, refine, list(p.stop_ids),
                                             presence_penalty=p.presence_penalty,
                                             frequency_penalty=p.frequency_penalty,
                                             repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
                                             kv_from=self.kv_from))
            self.refine_wanted = refine is not None
        except Exception as e:  # unreachable (OSError, TimeoutError), refused (RemoteError), ...
            overloaded = isinstance(e, RemoteError) and e.code is ErrorCode.OVERLOADED
            if overloaded and wait_ms <= 0:
                s.cloud.back_off(e.retry_after_ms)
            if self.mode == "cloud-only":
                raise
            self.fault = ("cloud-overloaded" if overloaded else
                          "cloud-refused" if isinstance(e, RelayInferError) else "cloud-unreachable")
            self.error = f"{type(e).__name__}: {e}"
            if self.channel is not None:
                await self.close_channel()
            self.mode, self.channel, self.kv_from = "device-only", None, None  # no cloud: no KV to wait for

    async def receive(self) -> None:
        """Cloud tokens into the answer until the hand-off. Every way the stream can end early
        (connection lost, request Error, Done before the answer is complete, no frame within the
        progress timeout) goes to `cloud_fault`, so the answer always completes."""
        try:
            while True:
                timeout = self.s.opt.progress_timeout(self.s.cloud, len(self.prompt), first=not self.cloud_streamed)
                try:
                    msg = await asyncio.wait_for(self.channel.recv(), timeout)
                except asyncio.TimeoutError:
                    if (self.device_task is not None and not self.device_task.done() and not self.waiting_kv
                            and not self.device_idle):
                        continue  # the device is working towards a hand-off without the cloud: no harm yet
                    self.cloud_fault("cloud-stalled", f"no frame from the cloud for {timeout:.1f} s")
                    await self.send_quietly(Cancel(self.request_id))
                    return
                if isinstance(msg, Token) and msg.request_id == self.request_id:
                    self.cloud_streamed += 1
                    if msg.index == 0:
                        self.cloud_cached = msg.cached_tokens
                    if self.handoff is None and not self.complete and msg.index == len(self.answer):
                        self.append(msg.token_id, "cloud")
                        self.replan_idle()
                elif isinstance(msg, KVTransfer) and msg.request_id == self.request_id:
                    self.kv_parts.append(msg)
                    if len(self.kv_parts) >= (msg.num_blocks if msg.block_index >= 0 else 1):
                        self.got_kv.set()
                elif isinstance(msg, RefinedPrompt) and msg.request_id == self.request_id:
                    n = len(self.prompt)
                    if msg.kept_indices and all(0 <= i < n for i in msg.kept_indices):
                        self.kept = sorted(set(msg.kept_indices))
                    self.got_refined.set()
                elif isinstance(msg, Done) and msg.request_id == self.request_id:
                    self.cloud_done = msg
                    if not self.complete and self.handoff is None:
                        if msg.reason == "budget" and self.mode == "split" and not self.device_failed:
                            self.release_device()  # as planned: the device takes over from here
                        elif self.mode == "cloud-only" and msg.reason in ("eos", "stop", "length"):
                            self.complete, self.finish_reason = True, msg.reason
                            self.changed.set()
                        else:  # cancelled or stopped by the cloud itself (e.g. shutting down)
                            self.cloud_fault("cloud-error", f"the cloud ended the stream early ({msg.reason})")
                    return
                elif isinstance(msg, Error) and msg.request_id == self.request_id:
                    overloaded = msg.code == ErrorCode.OVERLOADED.value
                    if overloaded:
                        self.s.cloud.back_off(msg.retry_after_ms)
                    self.cloud_fault("cloud-overloaded" if overloaded else "cloud-error",
                                     f"cloud error [{msg.code}]: {msg.message}")
                    return
        except RelayInferError as e:  # connection lost, connection-level Error, protocol violation
            if isinstance(e, RemoteError) and e.code is ErrorCode.OVERLOADED:
                self.s.cloud.back_off(e.retry_after_ms)
            self.cloud_fault("connection-lost", str(e))
        except (OSError, ValueError) as e:  # transport failures outside the protocol layer
            self.cloud_fault("connection-lost", f"{type(e).__name__}: {e}")
        finally:
            self.got_refined.set()  # nothing more will come: the device uses the full prompt
            self.got_kv.set()  # nor a KV hand-off: the device prefills
            if self.device_idle and not self.complete and self.mode == "split" and not self.device_failed:
                self.release_device()  # no more cloud tokens: a device held by the plan takes over

    async def device(self) -> None:
        """The device worker; a runtime failure hands the answer back to the cloud if it can."""
        try:
            await self._device()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request %s: device runtime failed", self.request_id)
            self.device_failed = True
            self.fault, self.error = self.fault or "device-error", self.error or f"device runtime failed: {e}"
            cloud_alive = self.channel is not None and self.handoff is None and self.cloud_done is None and \
                any(not t.done() for t in self.tasks if t is not self.device_task)
            if cloud_alive and self.mode == "split":  # the cloud streams to the end
                self.budget = self.params.max_new_tokens
                if await self.send_quietly(ExtendBudget(self.request_id, self.budget)):
                    return
            if not self.complete:
                self.complete, self.finish_reason = True, "error"
                self.changed.set()

    async def _device(self) -> None:
        """Prefill prompt, catch up on cloud tokens, hand off, decode locally. While the plan keeps
        the device idle (`device_idle`) the prefill runs in small low-priority chunks and the worker
        holds instead of handing off, until `release_device` or `replan_idle` lets it go."""
        eng, call = _KeepKV(self.s.engine, self), self.call
        kv, chunk = None, self.s.opt.prefill_chunk
        t = time.perf_counter()
        prompt = self.prompt
        at = None  # RoPE positions of `prompt` (None: the engine's contiguous count)
        if self.reused:  # multi-turn: the previous turn's cache holds the first `reused` prompt tokens
            kv = self.past.kv if self.past.kv.length == self.reused else \
                await call(eng.truncate, self.past.kv, self.reused)
            prompt = prompt[self.reused:]
        if self.kv_from is not None:  # the cloud sends the KV of the rest but the last token
            kv, prompt = await self.import_kv(kv, prompt)
        if self.refine_wanted:  # the system turn is always kept: prefill it while the cloud scores
            head = system_prefix_len(prompt, TemplateMarkers.from_tokenizer(self.s.tokenizer))
            if head:
                logits, kv = await call(eng.prefill, prompt[:head], kv)
            await self.got_refined.wait()
            if self.kept is not None and self.kept[:head] == list(range(head)):
                prompt = [self.prompt[i] for i in self.kept]
                at = self.kept[head:] if takes_positions(eng) else None  # the kept tokens' own positions
            prompt = prompt[head:]
            await self.replan(len(prompt))
            self.device_prompt_tokens = head + len(prompt)
        i, self.prompt_left = 0, len(prompt)
        while i < len(prompt):
            if self.complete:
                return  # the cloud finished the answer first
            step = min(chunk, BACKGROUND_CHUNK) if self.device_idle else chunk
            logits, kv = await call(prefill_at, eng, prompt[i:i + step], kv, at and at[i:i + step])
            i += step
            self.prompt_left = max(0, len(prompt) - i)
        self.device_prompt_ms = (time.perf_counter() - t) * 1e3
        base = len(self.prompt) if at is not None else None  # answer token k at position n + k after a gapped prompt
        await self.replan(0)
        self.replan_idle(force=True)  # the prompt is prefilled: a hand-off may have become feasible
        rule = CatchUp()  # catch up: prefill every cloud token received so far in one batch
        while True:
            if self.complete:
                return  # the cloud finished the answer first
            batch = rule.next_batch(len(self.answer))
            if batch is None:
                if not self.device_idle:
                    break
                self.wake.clear()  # held by the plan: wait for a cloud token, a fault or a re-plan
                await self.wake.wait()
                continue
            lo, n = batch
            if self.device_idle:
                n = min(n, lo + BACKGROUND_CHUNK)
            logits, kv = await call(prefill_at, eng, self.answer[lo:n], kv,
                                    None if base is None else list(range(base + lo, base + n)))
            rule.prefilled(n)
            self.covered = n
        covered = rule.covered
        self.device_prefill_ms = (time.perf_counter() - t) * 1e3
        self.handoff = covered  # atomic with the check above: no await in between
        if self.auto:  # from now on only the device's pace matters
            self.speed.interval_ms = max(self.s.opt.target_tpot_ms, self.s.device_timing[2])
        if self.channel is not None and self.fault is None and self.cloud_done is None:
            await self.send_quietly(Stop(self.request_id, covered))  # connection gone: nothing to stop
        for i in range(covered, self.params.max_new_tokens):
            tok = sample(logits, self.params, i, self.prompt + self.answer, len(self.prompt), self.s.engine.eos_id)
            self.append(tok, "device")
            if self.complete:
                return
            if base is None:
                logits, kv = await call(eng.decode, tok, kv)
            else:
                logits, kv = await call(prefill_at, eng, [tok], kv, [base + i])

    async def import_kv(self, kv, prompt: list[int]):
        """Wait for the cloud's KV of `prompt[:-1]` and import it after `kv`: returns (kv, [last
        prompt token]). The wait is bounded by the receiver's progress timeout (a cloud that sends no
        frame for that long is a stalled cloud, which ends the stream). When the KV does not come
        (cloud fault, the stream ended without it, a malformed transfer) returns (kv, prompt)
        unchanged: the device prefills."""
        eng = self.s.engine
        self.waiting_kv = True  # the receiver's progress timeout now applies: a stalled cloud ends the wait
        try:
            await self.got_kv.wait()  # set by the last KV part, or when the cloud stream ends
        finally:
            self.waiting_kv = False
        if not self.kv_parts:
            log.info("request %s: the cloud sent no KV (%s); the device prefills", self.request_id, self.error)
            return kv, prompt
        try:
            start, layers = kv_layers(self.kv_parts)
            n = len(prompt) - 1
            if start != self.reused or layers[0][0].shape[2] != n:
                raise ValueError(f"KV of {layers[0][0].shape[2]} tokens from {start}, expected {n} from {self.reused}")

            def merge():
                old = eng.kv_export(kv) if kv is not None and kv.length else None
                full = layers if old is None else [(np.concatenate([ok, k], axis=2), np.concatenate([ov, v], axis=2))
                                                   for (ok, ov), (k, v) in zip(old, layers)]
                return eng.kv_import(full, self.reused + n)

            kv = await self.call(merge)
        except ValueError as e:
            log.warning("request %s: bad KV hand-off (%s); the device prefills", self.request_id, e)
            return kv, prompt
        finally:
            self.kv_parts = []  # the arrays are imported (copied): free the frames
        self.kv_imported, self.device_prompt_tokens = n, 1
        return kv, prompt[-1:]

    async def display(self) -> None:
        """Show answer tokens in order, paced by the speed controller."""
        k = 0
        while True:
            while k >= len(self.answer):
                if self.complete:
                    return
                self.changed.clear()
                await self.changed.wait()
            at = self.speed.release_at(self.ready_ms[k])
            delay = (at - self.now()) / 1e3
            if delay > 0:
                await asyncio.sleep(delay)
            t = self.now()
            self.speed.shown(t)
            ev = TokenEvent(self.decoder.push(self.answer[k]), self.answer[k], self.source[k], t, k)
            self.events.append(ev)
            if self.on_token is not None:
                self.on_token(ev)
            k += 1

    def learn(self) -> None:
        """Update the client's cloud estimates from this request's arrivals."""
        cloud = [t for t, src in zip(self.ready_ms, self.source) if src == "cloud"]
        if cloud:
            self.s.cloud.update(len(self.prompt), cloud[0], tpot_from_arrivals(cloud))

    def result(self) -> GenerationResult:
        self.learn()
        mode = self.mode
        if mode == "split" and self.handoff is None:
            mode = "cloud-only"  # the cloud streamed the whole answer (planned, or it ended first): no fault
        if mode == "split" and self.handoff == 0:
            mode = "device-only"  # the device was ready before the first cloud token arrived
        cloud = sum(1 for src in self.source if src == "cloud")
        return GenerationResult(
            # the shown text, byte for byte: control tokens add none, a cut last character is dropped
            text="".join(ev.text for ev in self.events), token_ids=list(self.answer), mode=mode,
            **self.speed.stats(0.0), cloud_tokens=cloud, device_tokens=len(self.answer) - cloud,
            handoff_index=self.handoff if cloud and len(self.answer) > cloud else None,
            finish_reason=self.finish_reason, prompt_ids=self.prompt, cloud_streamed=self.cloud_streamed,
            device_prefill_ms=self.device_prefill_ms, device_prompt_tokens=self.device_prompt_tokens,
            cloud_budget=self.budget, budget_extensions=self.extended, interval_ms=self.speed.interval_ms, fault=self.fault, error=self.error,
            plan=self.planned, plan_reason=self.plan_reason, device_cached_tokens=self.reused,
            kv_imported_tokens=self.kv_imported, device_prompt_ms=self.device_prompt_ms,
            cloud_cached_tokens=self.cloud_cached, request_id=self.request_id,
            prefill_left_at_fault=self.prefill_left_at_fault)


class _KeepKV:
    """The device engine, noting on the run the cache each prefill/decode returns (the run's last
    KV is the next turn's `DeviceCache`). Same interface as the engine it wraps."""

    def __init__(self, engine, run: _Run):
        self.engine, self._run = engine, run

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, ids, kv=None, positions=None):
        out = self.engine.prefill(ids, kv) if positions is None else self.engine.prefill(ids, kv, positions=positions)
        self._run.kv = out[1]
        return out

    def decode(self, token_id, kv):
        out = self.engine.decode(token_id, kv)
        self._run.kv = out[1]
        return out
