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

from relayinfer.protocol.model.decoding import SamplingParams, check_prompt, finish_reason, generate_message, sample
from relayinfer.protocol.model.grammar import Guide, new_guide_async
from relayinfer.protocol.errors import ErrorCode, RelayInferError, RemoteError
from relayinfer.protocol.kvhandoff import (KV_RATE_SHARE, KV_WIRES, common_prefix, kv_handoff_ms, kv_handoff_pays,
                                           kv_layers, wire_bytes_per_token)
from relayinfer.protocol.messages import (Cancel, Done, Error, ExtendBudget, Generate, KVTransfer, RefinedPrompt, Stop,
                                         Token)
from relayinfer.protocol.model.refine import TemplateMarkers, check_refine, choose_refine, system_prefix_len
from relayinfer.protocol.requests import RequestViolation
from relayinfer.protocol.validate import FieldError, check

from . import policy
from .link import CloudLink
from .policy import (SLOWEST_PACE, HOLD, Event, HandOff, Phase, Phases, PlanInput, Progress, catch_up_step,
                     device_pace)
from .settings import CatchUp, CloudEstimate, Timing
from .speed import SpeedController, source_floor, tpot_from_arrivals

MODES = ("split", "device-only", "cloud-only")
SEND_TIMEOUT_S = 1.0  # bound on a best-effort Stop/Cancel/ExtendBudget send (s)

BACKGROUND_NICE = 10  # niceness added to the background prefill thread (Linux: per thread)
INFLIGHT_WAIT_S = 10.0  # bound on waiting for an engine call in flight when the answer has ended (s)

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
    kv_wire: str | None = None
    device_prompt_ms: float = 0.0
    cloud_cached_tokens: int = 0
    request_id: str = ""
    prefill_left_at_fault: int | None = None
    ready_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    cloud_sent_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# GenerationResult, multi-turn and KV hand-off fields: device_cached_tokens: prompt tokens whose KV the
# device reused from the conversation's previous turn; kv_imported_tokens: prompt tokens whose KV came
# from the cloud (`Generate.kv_from`) instead of a device prefill; kv_wire: the format the KV was asked
# in ('float16' or 'int8', `SplitOptions.kv_wire`; None: no KV hand-off asked); device_prompt_ms: wall ms of the
# device's prompt work (prefill of the uncached tokens, or waiting for and importing the KV), before
# the catch-up; cloud_cached_tokens: prompt tokens the cloud reused (its first `Token.cached_tokens`;
# 0 when the device answered before that token arrived: the cloud's `Done.cached_tokens` then has it);
# request_id: the id of the request on the wire (the cloud's logs and `Done` name it); ready_ms: when each
# answer token was ready at the device (ms since the request started: a cloud token when it arrived, a
# device token when sampled), before the speed controller; late_ms: per shown token, how long after the
# release the speed controller had set it was shown (ms, >= 0: the display's own loop was busy or not
# scheduled; a token late for the cloud or the link is not late here: its release waits for its arrival);
# cloud_sent_ms: per cloud token of the answer (the first `cloud_tokens`), the cloud's own stamp
# (`Token.t_cloud_ms`: ms since the cloud received the Generate, when it handed the token to its
# websocket), so that a gap between two arrivals splits into the cloud's gap and the rest (the link, and
# the device's loop before it read the frame), whatever the two clocks' offset;
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
    False never; with a measured link the cloud sends the KV at `kv_rate_share` of it
    (`Generate.kv_rate`, default `protocol.kvhandoff.KV_RATE_SHARE`), so the answer's tokens are
    not queued behind it, and the plan counts the transfer at that rate. kv_wire: the KV's
    format on the wire (`Generate.kv_wire`): 'float16', 'int8' (per-token scales, 52 % of the
    bytes; the device then decodes from a KV quantized as `protocol.kvhandoff.quantize_int8`
    writes it) or 'auto' (float16 where a float16 hand-off pays, else int8 where that pays; with
    kv_handoff True: float16). max_tpot_ms: the
    slowest display interval the plan may choose so that the device catches up within the answer
    (ms/token, the speed controller slowing down; None: `SLOWEST_PACE` x target_tpot_ms); it bounds
    that choice only: a cloud slower than it is still shown at its own pace (the source floor)."""

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
    kv_wire: str = "auto"
    link_bytes_per_s: float | None = None
    kv_overhead_ms: float = 20.0
    kv_rate_share: float = KV_RATE_SHARE
    max_tpot_ms: float | None = None

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
        if self.kv_wire not in KV_WIRES + ("auto",):
            raise FieldError("kv_wire", f"one of {', '.join(KV_WIRES + ('auto',))}", self.kv_wire)
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 (bytes/s), got {self.link_bytes_per_s}")
        if not 0 < self.kv_rate_share <= 1:
            raise FieldError("kv_rate_share", "a number in (0, 1]", self.kv_rate_share)
        if self.max_tpot_ms is not None and not self.max_tpot_ms >= self.target_tpot_ms:
            raise FieldError("max_tpot_ms", f"a number >= target_tpot_ms ({self.target_tpot_ms})", self.max_tpot_ms)

    def kv_rate(self) -> float | None:
        """The rate a KV hand-off is asked to use (bytes/s, `Generate.kv_rate`): `kv_rate_share` x
        `link_bytes_per_s`; None without a measured link (the cloud then sends as fast as it can)."""
        return self.kv_rate_share * self.link_bytes_per_s if self.link_bytes_per_s else None

    def max_interval_ms(self) -> float:
        """The slowest display interval a plan may choose (ms/token; see `max_tpot_ms`)."""
        return self.max_tpot_ms if self.max_tpot_ms is not None else SLOWEST_PACE * self.target_tpot_ms

    def progress_timeout(self, cloud: "CloudEstimate", prompt_tokens: int, first: bool) -> float:
        """Seconds to wait for the next cloud frame (see the class docstring)."""
        if self.progress_timeout_s is not None:
            return self.progress_timeout_s
        expected_ms = cloud.ttft_ms(prompt_tokens) if first else cloud.tpot_ms
        return self.progress_floor_s + self.progress_factor * expected_ms / 1e3


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
            FieldError: `params` sets logprobs (the split protocol does not carry them).
        """
        check_prompt(len(prompt_ids), params.max_new_tokens, self.engine.context_length)
        if params.logprobs is not None:  # the device computes none, nor does the split protocol carry them
            raise FieldError("logprobs", "left out for a split request (the cloud's OpenAI HTTP API returns logprobs)",
                             params.logprobs)
        guide = await new_guide_async(params, self.tokenizer)  # compiled on a worker thread: other runs go on
        run = _Run(self, list(prompt_ids), params, on_token, past, guide)
        try:
            return await run.go()
        finally:
            self.cache = run.cache()



@dataclass
class _Answer:
    """The answer as committed, token by token: `ids`, each token's `source` ('cloud' or 'device')
    and `ready_ms` (ms since the request started, when it was committed); `cloud_sent_ms`: each cloud
    token's `Token.t_cloud_ms` (the cloud's clock); `finish_reason` once it
    ended; `events`: the tokens shown; `changed`: set on every commit and at the end (wakes the
    display)."""

    ids: list[int] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    ready_ms: list[float] = field(default_factory=list)
    cloud_sent_ms: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    events: list[TokenEvent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def cloud_arrivals(self) -> tuple[float, ...]:
        """The `ready_ms` of the cloud tokens (ms, ascending)."""
        return tuple(t for t, src in zip(self.ready_ms, self.source) if src == "cloud")


@dataclass
class _Cloud:
    """The cloud side of one request. link / channel: the `link.CloudLink` and the request's
    `link.RequestChannel` (None: no cloud); own_link: the link was opened for this request alone;
    streamed: Tokens received (tokens, those dropped after the hand-off included); done: its Done;
    cached: Token 0's cached_tokens; kv_from: `Generate.kv_from` (None: no KV hand-off); kv_parts /
    got_kv: the KVTransfer frames, set once all came or the stream ended; refine: the Generate asked
    for a refined prompt; kept / got_refined: the RefinedPrompt's indices (None: the full prompt),
    set once it came or the stream ended."""

    link: CloudLink | None = None
    channel: object = None
    own_link: bool = False
    streamed: int = 0
    done: Done | None = None
    cached: int = 0
    kv_from: int | None = None
    kv_wire: str = "float16"
    kv_parts: list[KVTransfer] = field(default_factory=list)
    kv_done_ms: float | None = None  # when the last KV piece came (ms since the request started)
    got_kv: asyncio.Event = field(default_factory=asyncio.Event)
    refine: bool = False
    kept: list[int] | None = None
    got_refined: asyncio.Event = field(default_factory=asyncio.Event)
    violated: bool = False  # the cloud broke the per-request rules (the connection is dropped)


@dataclass
class _Device:
    """The device side of one request. past / reused: the previous turn's cache and the prompt
    tokens it holds; kv: the cache after the last engine call (`_KeepKV`); task: the device
    worker; inflight: the engine call on a worker thread (`concurrent.futures.Future`); kv_unsafe:
    an engine call outlived the request (its cache is not handed on); prompt_left: prompt tokens
    still to prefill; covered: answer tokens prefilled; prompt_tokens: prompt tokens it prefilled
    (fewer with refinement or the KV hand-off); kv_imported: prompt tokens whose KV came from the
    cloud; prompt_ms / prefill_ms: wall ms of its prompt work / up to the hand-off; waiting_kv: it
    waits for the cloud's KV; following_cloud: the display still shows cloud tokens (the cloud
    floor applies, `speed.source_floor`) until the device decodes; wake: set by a cloud token, a fault or a re-plan (wakes a held worker);
    chunk_ms / chunk_tokens / chunk_calls: wall ms, tokens and calls of its prompt prefill chunks of
    more than one token so far (its measured prefill rate)."""

    past: DeviceCache | None
    reused: int
    prompt_left: int
    kv: object = None
    task: asyncio.Task | None = None
    inflight: object = None
    kv_unsafe: bool = False
    covered: int = 0
    prompt_tokens: int = 0
    kv_imported: int = 0
    prompt_ms: float = 0.0
    prefill_ms: float = 0.0
    waiting_kv: bool = False
    following_cloud: bool = True
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    chunk_ms: float = 0.0
    chunk_tokens: int = 0
    chunk_calls: int = 0


@dataclass
class _Plan:
    """What the request runs as and its cloud budget. mode: 'split', 'cloud-only' or 'device-only'
    (the cloud refused or unreachable: device-only); planned / reason: `GenerationResult.plan` /
    `plan_reason`; budget: the cloud budget (tokens; None: until the Stop); auto: the settings
    algorithm plans and re-plans; held: a cloud-to-the-end plan keeps the device idle (background
    prefill); extended: ExtendBudgets sent; prompt_est: prompt tokens the plan assumed."""

    mode: str
    planned: str
    reason: str
    budget: int | None = None
    auto: bool = False
    held: bool = False
    extended: int = 0
    prompt_est: int = 0


@dataclass
class _Fault:
    """What went wrong: `GenerationResult.fault` / `error` (the first fault wins) and
    `prefill_left_at_fault` (tokens the device still had to prefill when the cloud failed)."""

    kind: str | None = None
    error: str | None = None
    prefill_left: int | None = None

    def note(self, kind: str, error: str) -> None:
        """Record a fault unless one is recorded already."""
        self.kind, self.error = self.kind or kind, self.error or error


def _asked(opt: SplitOptions, mode: str) -> str:
    """`GenerationResult.plan_reason` before the settings algorithm runs."""
    if opt.mode != "split":
        return f"asked for (mode {opt.mode!r})"
    if mode == "device-only":
        return "no cloud URL"
    if opt.cloud_budget is None:
        return "the cloud streams until the device takes over"
    if opt.cloud_budget != "auto":
        return (f"a fixed cloud budget of {opt.cloud_budget} tokens, then the device takes over (the cloud "
                "streams the rest if the device fails)")
    return "no device timing: the device takes over when ready"


class _Run:
    """One request: the driver that moves events between the cloud channel, the device engine,
    the display and the policy (`device.policy`: the phase table and the decisions). Its three
    coroutines are `receive`, `device` and `display` (see the module docstring)."""

    def __init__(self, s: SplitSession, prompt: list[int], params: SamplingParams, on_token,
                 past: DeviceCache | None = None, guide: Guide | None = None):
        self.s, self.prompt, self.params, self.on_token = s, prompt, params, on_token
        # the grammar's state (None without one): fed the cloud's tokens before the device's first mask
        self.guide = guide
        past = past if past is not None and past.kv is not None else None
        reused = min(common_prefix(past.ids, prompt), len(prompt) - 1) if past else 0
        self.dev = _Device(past, reused, len(prompt) - reused, prompt_tokens=len(prompt) - reused)
        mode = s.opt.mode if s.cloud_url or s.opt.mode == "device-only" else "device-only"
        self.plan = _Plan(mode, mode, _asked(s.opt, mode), prompt_est=len(prompt))
        self.phases = Phases()
        self.planned: Timing | None = None  # the timing the last plan or re-plan used (`policy.moved`)
        self.answer, self.cloud, self.fault = _Answer(), _Cloud(), _Fault()
        self.request_id = uuid.uuid4().hex[:12]
        self.speed = SpeedController(s.opt.target_tpot_ms)
        self.decoder = s.tokenizer.stream_decoder()
        self.tasks: list[asyncio.Task] = []  # receiver and device worker (the display is awaited apart)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """ms since the request started."""
        return (time.perf_counter() - self.t0) * 1e3

    # -- the answer -----------------------------------------------------------------------------------

    def append(self, tok: int, source: str, reason: str | None = None) -> None:
        """Commit answer token `len(answer.ids)` from `source`; `reason` (the finish rule's verdict:
        a cloud token's `finish_reason`, or `decoding.finish_reason` for a device token) ends it."""
        a = self.answer
        a.ids.append(tok)
        a.source.append(source)
        a.ready_ms.append(self.now())
        if reason:
            self.end(reason)
        a.changed.set()
        self.dev.wake.set()

    def end(self, reason: str) -> None:
        """The answer is complete (`finish_reason` `reason`): the ANSWER_ENDED transition."""
        self.phases.fire(Event.ANSWER_ENDED)
        self._ended(reason)

    def _ended(self, reason: str) -> None:
        self.answer.finish_reason = reason
        self.answer.changed.set()
        self.dev.wake.set()

    # -- planning (decisions in `device.policy`) ------------------------------------------------------

    def timing(self) -> Timing:
        """The settings model's timing: the device fit and the client's cloud estimates (ms)."""
        a, b, d = self.s.device_timing
        c = self.s.cloud
        return Timing(a, b, d, c.ttft_ms(len(self.prompt)), c.tpot_ms)

    def progress(self, prompt_left: int) -> Progress:
        """What the device measured so far, with `prompt_left` prompt tokens still to prefill: the
        cloud arrivals and the device's prefill ms/token on its prompt chunks (their per-call base
        a taken out)."""
        d = self.dev
        rate = (max(0.0, d.chunk_ms - d.chunk_calls * self.s.device_timing[0]) / d.chunk_tokens
                if d.chunk_tokens and self.s.device_timing else None)
        return Progress(self.now(), self.answer.cloud_arrivals(), prompt_left, rate,
                        len(self.answer.ids) - d.covered if self.phases.phase is Phase.CATCHING_UP else None)

    def initial_plan(self) -> None:
        """Initial cloud budget and display interval (`policy.plan`)."""
        opt, pl = self.s.opt, self.plan
        pl.budget = opt.cloud_budget if opt.cloud_budget != "auto" else None
        pl.auto = opt.cloud_budget == "auto" and self.s.device_timing is not None and pl.mode == "split"
        if not pl.auto:
            return
        n = len(self.prompt) - self.dev.reused  # multi-turn: only the uncached tokens cost device prefill
        refine = choose_refine(n, opt.refine) if not self.dev.reused and self.cloud.kv_from is None else None
        kv_ms = self.kv_transfer_ms() if self.cloud.kv_from is not None else None
        p = policy.plan(PlanInput(self.timing(), n, self.params.max_new_tokens, opt.target_tpot_ms, refine, kv_ms,
                                  opt.max_interval_ms()))
        self.planned = self.timing()
        self.speed.interval_ms = p.interval_ms
        pl.budget, pl.held, pl.prompt_est, pl.reason = p.budget, p.held, p.device_prompt_tokens, p.reason
        if p.held:
            pl.planned = "cloud-to-the-end"

    async def revisit(self, chunk: bool = False) -> None:
        """Re-plan when a measured figure moved the plan (`policy.moved`: cloud TTFT/TPOT, device
        prefill ms/token) or, `chunk`, a prompt chunk is done: `replan_held` while the plan holds
        the device, else `replan`. Only before the hand-off, while the cloud streams."""
        pl = self.plan
        if (not pl.auto or self.phases.done or self.phases.handoff is not None or self.cloud.channel is None
                or self.cloud.done is not None or self.phases.phase not in (Phase.CLOUD_PACED, Phase.CATCHING_UP)):
            return
        now = self.progress(self.dev.prompt_left).measured(self.timing())
        if not chunk and self.planned is not None and not policy.moved(self.planned, now):
            return
        self.planned = now
        if pl.held:
            self.replan_held()
        elif self.phases.phase is Phase.CLOUD_PACED:  # during the catch-up the device is nearly there
            await self.replan(self.dev.prompt_left)

    async def replan(self, prompt_left: int) -> None:
        """Re-plan from now with `prompt_left` prompt tokens still to prefill (`policy.replan`);
        send ExtendBudget when more cloud tokens are needed; slow the display when the plan says."""
        pl = self.plan
        if (not pl.auto or pl.budget is None or self.cloud.channel is None or not self.answer.ready_ms
                or self.cloud.done is not None or self.phases.handoff is not None):
            return
        r = policy.replan(self.timing(), self.progress(prompt_left), pl.budget, self.params.max_new_tokens,
                          self.s.opt.target_tpot_ms, self.speed.interval_ms, self.s.opt.max_interval_ms())
        if r is None:
            return
        self.speed.interval_ms = max(self.speed.interval_ms, r.interval_ms)
        if r.budget > pl.budget:
            pl.budget, pl.extended = r.budget, pl.extended + 1
            await self.send_quietly(ExtendBudget(self.request_id, r.budget))

    def replan_held(self) -> None:
        """While a cloud-to-the-end plan holds the device, re-plan (`policy.replan_held`); when a
        hand-off has become feasible, release the device to take over once it catches up (the
        cloud keeps streaming until the device's Stop)."""
        pl = self.plan
        if not pl.auto or not pl.held or self.phases.done or self.cloud.channel is None:
            return
        interval = policy.replan_held(self.timing(), self.progress(self.dev.prompt_left), pl.prompt_est,
                                      self.params.max_new_tokens, self.s.opt.target_tpot_ms,
                                      self.s.opt.max_interval_ms())
        if interval is None:
            return
        self.speed.interval_ms = max(self.speed.interval_ms, interval)
        arr, k = self.answer.ready_ms, len(self.answer.ready_ms)
        pl.reason += (f"; re-planned after {k} cloud token{'s' * (k > 1)} (measured TTFT {arr[0]:.0f} ms, "
                      f"TPOT {tpot_from_arrivals(arr) or 0:.0f} ms, {self.dev.prompt_left} prompt tokens "
                      f"left to prefill): the device takes over when it catches up")
        self.release_device()

    def prefill_left(self) -> int:
        """Tokens the device has still to prefill before it can take over: the prompt tokens left
        and the cloud tokens received that it has not prefilled (tokens)."""
        return self.dev.prompt_left + len(self.answer.ids) - self.dev.covered

    def release_device(self) -> None:
        """A device held by the plan goes on at full priority and takes over; one not yet running
        starts."""
        self.plan.held = False
        self.dev.wake.set()
        self.start_device()

    def kv_bpt(self, wire: str | None = None) -> int:
        """KV bytes per token on the wire for the device model, in `wire` (default: the format
        this request asks for, `_Cloud.kv_wire`)."""
        c = self.s.engine.cfg
        return wire_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, wire or self.cloud.kv_wire)

    def kv_transfer_ms(self) -> float:
        """Expected ms from the cloud's first token to the imported KV: bytes at the rate the
        Generate asks for (`SplitOptions.kv_rate`; no measured link: only the overhead) plus
        `kv_overhead_ms`."""
        opt, n = self.s.opt, len(self.prompt) - 1 - self.dev.reused
        rate = self.kv_plan_rate()
        return (n * self.kv_bpt() / rate * 1e3 if rate else 0.0) + opt.kv_overhead_ms

    def kv_plan_rate(self) -> float | None:
        """The KV hand-off rate the plan counts on (bytes/s): the rate asked for
        (`SplitOptions.kv_rate`), or less where this client's earlier hand-offs came slower
        (`CloudEstimate.kv_bytes_per_s`: a busy cloud encodes and sends them at its own pace)."""
        asked, seen = self.s.opt.kv_rate(), self.s.cloud.kv_bytes_per_s
        return min(r for r in (asked, seen) if r) if asked or seen else None

    def choose_kv(self) -> int | None:
        """`Generate.kv_from` (the first prompt token whose KV the cloud sends) or None (the device
        prefills). Only in split mode, without refinement, with an engine that imports KV; with
        kv_handoff 'auto' only where `protocol.kvhandoff.kv_handoff_pays` (measured link bandwidth,
        device prefill fit, expected cloud TTFT) and the KV would arrive before the cloud could
        stream all `max_new_tokens` (expected TTFT + TPOT each), in the first format of
        `SplitOptions.kv_wire` for which both hold (sets `_Cloud.kv_wire`); True always, False
        never."""
        s, opt, reused = self.s, self.s.opt, self.dev.reused
        n = len(self.prompt) - 1 - reused  # tokens to send: all uncached prompt tokens but the last
        if (opt.kv_handoff is False or self.plan.mode != "split" or n <= 0 or not hasattr(s.engine, "kv_import")
                or (not reused and choose_refine(len(self.prompt), opt.refine) is not None)):
            return None
        wires = KV_WIRES if opt.kv_wire == "auto" else (opt.kv_wire,)
        if opt.kv_handoff is True:
            self.cloud.kv_wire = wires[0]
            return reused
        if s.device_timing is None:
            return None
        a, b, _ = s.device_timing
        rate, ttft = self.kv_plan_rate() if opt.kv_rate() else None, s.cloud.ttft_ms(n + 1)
        # an answer the cloud streams to its end before the KV could arrive: the transfer is waste
        answer_ms = ttft + (self.params.max_new_tokens - 1) * s.cloud.tpot_ms
        for wire in wires:
            bpt = self.kv_bpt(wire)
            if (kv_handoff_pays(n, bpt, rate, ttft, a, b, opt.kv_overhead_ms)
                    and kv_handoff_ms(n, bpt, rate, ttft, a, b, opt.kv_overhead_ms) < answer_ms):
                self.cloud.kv_wire = wire
                return reused
        return None

    def cache(self) -> DeviceCache | None:
        """The device cache after this request, for the next turn: the last KV the engine returned
        and the ids it holds; the previous turn's cache when the device never ran; None after a
        refined (gapped) prompt."""
        if self.dev.kv_unsafe:
            return None  # an engine call may still write into these buffers
        if self.dev.kv is None:
            return self.dev.past
        length = getattr(self.dev.kv, "length", None)  # an engine whose cache has no length is not reused
        if self.cloud.refine or length is None:
            return None
        return DeviceCache((self.prompt + self.answer.ids)[:length], self.dev.kv)

    # -- the request ----------------------------------------------------------------------------------

    async def go(self) -> GenerationResult:
        """Run the request to its end: connect, then receiver, device worker and display."""
        self.t0 = time.perf_counter()
        self.cloud.kv_from = self.choose_kv()
        self.initial_plan()
        if self.plan.mode != "device-only":
            await self.connect()
        else:
            self.phases.fire(Event.NO_CLOUD)
        display = asyncio.create_task(self.display())
        if self.cloud.channel is not None:
            self.tasks.append(asyncio.create_task(self.receive()))
        else:
            self.plan.held = False  # no cloud: nothing to hold the device for
        if self.plan.mode != "cloud-only":  # held in the background while a cloud-to-the-end plan keeps it idle
            self.start_device()
        try:
            await display  # the display ends when the answer is complete and shown
        finally:
            display.cancel()
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(display, *self.tasks, return_exceptions=True)
            await self.settle()
            if self.cloud.channel is not None:
                await self.close_channel()
        return self.result()

    async def settle(self) -> None:
        """Wait for the engine call still running on a worker thread (a chunk the answer's end
        interrupted), at most INFLIGHT_WAIT_S: its writes into the KV buffers must end before the
        cache goes to the next turn. Past the bound the cache is not handed on."""
        f = self.dev.inflight
        if f is None or f.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(f)), INFLIGHT_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("request %s: a device engine call outlived the request by %.0f s; its cache is dropped",
                        self.request_id, INFLIGHT_WAIT_S)
            self.dev.kv_unsafe = True
        except Exception:  # the call failed: the request has ended anyway
            pass

    async def call(self, fn, *args):
        """Run an engine call on the device thread: the low-priority background one while the plan
        holds the device, else the session's executor. The call is noted (`settle`)."""
        ex = background_executor() if self.plan.held else self.s.executor
        self.dev.inflight = ex.submit(fn, *args)
        return await asyncio.wrap_future(self.dev.inflight)

    def start_device(self) -> None:
        """Run the device worker (once)."""
        if self.dev.task is None:
            self.dev.task = asyncio.create_task(self.device())
            self.tasks.append(self.dev.task)

    async def send_quietly(self, msg) -> bool:
        """Best-effort send to the cloud, bounded by SEND_TIMEOUT_S; False if it did not go (or the
        request table ignored it: it crossed the cloud's Done)."""
        try:
            return await asyncio.wait_for(self.cloud.channel.send(msg), SEND_TIMEOUT_S)
        except (RelayInferError, asyncio.TimeoutError, OSError):
            return False

    async def close_channel(self) -> None:
        """Release the request's channel; a link opened for this request alone is closed (bounded)."""
        # a connection that failed, went silent or broke the rules is dropped; one that answered
        # this request with an Error (e.g. OVERLOADED) goes on serving the others on it
        broken = self.fault.kind in ("connection-lost", "cloud-stalled") or self.cloud.violated
        self.cloud.link.release(self.request_id, broken=broken)
        if self.cloud.own_link:
            await self.cloud.link.aclose()

    def cloud_fault(self, fault: str, error: str) -> None:
        """The cloud stream ended early (lost, refused, stalled): the CLOUD_FAULT transition. The
        device finishes the answer from the tokens received; with no device behind the cloud
        (CLOUD_ALONE) the answer ends with them (finish_reason 'error'). Ignored once the device
        took over or the answer ended."""
        before = self.phases.phase
        after = self.phases.fire(Event.CLOUD_FAULT)
        if after is before:
            return  # the device already took over (or a fault came before): the cloud is no longer needed
        self.fault.note(fault, error)
        log.info("request %s: cloud %s (%s); %s", self.request_id, fault, error,
                 "ending with the tokens received" if after is Phase.DONE else "the device takes over")
        if after is Phase.DONE:
            self._ended("error")
            return
        if self.fault.prefill_left is None:
            self.fault.prefill_left = self.prefill_left()
        self.release_device()

    async def connect(self) -> None:
        """Handshake and send Generate (START_SPLIT / START_CLOUD_ONLY); on failure fall back to
        device-only (NO_CLOUD) in split mode, or raise in cloud-only mode."""
        s, c = self.s, self.cloud
        wait_ms = (s.cloud.retry_at - time.monotonic()) * 1e3
        try:
            if wait_ms > 0:  # the cloud said OVERLOADED: honour its retry-after hint
                raise RemoteError(ErrorCode.OVERLOADED, f"the cloud asked to retry after {wait_ms:.0f} more ms",
                                  retry_after_ms=wait_ms)
            c.own_link = s.link is None
            c.link = s.link or CloudLink(s.cloud_url, s.fingerprint, s.token, s.ssl, s.opt.connect_timeout_s)
            g = self.generate_msg()
            c.channel = await c.link.request(self.request_id, first=g)  # sent again on a new connection if needed
            c.refine = g.refine is not None
        except Exception as e:  # unreachable (OSError, TimeoutError), refused (RemoteError), ...
            await self.connect_failed(e, wait_ms)
            return
        self.phases.fire(Event.START_SPLIT if self.plan.mode == "split" else Event.START_CLOUD_ONLY)

    def generate_msg(self) -> Generate:
        """The request's Generate: sampling params, the cloud budget and refinement (split mode),
        and `kv_from`."""
        split, p = self.plan.mode == "split", self.params
        refine = (choose_refine(len(self.prompt), self.s.opt.refine)
                  if split and not self.dev.reused and self.cloud.kv_from is None else None)
        return generate_message(self.request_id, self.prompt, p, cloud_budget=self.plan.budget if split else None,
                                refine=refine, kv_from=self.cloud.kv_from, kv_rate=self.s.opt.kv_rate(),
                                kv_wire=self.cloud.kv_wire)

    async def connect_failed(self, e: Exception, wait_ms: float) -> None:
        """The cloud refused or is unreachable: raise in cloud-only mode, else go device-only."""
        overloaded = isinstance(e, RemoteError) and e.code is ErrorCode.OVERLOADED
        if overloaded and wait_ms <= 0:
            self.s.cloud.back_off(e.retry_after_ms)
        if self.plan.mode == "cloud-only":
            if self.cloud.channel is not None:
                await self.close_channel()
            raise e
        self.fault.note("cloud-overloaded" if overloaded else
                        "cloud-refused" if isinstance(e, RelayInferError) else "cloud-unreachable",
                        f"{type(e).__name__}: {e}")
        if self.cloud.channel is not None:
            await self.close_channel()
        elif self.cloud.own_link and self.cloud.link is not None:
            await self.cloud.link.aclose()
        self.plan.mode, self.cloud.channel, self.cloud.kv_from = "device-only", None, None  # no KV to wait for
        self.phases.fire(Event.NO_CLOUD)

    # -- the receiver ---------------------------------------------------------------------------------

    async def receive(self) -> None:
        """Cloud events into the answer until the stream ends. Every way it can end early
        (connection lost, request Error, a protocol violation, Done before the answer is complete,
        no frame within the progress timeout) goes to `cloud_fault`, so the answer always completes."""
        try:
            while await self.receive_one():
                pass
        except RelayInferError as e:  # connection lost, connection-level Error, protocol violation
            if isinstance(e, RemoteError) and e.code is ErrorCode.OVERLOADED:
                self.s.cloud.back_off(e.retry_after_ms)
            self.cloud_fault("connection-lost", str(e))
        except (OSError, ValueError) as e:  # transport failures outside the protocol layer
            self.cloud_fault("connection-lost", f"{type(e).__name__}: {e}")
        finally:
            self.cloud.got_refined.set()  # nothing more will come: the device uses the full prompt
            self.cloud.got_kv.set()  # nor a KV hand-off: the device prefills
            if self.plan.held and self.phases.phase in (Phase.CLOUD_PACED, Phase.CATCHING_UP):
                self.release_device()  # no more cloud tokens: a device held by the plan takes over

    async def receive_one(self) -> bool:
        """Wait for the request's next event (bounded by the progress timeout) and apply it;
        False when the stream is over for this request."""
        timeout = self.s.opt.progress_timeout(self.s.cloud, len(self.prompt), first=not self.cloud.streamed)
        try:
            ev = await asyncio.wait_for(self.cloud.channel.recv(), timeout)
        except asyncio.TimeoutError:
            task = self.dev.task
            if not policy.stall_is_fault(task is not None and not task.done(), self.dev.waiting_kv, self.plan.held):
                return True  # the device is working towards a hand-off without the cloud: no harm yet
            self.cloud_fault("cloud-stalled", f"no frame from the cloud for {timeout:.1f} s")
            await self.send_quietly(Cancel(self.request_id))
            return False
        if isinstance(ev, RequestViolation):  # the cloud broke the per-request rules
            self.cloud.violated = True
            self.cloud_fault("cloud-error", f"protocol violation: {ev}")
            await self.send_quietly(Cancel(self.request_id))
            return False
        if ev.ignored:
            return True
        going = self.on_message(ev.message)
        if going and isinstance(ev.message, Token):
            await self.revisit()  # a measured cloud figure may have moved the plan
        return going

    def on_message(self, msg) -> bool:
        """Apply one legal cloud message of this request; False when it ends the stream."""
        if isinstance(msg, Token):
            self.cloud.streamed += 1
            if msg.index == 0:
                self.cloud.cached = msg.cached_tokens
            if self.phases.takes_cloud_tokens:  # the table checked the index: it is len(answer.ids)
                self.answer.cloud_sent_ms.append(msg.t_cloud_ms)
                self.append(msg.token_id, "cloud", msg.finish_reason)
        elif isinstance(msg, KVTransfer):
            self.cloud.kv_parts.append(msg)
            if len(self.cloud.kv_parts) >= (msg.num_blocks if msg.block_index >= 0 else 1):
                self.cloud.kv_done_ms = self.now()
                self.cloud.got_kv.set()
        elif isinstance(msg, RefinedPrompt):
            n = len(self.prompt)
            if msg.kept_indices and all(0 <= i < n for i in msg.kept_indices):
                self.cloud.kept = sorted(set(msg.kept_indices))
            self.cloud.got_refined.set()
        elif isinstance(msg, Done):
            self.on_done(msg)
            return False
        elif isinstance(msg, Error):
            overloaded = msg.code == ErrorCode.OVERLOADED.value
            if overloaded:
                self.s.cloud.back_off(msg.retry_after_ms)
            self.cloud_fault("cloud-overloaded" if overloaded else "cloud-error",
                             f"cloud error [{msg.code}]: {msg.message}")
            return False
        return True

    def on_done(self, msg: Done) -> None:
        """The cloud's Done, as `policy.on_done` reads it in the current phase."""
        self.cloud.done = msg
        what = policy.on_done(self.phases.phase, msg.reason)
        if what == "take-over":
            self.release_device()  # as planned: the device takes over from here
        elif what == "end":
            self.end(msg.reason)
        elif what == "fault":  # cancelled or stopped by the cloud itself (e.g. shutting down)
            self.cloud_fault("cloud-error", f"the cloud ended the stream early ({msg.reason})")

    # -- the device worker ----------------------------------------------------------------------------

    async def device(self) -> None:
        """The device worker; a runtime failure hands the answer back to the cloud if it can
        (DEVICE_FAILED: the cloud streams to the end), else ends it (finish_reason 'error')."""
        try:
            await self._device()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request %s: device runtime failed", self.request_id)
            self.fault.note("device-error", f"device runtime failed: {e}")
            receiving = any(not t.done() for t in self.tasks if t is not self.dev.task)
            if (receiving and self.cloud.done is None
                    and self.phases.phase in (Phase.CLOUD_PACED, Phase.CATCHING_UP)):
                self.phases.fire(Event.DEVICE_FAILED)
                self.plan.budget = self.params.max_new_tokens
                if await self.send_quietly(ExtendBudget(self.request_id, self.plan.budget)):
                    return
            if not self.phases.done:
                self.end("error")

    async def _device(self) -> None:
        """Prefill the prompt (PROMPT_PREFILLED), catch up on the cloud tokens, hand off (the one
        hand-off transition), decode locally. While the plan holds the device the prefill runs in
        small low-priority chunks and the worker holds instead of handing off, until
        `release_device` lets it go."""
        eng = _KeepKV(self.s.engine, self)
        t = time.perf_counter()
        prompt, at, logits, kv = await self.prompt_work(eng)
        i, self.dev.prompt_left = 0, len(prompt)
        while i < len(prompt):
            if self.phases.done:
                return  # the cloud finished the answer first
            step = policy.prompt_chunk(i, self.s.opt.prefill_chunk, self.plan.held)
            c0, ids = time.perf_counter(), prompt[i:i + step]
            logits, kv = await self.call(prefill_at, eng, ids, kv, at and at[i:i + step])
            if len(ids) > 1:  # the device's measured prefill rate (a one-token call is a decode step)
                self.dev.chunk_ms += (time.perf_counter() - c0) * 1e3
                self.dev.chunk_tokens, self.dev.chunk_calls = self.dev.chunk_tokens + len(ids), self.dev.chunk_calls + 1
            i += step
            self.dev.prompt_left = max(0, len(prompt) - i)
            await self.revisit(chunk=True)  # the measured prefill and the prompt left may have moved the plan
        self.dev.prompt_ms = (time.perf_counter() - t) * 1e3
        base = len(self.prompt) if at is not None else None  # answer token k at position n + k after a gapped prompt
        if self.phases.done:
            return
        self.phases.fire(Event.PROMPT_PREFILLED)
        caught = await self.catch_up(eng, logits, kv, base)
        if caught is None:
            return  # the cloud finished the answer first
        self.dev.prefill_ms = (time.perf_counter() - t) * 1e3
        await self.decode(eng, *caught, base)

    async def prompt_work(self, eng):
        """The prompt work before the plain prefill: the previous turn's cache, the cloud's KV, the
        system turn and the refined prompt. Returns (prompt ids still to prefill, their RoPE
        positions or None, the last logits or None, kv)."""
        d, c = self.dev, self.cloud
        prompt, at, logits, kv = self.prompt, None, None, None
        if d.reused:  # multi-turn: the previous turn's cache holds the first `reused` prompt tokens
            kv = d.past.kv if d.past.kv.length == d.reused else await self.call(eng.truncate, d.past.kv, d.reused)
            prompt = prompt[d.reused:]
        if c.kv_from is not None:  # the cloud sends the KV of the rest but the last token
            kv, prompt = await self.import_kv(kv, prompt)
        if c.refine:  # the system turn is always kept: prefill it while the cloud scores
            head = system_prefix_len(prompt, TemplateMarkers.from_tokenizer(self.s.tokenizer))
            if head:
                logits, kv = await self.call(eng.prefill, prompt[:head], kv)
            await c.got_refined.wait()
            if c.kept is not None and c.kept[:head] == list(range(head)):
                prompt = [self.prompt[i] for i in c.kept]
                at = c.kept[head:] if takes_positions(eng) else None  # the kept tokens' own positions
            prompt = prompt[head:]
            await self.replan(len(prompt))
            d.prompt_tokens = head + len(prompt)
        return prompt, at, logits, kv

    async def catch_up(self, eng, logits, kv, base: int | None):
        """Prefill the cloud tokens received, batch by batch (`policy.catch_up_step`), until covered;
        then the hand-off transition (`Phases.hand_off`, with no await between the step that found
        every token covered and it). Returns (logits, kv, hand-off index, phase before it), or None
        when the answer ended first. `base`: RoPE position of answer token 0 (None: contiguous)."""
        rule = CatchUp()
        self.dev.covered = 0
        while not self.phases.done:
            step = catch_up_step(rule, len(self.answer.ids), self.plan.held)
            if step == HOLD:  # held by the plan and caught up: it can go now (replan_held), else wait for
                self.replan_held()  # a cloud token, a fault or a re-plan
                if self.plan.held:
                    self.dev.wake.clear()
                    await self.dev.wake.wait()
            elif isinstance(step, HandOff):
                before = self.phases.phase
                return logits, kv, self.phases.hand_off(step.index, len(self.answer.ids)), before
            else:
                logits, kv = await self.call(prefill_at, eng, self.answer.ids[step.start:step.end], kv,
                                             None if base is None else list(range(base + step.start, base + step.end)))
                rule.prefilled(step.end)
                self.dev.covered = step.end
        return None

    async def decode(self, eng, logits, kv, h: int, before: Phase, base: int | None) -> None:
        """After the hand-off at `h`: Stop{h} to a cloud still streaming, then decode tokens h, h+1,
        ... on the device until the finish rule (`decoding.finish_reason`) ends the answer."""
        steps: list[float] = []  # wall ms of each device decode call (policy.device_pace)
        self.dev.following_cloud, self.speed.floor_ms = False, 0.0  # the device's tokens: no cloud floor from here on
        if self.plan.auto:  # from now on only the device's pace matters
            self.speed.interval_ms = device_pace(self.s.opt.target_tpot_ms, self.s.device_timing[2], steps)
        if self.cloud.channel is not None and before is not Phase.FAULT:
            await self.send_quietly(Stop(self.request_id, h))  # ignored by the table after the cloud's Done
        eos = self.s.engine.eos_id
        for i in range(h, self.params.max_new_tokens):
            tok = sample(logits, self.params, i, self.prompt + self.answer.ids, len(self.prompt), eos, self.guide)
            self.append(tok, "device", finish_reason(tok, i + 1, self.params, eos, guide=self.guide))
            if self.phases.done:
                return
            t0 = time.perf_counter()
            if base is None:
                logits, kv = await self.call(eng.decode, tok, kv)
            else:
                logits, kv = await self.call(prefill_at, eng, [tok], kv, [base + i])
            steps.append((time.perf_counter() - t0) * 1e3)
            if self.plan.auto:
                self.speed.interval_ms = device_pace(self.s.opt.target_tpot_ms, self.s.device_timing[2], steps)
        if not self.phases.done:  # h == max_new_tokens: the cloud streamed every token but named no end
            self.end("length")

    async def import_kv(self, kv, prompt: list[int]):
        """Wait for the cloud's KV of `prompt[:-1]` and import it after `kv`: returns (kv, [last
        prompt token]). The wait is bounded by the receiver's progress timeout (a cloud that sends no
        frame for that long is a stalled cloud, which ends the stream). When the KV does not come
        (cloud fault, the stream ended without it, a malformed transfer) returns (kv, prompt)
        unchanged: the device prefills."""
        eng, d, c = self.s.engine, self.dev, self.cloud
        d.waiting_kv = True  # the receiver's progress timeout now applies: a stalled cloud ends the wait
        try:
            await c.got_kv.wait()  # set by the last KV part, or when the cloud stream ends
        finally:
            d.waiting_kv = False
        if not c.kv_parts:
            log.info("request %s: the cloud sent no KV (%s); the device prefills", self.request_id, self.fault.error)
            return kv, prompt
        if self.answer.finish_reason is not None and c.kv_parts[0].block_index >= 0 \
                and len(c.kv_parts) < c.kv_parts[0].num_blocks:
            log.info("request %s: the answer ended before the KV hand-off (%d of %d pieces came)",
                     self.request_id, len(c.kv_parts), c.kv_parts[0].num_blocks)
            return kv, prompt
        n, parts = len(prompt) - 1, c.kv_parts
        try:
            def merge():  # on the device thread: decoding (and dequantizing) ~n x 23 KB is not the event loop's work
                start, layers = kv_layers(parts)
                if start != d.reused or layers[0][0].shape[2] != n:
                    raise ValueError(f"KV of {layers[0][0].shape[2]} tokens from {start}, expected {n} from {d.reused}")
                old = eng.kv_export(kv) if kv is not None and kv.length else None
                full = layers if old is None else [(np.concatenate([ok, k], axis=2), np.concatenate([ov, v], axis=2))
                                                   for (ok, ov), (k, v) in zip(old, layers)]
                return eng.kv_import(full, d.reused + n)

            kv = await self.call(merge)
        except ValueError as e:
            log.warning("request %s: bad KV hand-off (%s); the device prefills", self.request_id, e)
            return kv, prompt
        finally:
            c.kv_parts = []  # the arrays are imported (copied): free the frames
        d.kv_imported, d.prompt_tokens = n, 1
        return kv, prompt[-1:]

    # -- the display and the result -------------------------------------------------------------------

    async def display(self) -> None:
        """Show answer tokens in order, paced by the speed controller (`speed.release_time`)."""
        a, k = self.answer, 0
        while True:
            while k >= len(a.ids):
                if self.phases.done:
                    return
                a.changed.clear()
                await a.changed.wait()
            if self.dev.following_cloud:  # the cloud floor, from what has arrived and waits (speed.source_floor)
                self.speed.floor_ms = source_floor(a.cloud_arrivals(), len(a.ids) - k)
            due = self.speed.release_at(a.ready_ms[k])
            delay = (due - self.now()) / 1e3
            if delay > 0:
                a.changed.clear()
                try:  # an arrival meanwhile may lift the floor: re-evaluate (speed.release_ms)
                    await asyncio.wait_for(a.changed.wait(), delay)
                    continue
                except asyncio.TimeoutError:
                    pass
            t = self.now()
            self.speed.shown(t, due)
            ev = TokenEvent(self.decoder.push(a.ids[k]), a.ids[k], a.source[k], t, k)
            a.events.append(ev)
            if self.on_token is not None:
                self.on_token(ev)
            k += 1

    def learn(self) -> None:
        """Update the client's cloud estimates from this request's arrivals."""
        cloud = self.answer.cloud_arrivals()
        if cloud:
            self.s.cloud.update(len(self.prompt), cloud[0], tpot_from_arrivals(cloud))
        c = self.cloud
        if c.kv_done_ms is not None and cloud and c.kv_done_ms > cloud[0]:  # a whole KV hand-off came
            self.s.cloud.update_kv(sum(len(p.kv.data) + (len(p.scale.data) if p.scale is not None else 0)
                                       for p in c.kv_parts), c.kv_done_ms - cloud[0])

    def result(self) -> GenerationResult:
        """The request's `GenerationResult`; `mode` is the phase the answer ended in (`Phases.mode`)."""
        self.learn()
        a, d, pl = self.answer, self.dev, self.plan
        cloud = sum(1 for src in a.source if src == "cloud")
        return GenerationResult(
            # the shown text, byte for byte: control tokens add none, a cut last character is dropped
            text="".join(ev.text for ev in a.events), token_ids=list(a.ids), mode=self.phases.mode,
            **self.speed.stats(0.0), cloud_tokens=cloud, device_tokens=len(a.ids) - cloud,
            handoff_index=self.phases.handoff if cloud and len(a.ids) > cloud else None,
            finish_reason=a.finish_reason, prompt_ids=self.prompt, cloud_streamed=self.cloud.streamed,
            device_prefill_ms=d.prefill_ms, device_prompt_tokens=d.prompt_tokens, cloud_budget=pl.budget,
            budget_extensions=pl.extended, interval_ms=self.speed.interval_ms, fault=self.fault.kind,
            error=self.fault.error, plan=pl.planned, plan_reason=pl.reason, device_cached_tokens=d.reused,
            kv_imported_tokens=d.kv_imported, kv_wire=self.cloud.kv_wire if self.cloud.kv_from is not None else None,
            device_prompt_ms=d.prompt_ms, cloud_cached_tokens=self.cloud.cached,
            request_id=self.request_id, prefill_left_at_fault=self.fault.prefill_left, ready_ms=list(a.ready_ms),
            late_ms=list(self.speed.late_ms), cloud_sent_ms=list(a.cloud_sent_ms))


class _KeepKV:
    """The device engine, noting on the run the cache each prefill/decode returns (the run's last
    KV is the next turn's `DeviceCache`). Same interface as the engine it wraps."""

    def __init__(self, engine, run: _Run):
        self.engine, self._run = engine, run

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, ids, kv=None, positions=None):
        out = self.engine.prefill(ids, kv) if positions is None else self.engine.prefill(ids, kv, positions=positions)
        self._run.dev.kv = out[1]
        return out

    def decode(self, token_id, kv):
        out = self.engine.decode(token_id, kv)
        self._run.dev.kv = out[1]
        return out
