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
generator on both sides (see `protocol.decoding.sample`).

Faults: cloud unreachable or refusing at start -> device-only; connection lost mid-stream -> the
device continues from the tokens it has; device slower than the whole answer -> the cloud streams
to the end (mode cloud-only). `GenerationResult.fault` records which happened.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from relayinfer.protocol import ws as proto_ws
from relayinfer.protocol.decoding import SamplingParams, check_prompt, is_stop, sample
from relayinfer.protocol.errors import RelayInferError
from relayinfer.protocol.messages import Done, Error, ExtendBudget, Generate, RefinedPrompt, Stop, Token
from relayinfer.protocol.refine import system_prefix_len

from .settings import Timing, choose_settings
from .speed import SpeedController

MODES = ("split", "device-only", "cloud-only")


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

    mode: 'split' (cloud then device), 'device-only' or 'cloud-only'. ttft_ms / tpot_ms_*: as shown
    to the user (ms). stalls: gaps > 2x target TPOT. cloud_tokens / device_tokens: shown tokens by
    source. handoff_index: answer index of the first device token (None if no hand-off).
    cloud_streamed: tokens the cloud sent, including ones computed after the hand-off and dropped.
    device_prefill_ms: wall ms from the device's first prefill call to the hand-off (prompt +
    catch-up). device_prompt_tokens: prompt tokens the device prefilled (fewer with refinement).
    cloud_budget / budget_extensions / interval_ms: the settings used (see `device.settings`).
    fault: None, 'cloud-unreachable', 'cloud-refused', 'connection-lost' or 'device-too-slow'.
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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SplitOptions:
    """mode: one of MODES. target_tpot_ms: pace shown to the user. cloud_budget: most tokens the
    cloud may stream: 'auto' (the settings algorithm, `device.settings`, chooses it and the display
    interval from the device timing and the cloud estimates, and extends it during the request if
    needed), an int, or None (until the device takes over). connect_timeout_s: handshake bound.
    prefill_chunk: prompt tokens per device prefill call. refine: keep ratio of prompt refinement
    (None = off): the device prefills the system turn at once, then only the prompt tokens the
    cloud keeps (`RefinedPrompt`, sent right after the first token)."""

    mode: str = "split"
    target_tpot_ms: float = 50.0
    cloud_budget: int | None | str = "auto"
    connect_timeout_s: float = 5.0
    prefill_chunk: int = 256
    refine: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")


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
    """

    def __init__(self, engine, tokenizer, cloud_url: str | None, fingerprint: str, token: str | None = None,
                 options: SplitOptions | None = None, executor: ThreadPoolExecutor | None = None,
                 device_timing: tuple[float, float, float] | None = None, cloud: CloudEstimate | None = None,
                 ssl=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.ssl = ssl  # ssl.SSLContext for wss:// (None: the default context for wss, none for ws)
        self.cloud_url, self.fingerprint, self.token = cloud_url, fingerprint, token
        self.opt = options or SplitOptions()
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-model")
        self.device_timing, self.cloud = device_timing, cloud or CloudEstimate()

    async def run(self, prompt_ids: Sequence[int], params: SamplingParams,
                  on_token: Callable[[TokenEvent], None] | None = None) -> GenerationResult:
        """Generate the answer to `prompt_ids`; `on_token` is called for each token as it is shown.

        Raises:
            PromptTooLongError: prompt + max_new_tokens exceed the model's context.
            RemoteError: the cloud refused the request itself (e.g. PROMPT_TOO_LONG) in cloud-only mode.
        """
        check_prompt(len(prompt_ids), params.max_new_tokens, self.engine.context_length)
        run = _Run(self, list(prompt_ids), params, on_token)
        return await run.go()


class _Run:
    """State of one request (see the module docstring for the three coroutines)."""

    def __init__(self, s: SplitSession, prompt: list[int], params: SamplingParams, on_token):
        self.s, self.prompt, self.params, self.on_token = s, prompt, params, on_token
        self.mode = s.opt.mode if s.cloud_url or s.opt.mode == "device-only" else "device-only"
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
        self.device_prompt_tokens = len(prompt)  # fewer once a refined prompt is used
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

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def append(self, tok: int, source: str) -> None:
        """Commit answer token `len(answer)`; mark the answer complete on a stop token or length."""
        self.answer.append(tok)
        self.source.append(source)
        self.ready_ms.append(self.now())
        reason = is_stop(tok, self.s.engine.eos_id, self.params)
        if reason or len(self.answer) >= self.params.max_new_tokens:
            self.complete, self.finish_reason = True, reason or "length"
        self.changed.set()

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
        n = len(self.prompt)
        self.device_prompt_est = max(1, int(n * opt.refine)) if opt.refine else n
        t = self.timing()
        if opt.refine:  # the refined prompt comes right after the first cloud token
            t = self.timing(start_ms=t.cloud_ttft_ms)
        st = choose_settings(t, self.device_prompt_est, self.params.max_new_tokens, opt.target_tpot_ms)
        self.speed.interval_ms = st.interval_ms
        self.budget = st.cloud_budget
        self.device_idle = st.cloud_budget is None  # cannot catch up: the cloud streams to the end

    async def replan(self, prompt_left: int) -> None:
        """Re-plan from now with `prompt_left` prompt tokens still to prefill and the measured cloud
        TTFT/TPOT; extend the cloud budget if more tokens are needed (and it is not too late)."""
        if (not self.auto or self.budget is None or self.channel is None or not self.ready_ms
                or self.cloud_done is not None or self.handoff is not None):
            return
        n = len(self.ready_ms)
        tpot = (self.ready_ms[-1] - self.ready_ms[0]) / (n - 1) if n > 1 else None
        st = choose_settings(self.timing(self.now(), self.ready_ms[0], tpot), prompt_left,
                             self.params.max_new_tokens, self.s.opt.target_tpot_ms, margin=0.1)
        want = st.cloud_budget if st.cloud_budget is not None else self.params.max_new_tokens
        if want > self.budget:
            self.budget = want
            self.extended += 1
            try:
                await self.channel.send(ExtendBudget(self.request_id, want))
            except RelayInferError:
                pass

    async def go(self) -> GenerationResult:
        self.t0 = time.perf_counter()
        self.plan()
        if self.mode != "device-only":
            await self.connect()
        tasks = [asyncio.create_task(self.display())]
        if self.channel is not None:
            tasks.append(asyncio.create_task(self.receive()))
        if self.mode != "cloud-only" and not (self.device_idle and self.channel is not None):
            tasks.append(asyncio.create_task(self.device()))
        try:
            await tasks[0]  # the display ends when the answer is complete and shown
        finally:
            for t in tasks[1:]:
                t.cancel()
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            if self.channel is not None:
                await self.channel.close()
        return self.result()

    async def connect(self) -> None:
        """Handshake and send Generate; on failure fall back to device-only (split) or raise."""
        s = self.s
        try:
            self.channel = await proto_ws.open_channel(s.cloud_url, s.fingerprint, s.token, client="relayinfer-device",
                                                       open_timeout=s.opt.connect_timeout_s,
                                                       **({"ssl": s.ssl} if s.ssl is not None else {}))
            budget = self.budget if self.mode == "split" else None
            p = self.params
            refine = s.opt.refine if self.mode == "split" else None
            await self.channel.send(Generate(self.request_id, self.prompt, p.max_new_tokens, p.temperature, p.top_p,
                                             p.top_k, p.seed, budget, refine, list(p.stop_ids)))
            self.refine_wanted = refine is not None
        except Exception as e:  # unreachable (OSError, TimeoutError), refused (RemoteError), ...
            if self.mode == "cloud-only":
                raise
            self.fault = "cloud-refused" if isinstance(e, RelayInferError) else "cloud-unreachable"
            self.error = f"{type(e).__name__}: {e}"
            self.mode, self.channel = "device-only", None

    async def receive(self) -> None:
        """Cloud tokens into the answer until the hand-off; Done / Error / connection loss recorded."""
        try:
            async for msg in self.channel:
                if isinstance(msg, Token) and msg.request_id == self.request_id:
                    self.cloud_streamed += 1
                    if self.handoff is None and not self.complete and msg.index == len(self.answer):
                        self.append(msg.token_id, "cloud")
                elif isinstance(msg, RefinedPrompt) and msg.request_id == self.request_id:
                    n = len(self.prompt)
                    if msg.kept_indices and all(0 <= i < n for i in msg.kept_indices):
                        self.kept = sorted(set(msg.kept_indices))
                    self.got_refined.set()
                elif isinstance(msg, Done):
                    self.cloud_done = msg
                    if self.mode == "cloud-only" and not self.complete:
                        self.complete, self.finish_reason = True, msg.reason
                        self.changed.set()
                    return
                elif isinstance(msg, Error):
                    raise RelayInferError(f"cloud error [{msg.code}]: {msg.message}")
        except RelayInferError as e:
            if self.complete or self.handoff is not None:
                return
            self.error = str(e)
            if self.mode == "cloud-only":
                self.complete, self.finish_reason, self.fault = True, "error", "connection-lost"
                self.changed.set()
            else:
                self.fault = "connection-lost"
        finally:
            self.got_refined.set()  # nothing more will come: the device uses the full prompt

    async def device(self) -> None:
        """Prefill prompt, catch up on cloud tokens, hand off, decode locally."""
        loop, eng, ex = asyncio.get_running_loop(), self.s.engine, self.s.executor
        kv, chunk = None, self.s.opt.prefill_chunk
        t = time.perf_counter()
        prompt = self.prompt
        if self.refine_wanted:  # the system turn is always kept: prefill it while the cloud scores
            head = system_prefix_len(prompt)
            if head:
                logits, kv = await loop.run_in_executor(ex, eng.prefill, prompt[:head], kv)
            await self.got_refined.wait()
            if self.kept is not None and self.kept[:head] == list(range(head)):
                prompt = [self.prompt[i] for i in self.kept]
            prompt = prompt[head:]
            await self.replan(len(prompt))
            self.device_prompt_tokens = head + len(prompt)
        for i in range(0, len(prompt), chunk):
            if self.complete:
                return  # the cloud finished the answer first
            logits, kv = await loop.run_in_executor(ex, eng.prefill, prompt[i:i + chunk], kv)
        await self.replan(0)
        covered = 0
        while True:  # catch up: prefill every cloud token received so far in one batch
            if self.complete:
                return  # the cloud finished the answer first
            n = len(self.answer)
            if covered == n:
                break
            logits, kv = await loop.run_in_executor(ex, eng.prefill, self.answer[covered:n], kv)
            covered = n
        self.device_prefill_ms = (time.perf_counter() - t) * 1e3
        self.handoff = covered  # atomic with the check above: no await in between
        if self.auto:  # from now on only the device's pace matters
            self.speed.interval_ms = max(self.s.opt.target_tpot_ms, self.s.device_timing[2])
        if self.channel is not None and self.fault is None and self.cloud_done is None:
            try:
                await self.channel.send(Stop(self.request_id, covered))
            except RelayInferError:
                pass  # connection gone: nothing to stop
        for i in range(covered, self.params.max_new_tokens):
            tok = sample(logits, self.params, i)
            self.append(tok, "device")
            if self.complete:
                return
            logits, kv = await loop.run_in_executor(ex, eng.decode, tok, kv)

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
            tpot = (cloud[-1] - cloud[0]) / (len(cloud) - 1) if len(cloud) > 1 else None
            self.s.cloud.update(len(self.prompt), cloud[0], tpot)

    def result(self) -> GenerationResult:
        self.learn()
        mode = self.mode
        if mode == "split" and self.handoff is None:
            mode = "cloud-only"
            self.fault = self.fault or "device-too-slow"  # the cloud streamed the whole answer
        if mode == "split" and self.handoff == 0:
            mode = "device-only"  # the device was ready before the first cloud token arrived
        cloud = sum(1 for src in self.source if src == "cloud")
        return GenerationResult(
            text=self.s.tokenizer.decode(self.answer, skip_special=True), token_ids=list(self.answer), mode=mode,
            **self.speed.stats(0.0), cloud_tokens=cloud, device_tokens=len(self.answer) - cloud,
            handoff_index=self.handoff if cloud and len(self.answer) > cloud else None,
            finish_reason=self.finish_reason, prompt_ids=self.prompt, cloud_streamed=self.cloud_streamed,
            device_prefill_ms=self.device_prefill_ms, device_prompt_tokens=self.device_prompt_tokens,
            cloud_budget=self.budget, budget_extensions=self.extended, interval_ms=self.speed.interval_ms, fault=self.fault, error=self.error)
