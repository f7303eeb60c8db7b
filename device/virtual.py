"""Virtual devices: a load generator that speaks the device side of the split protocol with a
profile's timing but runs no model.

One virtual request (`virtual_request`): connect + handshake (`open_channel`), send `Generate`
(prompt ids, the cloud budget of the real device's plan, optional refine ratio), receive `Token`s;
the device (`VirtualDevice`) takes the real `SplitSession`'s decisions (`device.policy`: the plan,
the re-plans when a measured figure moves the plan or a prompt chunk is done and the ExtendBudget
re-plan after the prompt, a cloud-to-the-end plan that holds the device until
`replan_held` releases it, the catch-up batches of `settings.CatchUp`) and spends the profile's time
on each engine call (`Timing.prefill_ms`: the prompt in calls of `policy.prompt_chunk` tokens, as the
real device; each catch-up batch in one call). When
it covers every token received it sends `Stop{handoff}` (Stop{0}: ready before the first cloud
token, it answers alone); its tokens h, h+1, ... are ready at R, R + d, ... (R: the hand-off time,
d: decode ms/token), up to `answer_len`. Shown times follow the speed controller
(`speed.display_ms`) at the plan's interval, then max(target, d) from the hand-off, as the real
device's display. After `Done(reason='budget')` it still catches up and takes over (no Stop is
needed then). In `cloud-only` mode it just receives to the end (`Done`).

The same `VirtualDevice` replays a recorded request (`replay`): fed the cloud token arrival times a
real `SplitSession` saw (`GenerationResult.ready_ms`) on a simulated clock, it gives the hand-off,
TTFT and TPOT the virtual device would have had on that very stream, so a comparison with the real
request measures the device model alone, not the cloud's run-to-run variation.

Per request (`VirtualResult`, times in ms since just before the connect, as a real `SplitSession`
counts them):
* ttft_ms: first token shown (a cloud token when it arrives; with a hand-off at 0, the device's).
* tpot_ms: p90 of the shown inter-token gaps (`speed.tpot_p90_ms`); tpot_max_ms the largest.
* cloud_tokens: tokens the cloud streamed (`Done.cloud_tokens`, else tokens received).
* cloud_busy_ms: how long the cloud held the request (its KV cache and a slot in the worker's
  queue): `Done.prefill_ms` (Generate received -> first token ready, queueing included) + the stream
  duration (last Token's `t_cloud_ms` - first Token's `t_cloud_ms`); cloud_step_ms: that duration
  per gap (the cloud's decode step at its batch).
* ok: the request got its first token and a `Done` within `timeout_s`, with no error.

`run_load` drives many of them with Poisson arrivals, bounded in count and in time;
`capacity_sweep` finds the highest rate at which the cloud still meets TTFT p99 <= a bound.

Limits (what the real device does and the virtual one does not): no KV hand-off; with refinement
it waits for `RefinedPrompt` and prefills the kept tokens in one go (the real one prefills the
system turn while it waits); device tokens are ready on the profile's decode pace exactly, and
shown exactly on the controller's schedule (the real device adds its thread and event-loop
scheduling delays, measured by the replay).
"""
from __future__ import annotations

import asyncio
import bisect
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.messages import Done, Error, ExtendBudget, RefinedPrompt, Stop, Token
from relayinfer.protocol.model.decoding import SamplingParams, generate_message
from relayinfer.protocol.requests import RequestTable, RequestViolation, Role

from . import policy
from .policy import HOLD, SLOWEST_PACE, HandOff, Plan, PlanInput, Progress, catch_up_step, plan
from .profiles import DeviceProfile, load_profile
from .settings import CatchUp, CloudEstimate, Timing
from .speed import display_ms, tpot_from_arrivals, tpot_p90_ms

LOAD_MODES = ("split", "cloud-only")
PREFILL_CHUNK = 256  # prompt tokens per device prefill call (`SplitOptions.prefill_chunk`'s default)


@dataclass
class VirtualResult:
    """One virtual request (ms; see the module docstring for the definitions). budget: the cloud
    budget after `extensions` ExtendBudget re-plans (None: cloud to the end); handoff: answer index
    of the first device token (None: the cloud answered to the end; 0: the device answered alone);
    interval_ms: the display interval before the hand-off; ready_ms / shown_ms: per answer token."""

    prompt_tokens: int
    mode: str
    ok: bool = False
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tpot_max_ms: float | None = None
    answer_tokens: int = 0
    cloud_tokens: int = 0
    cloud_busy_ms: float | None = None
    cloud_prefill_ms: float | None = None
    cloud_step_ms: float | None = None
    budget: int | None = None
    extensions: int = 0
    interval_ms: float | None = None
    handoff: int | None = None
    handoff_ms: float | None = None
    device_prompt_tokens: int = 0
    total_ms: float | None = None
    error: str | None = None
    ready_ms: list = field(default_factory=list)
    shown_ms: list = field(default_factory=list)


def profile_timing(profile: DeviceProfile, cloud_ttft_ms: float = 0.0, cloud_tpot_ms: float = 0.0) -> Timing:
    """The settings model's `Timing` of a profile (its device fit; cloud T and c as given, ms)."""
    return Timing(profile.prefill_ms_base, profile.prefill_ms_per_token, profile.decode_ms_per_token,
                  cloud_ttft_ms, cloud_tpot_ms)


def _device_timing(device: DeviceProfile | Timing | str) -> Timing:
    """The device fit (a, b, d) of a profile, a profile name or a `Timing` (cloud fields zeroed)."""
    if isinstance(device, Timing):
        return Timing(device.prefill_ms_base, device.prefill_ms_per_token, device.decode_ms_per_token, 0.0, 0.0)
    return profile_timing(load_profile(device) if isinstance(device, str) else device)


def plan_for(device: DeviceProfile | Timing | str, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
             refine: float | None = None, cloud: CloudEstimate | None = None) -> tuple[Timing, Plan]:
    """The real device's initial plan (`policy.plan`) for this device fit and a cloud estimate
    (None: a fresh client's pessimistic `CloudEstimate`): (the plan's `Timing`, the `Plan`)."""
    c = cloud or CloudEstimate()
    d = _device_timing(device)
    t = Timing(d.prefill_ms_base, d.prefill_ms_per_token, d.decode_ms_per_token, c.ttft_ms(prompt_tokens), c.tpot_ms)
    return t, plan(PlanInput(t, prompt_tokens, max_new_tokens, target_tpot_ms, refine,
                             max_interval_ms=SLOWEST_PACE * target_tpot_ms))


def auto_budget(profile: DeviceProfile, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                refine: float | None = None, cloud: CloudEstimate | None = None) -> int | None:
    """The cloud budget the real device's plan (`policy.plan`) picks for this profile (device fit =
    the profile's, cloud = a fresh client's pessimistic `CloudEstimate`; `refine`: keep ratio, the
    device starting after the cloud's first token); None = the cloud streams to the end (tokens)."""
    return plan_for(profile, prompt_tokens, max_new_tokens, target_tpot_ms, refine, cloud)[1].budget


# -- the simulated device (decisions of device.policy, costs of the profile) ------------------------

class DeviceIO(Protocol):
    """What `VirtualDevice.run` needs of its world: a clock (`now` ms, `sleep` ms), the cloud
    tokens received (`arrivals`, ms each), whether the answer ended (`finished`) or the cloud sent
    its Done (`cloud_done`), a wait for the next cloud event (`wait_event`) and a way to ask for
    more cloud tokens (`extend`)."""

    arrivals: list

    def now(self) -> float: ...
    def sleep(self, ms: float) -> Awaitable: ...
    def finished(self) -> bool: ...
    def cloud_done(self) -> bool: ...
    def wait_event(self) -> Awaitable: ...
    def extend(self, budget: int) -> Awaitable: ...


class VirtualDevice:
    """The device side of one split request with a profile's timing and no model: the decisions
    of `device.policy` as `split._Run` takes them, each engine call costing `Timing.prefill_ms`.

    timing: the plan's `Timing` (device fit and cloud estimate, ms); p: the initial `Plan`;
    prompt_tokens: tokens the device prefills; chunk: prompt tokens per call (32 while held); cost:
    what its engine calls take (a, b, d; None: the plan's fit, as for a device whose calibration is
    exact; a real device may plan on a fit that differs from its calls).
    After `run`: handoff (index or None), handoff_ms, budget, extensions (and extended_ms, when
    each ExtendBudget was sent), held, interval_ms."""

    def __init__(self, timing: Timing, p: Plan, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                 chunk: int = PREFILL_CHUNK, cost: Timing | None = None):
        self.t, self.max_new, self.target, self.chunk = timing, max_new_tokens, target_tpot_ms, chunk
        self.c = cost or timing  # what its calls take (a, b, d); the plan believes `timing`'s
        self.prompt_tokens, self.prompt_left = prompt_tokens, prompt_tokens
        self.budget, self.held, self.interval_ms, self.prompt_est = p.budget, p.held, p.interval_ms, \
            p.device_prompt_tokens
        self.extensions, self.handoff, self.handoff_ms = 0, None, None
        self.extended_ms: list[float] = []
        self.chunk_ms, self.chunk_tokens, self.chunk_calls = 0.0, 0, 0  # the prompt's calls, as `_Run.dev`
        self.planned = timing  # the timing the last plan or re-plan used (`policy.moved`), as `_Run.planned`

    def progress(self, now_ms: float, arrivals: Sequence[float], prompt_left: int) -> Progress:
        """`_Run.progress`: the arrivals and the device's prefill ms/token measured on its prompt
        calls (their per-call base a, the plan's, taken out; None before the first)."""
        rate = (max(0.0, self.chunk_ms - self.chunk_calls * self.t.prefill_ms_base) / self.chunk_tokens
                if self.chunk_tokens else None)
        return Progress(now_ms, tuple(arrivals), prompt_left, rate)

    def on_token(self, now_ms: float, arrivals: Sequence[float], force: bool = False) -> None:
        """A cloud token arrived (or, `force`, the prompt is prefilled): a device held by a
        cloud-to-the-end plan is released when `policy.replan_held` finds a hand-off feasible."""
        if not self.held or not arrivals:
            return
        iv = policy.replan_held(self.t, self.progress(now_ms, arrivals, self.prompt_left), self.prompt_est,
                                self.max_new, self.target, SLOWEST_PACE * self.target)
        if iv is not None:
            self.interval_ms, self.held = max(self.interval_ms, iv), False

    def release(self) -> None:
        """No more cloud tokens will come (Done(budget), or the stream ended): take over."""
        self.held = False

    async def run(self, io: DeviceIO) -> int | None:
        """Prompt, re-plan, catch-up, hand-off: returns the hand-off index, or None when the answer
        ended first (the cloud's finish rule)."""
        while self.prompt_left:  # the prompt, call by call
            if io.finished():
                return None
            n = min(self.prompt_left, policy.prompt_chunk(self.prompt_tokens - self.prompt_left, self.chunk, self.held))
            ms = self.c.prefill_ms(n)
            await io.sleep(ms)
            self.prompt_left -= n
            if n > 1:  # the measured prefill rate (a one-token call is a decode step)
                self.chunk_ms, self.chunk_tokens, self.chunk_calls = self.chunk_ms + ms, self.chunk_tokens + n, \
                    self.chunk_calls + 1
            await self.revisit(io, chunk=True)
        await self._replan(io)
        self.on_token(io.now(), io.arrivals, force=True)
        rule = CatchUp()
        while not io.finished():
            step = catch_up_step(rule, len(io.arrivals), self.held)
            if step == HOLD:
                await io.wait_event()
            elif isinstance(step, HandOff):
                self.handoff, self.handoff_ms = step.index, io.now()
                return step.index
            else:
                await io.sleep(self.c.prefill_ms(step.end - step.start))
                rule.prefilled(step.end)
        return None

    async def revisit(self, io: DeviceIO, chunk: bool = False) -> None:
        """`_Run.revisit` while the prompt prefills and the plan does not hold the device (a held
        one re-plans on every cloud token, `on_token`): re-plan (`_replan` with the prompt tokens
        left) when a measured figure moved the plan (`policy.moved`: cloud TTFT/TPOT) or, `chunk`, a
        prompt chunk is done. Called after each chunk and each cloud token; a device whose calls
        (`cost`) are slower than its fit re-plans on the rate it measured, as the real one."""
        if self.held or not self.prompt_left or self.handoff is not None or io.cloud_done():
            return
        now = self.progress(io.now(), io.arrivals, self.prompt_left).measured(self.t)
        if not chunk and not policy.moved(self.planned, now):
            return
        self.planned = now
        await self._replan(io, self.prompt_left)

    async def _replan(self, io: DeviceIO, prompt_left: int = 0) -> None:
        """`_Run.replan(prompt_left)`: with the cloud measured so far, ask for more tokens if the
        hand-off needs them."""
        if self.budget is None or not io.arrivals or io.cloud_done():
            return
        r = policy.replan(self.t, self.progress(io.now(), io.arrivals, prompt_left), self.budget, self.max_new,
                          self.target, self.interval_ms, SLOWEST_PACE * self.target)
        if r is None:
            return
        self.interval_ms = max(self.interval_ms, r.interval_ms)
        if r.budget > self.budget:
            self.budget, self.extensions = r.budget, self.extensions + 1
            self.extended_ms.append(io.now())
            await io.extend(r.budget)

    def answer(self, arrivals: Sequence[float], answer_len: int) -> tuple[list[float], list[float]]:
        """(ready_ms, shown_ms) of the answer: the cloud tokens before the hand-off, then device
        tokens at the decode pace up to `answer_len` tokens, shown by the speed controller."""
        h = self.handoff
        if h is None or self.handoff_ms is None:
            ready = list(arrivals)
        else:
            d = self.c.decode_ms_per_token
            ready = list(arrivals[:h]) + [self.handoff_ms + d * j for j in range(max(answer_len - h, 0))]
        after = max(self.target, self.t.decode_ms_per_token) if self.handoff_ms is not None else None
        return ready, display_ms(ready, self.interval_ms, after, self.handoff_ms, follow_source=True)


def _drive(coro):
    """Run a coroutine that never really suspends (a simulated clock) to its result."""
    try:
        while True:
            coro.send(None)
    except StopIteration as e:
        return e.value


class _Replay:
    """`DeviceIO` on a simulated clock over a recorded stream: cloud token k arrives at
    `trace[k]` ms (tokens beyond the trace at its mean gap, counted in `extrapolated`), at most
    `budget` of them; the answer ends when the cloud token `answer_len - 1` arrived (`ends`)."""

    def __init__(self, dev: VirtualDevice, trace: Sequence[float], answer_len: int, ends: bool, start_ms: float = 0.0):
        self.dev, self.trace, self.answer_len, self.ends = dev, list(trace), answer_len, ends
        self.gap = tpot_from_arrivals(self.trace) or 0.0
        self.clock, self.arrivals, self.extrapolated = start_ms, [], 0

    def _at(self, k: int) -> float | None:
        """Arrival time of cloud token k (None: it never comes)."""
        cap = self.answer_len if self.dev.budget is None else min(self.dev.budget, self.answer_len)
        if k >= cap or not self.trace:
            return None
        if k < len(self.trace):
            return self.trace[k]
        return self.trace[-1] + self.gap * (k - len(self.trace) + 1)

    async def _advance(self, to_ms: float) -> None:
        while (at := self._at(len(self.arrivals))) is not None and at <= to_ms:
            self.clock = max(self.clock, at)
            self.arrivals.append(at)
            self.extrapolated += len(self.arrivals) > len(self.trace)
            self.dev.on_token(at, self.arrivals)
            await self.dev.revisit(self)  # may extend the budget, so `_at` is asked again
        self.clock = max(self.clock, to_ms)

    def now(self) -> float:
        return self.clock

    async def sleep(self, ms: float) -> None:
        await self._advance(self.clock + ms)

    def finished(self) -> bool:
        return self.ends and len(self.arrivals) >= self.answer_len

    def cloud_done(self) -> bool:
        return self._at(len(self.arrivals)) is None

    async def wait_event(self) -> None:
        at = self._at(len(self.arrivals))
        if at is None:
            self.dev.release()  # the stream is over: a held device takes over
        else:
            await self._advance(at)

    async def extend(self, budget: int) -> None:
        pass


def replay(device: DeviceProfile | Timing | str, prompt_tokens: int, arrivals_ms: Sequence[float], answer_len: int,
           max_new_tokens: int, target_tpot_ms: float = 50.0, cloud: CloudEstimate | None = None,
           cloud_ends: bool = True, chunk: int = PREFILL_CHUNK, cost: Timing | None = None) -> dict:
    """The virtual device on a recorded cloud stream (module docstring): `arrivals_ms` (ms since
    the request started, ascending) are the cloud tokens a request received, `answer_len` its
    answer's length in tokens, `cloud_ends` whether the cloud's last token of that length ends it
    (False: the cloud was stopped, so only the device can end it). The plan is `plan_for(device,
    ...)` on `cloud` (the estimate the recorded request started with); `cost`: what the device's
    calls take (None: the plan's fit). Returns {'ttft_ms',
    'tpot_ms', 'handoff', 'handoff_ms', 'budget', 'extensions', 'extended_ms', 'interval_ms', 'ready_ms',
    'shown_ms', 'extrapolated' (cloud tokens past the recording, at its mean gap)}."""
    t, p = plan_for(device, prompt_tokens, max_new_tokens, target_tpot_ms, cloud=cloud)
    dev = VirtualDevice(t, p, prompt_tokens, max_new_tokens, target_tpot_ms, chunk, cost)
    io = _Replay(dev, arrivals_ms, answer_len, cloud_ends)
    _drive(dev.run(io))
    ready, shown = dev.answer(io.arrivals, answer_len)
    return {"ttft_ms": shown[0] if shown else None, "tpot_ms": tpot_p90_ms(shown), "handoff": dev.handoff,
            "handoff_ms": dev.handoff_ms, "budget": dev.budget, "extensions": dev.extensions,
            "extended_ms": dev.extended_ms,
            "interval_ms": dev.interval_ms, "ready_ms": ready, "shown_ms": shown, "extrapolated": io.extrapolated}


async def device_loop(t: Timing, prompt_tokens: int, received: Callable[[], int], finished: Callable[[], bool],
                      sleep: Callable[[float], Awaitable] = asyncio.sleep) -> int | None:
    """The catch-up core of `VirtualDevice.run` on callables: sleep `t.prefill_ms(prompt_tokens)`,
    then follow `policy.catch_up_step` (never held) on the count `received()` of cloud tokens,
    sleeping each batch's `t.prefill_ms(n)` (`sleep` takes seconds); returns the hand-off index, or
    None when `finished()` says the cloud ended the answer first. With `received()` =
    `t.arrived(clock)` and a clock that `sleep` advances, it hands off exactly where and when
    `settings.catch_up` says (tested)."""
    if prompt_tokens:
        await sleep(t.prefill_ms(prompt_tokens) / 1e3)
    rule = CatchUp()
    while not finished():
        step = catch_up_step(rule, received(), held=False)
        if isinstance(step, HandOff):
            return step.index
        await sleep(t.prefill_ms(step.end - step.start) / 1e3)
        rule.prefilled(step.end)
    return None


# -- one live virtual request ------------------------------------------------------------------------

class _Live:
    """One virtual request on a real channel: the `DeviceIO` of its `VirtualDevice` (wall clock
    since `t0`), the receiver that fills it, and the request's end state."""

    def __init__(self, ch, rid: str, res: VirtualResult, t0: float):
        self.ch, self.rid, self.res, self.t0 = ch, rid, res, t0
        self.table = RequestTable(Role.DEVICE)  # the request's protocol state: token order, crossings, its end
        self.arrivals: list[float] = []
        self.cloud_t: list[float] = []
        self.kept: list[int] | None = None
        self.done: Done | None = None
        self.ended = False  # a cloud token carried the finish rule's verdict
        self.dev: VirtualDevice | None = None
        self.event, self.got_refined = asyncio.Event(), asyncio.Event()

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    async def sleep(self, ms: float) -> None:
        await asyncio.sleep(ms / 1e3)

    def finished(self) -> bool:
        return self.ended or (self.done is not None and self.done.reason != "budget")

    def cloud_done(self) -> bool:
        return self.done is not None

    async def wait_event(self) -> None:
        self.event.clear()
        await self.event.wait()

    async def send(self, msg) -> None:
        """Send a device message unless the request table ignores it (it crossed the cloud's Done)."""
        if not self.table.send(msg).ignored:
            await self.ch.send(msg)

    async def extend(self, budget: int) -> None:
        await self.send(ExtendBudget(self.rid, budget))

    async def receive(self) -> None:
        """Cloud messages until Done or Error (a protocol violation is an error)."""
        try:
            async for msg in self.ch:
                ev = self.table.receive(msg)
                if isinstance(ev, RequestViolation):
                    self.res.error = f"protocol violation: {ev.message}"
                    return
                if isinstance(msg, Token):
                    self.arrivals.append(self.now())
                    self.cloud_t.append(msg.t_cloud_ms)
                    self.ended = self.ended or bool(msg.finish_reason)
                    if self.dev is not None and (self.dev.handoff is None):
                        self.dev.on_token(self.arrivals[-1], self.arrivals)
                        await self.dev.revisit(self)
                elif isinstance(msg, RefinedPrompt):
                    self.kept = list(msg.kept_indices)
                    self.got_refined.set()
                elif isinstance(msg, Done):
                    self.done = msg
                    return
                elif isinstance(msg, Error):
                    self.res.error = f"cloud error [{msg.code}]: {msg.message}"
                    return
                self.event.set()
        finally:
            self.got_refined.set()
            if self.dev is not None:
                self.dev.release()  # no more cloud tokens: a held device takes over
            self.event.set()

    async def device(self, refine: float | None, prompt_tokens: int) -> None:
        """The `VirtualDevice` (on the refined prompt once it arrived), then Stop{h} unless the
        cloud is done already."""
        if refine is not None:
            await self.got_refined.wait()
            if self.kept:
                self.dev.prompt_left = self.dev.prompt_tokens = len(self.kept)
        self.res.device_prompt_tokens = self.dev.prompt_tokens
        h = await self.dev.run(self)
        if h is not None and self.done is None:
            await self.send(Stop(self.rid, h))


def _finish(res: VirtualResult, io: _Live, answer_len: int | None) -> None:
    """The result's figures from the request's end state (module docstring)."""
    d, dev = io.done, io.dev
    res.cloud_tokens = d.cloud_tokens if d is not None else len(io.arrivals)
    if d is not None:  # no Token at all: a hand-off at 0 (the cloud held the request for its prefill)
        res.cloud_prefill_ms = d.prefill_ms
        res.cloud_busy_ms = d.prefill_ms + (io.cloud_t[-1] - io.cloud_t[0] if io.cloud_t else 0.0)
    if len(io.cloud_t) > 1:
        res.cloud_step_ms = (io.cloud_t[-1] - io.cloud_t[0]) / (len(io.cloud_t) - 1)
    if dev is not None:
        res.handoff, res.handoff_ms, res.budget, res.extensions = dev.handoff, dev.handoff_ms, dev.budget, dev.extensions
        res.interval_ms = dev.interval_ms
        if dev.handoff is not None and answer_len is not None and dev.handoff >= answer_len:
            res.handoff = dev.handoff_ms = None  # the cloud's tokens already make the whole answer
        ready, shown = dev.answer(io.arrivals, answer_len if answer_len is not None else len(io.arrivals))
    else:
        ready = list(io.arrivals)
        shown = display_ms(ready, res.interval_ms, follow_source=True)
    res.ready_ms, res.shown_ms, res.answer_tokens = ready, shown, len(ready)
    res.ok = d is not None and res.error is None and bool(ready)
    if shown:
        res.ttft_ms = shown[0]
        res.tpot_ms = tpot_p90_ms(shown)
        res.tpot_max_ms = float(np.diff(shown).max()) if len(shown) > 1 else None


async def virtual_request(url: str, fingerprint: str, prompt: Sequence[int], mode: str = "split",
                          profile: DeviceProfile | Timing | str = "phone", max_new_tokens: int = 64,
                          budget: int | None | str = "auto", refine: float | None = None,
                          target_tpot_ms: float = 50.0, token: str | None = None,
                          timeout_s: float = 60.0, min_tokens: int = 0, answer_len: int | None = None,
                          cloud: CloudEstimate | None = None) -> VirtualResult:
    """Run one virtual device request against the cloud at `url` (see the module docstring).
    profile: the device (a profile, its name, or a `Timing` whose a, b, d are used); budget 'auto':
    the real device's plan (`plan_for` on `cloud`, None: a fresh client's estimate), else a fixed
    budget (None: until the device takes over); answer_len: tokens of the whole answer (the device's
    tokens after a hand-off stop there; None: the cloud's answer length, or max_new_tokens after a
    hand-off); min_tokens: no EOS before this many tokens (`Generate.min_tokens`; = max_new_tokens:
    fixed-length answers, a decode-heavy load). Never raises for a cloud failure: `ok` False and
    `error` say it; raises ValueError for an unknown mode."""
    if mode not in LOAD_MODES:
        raise ValueError(f"unknown load mode {mode!r}; choose one of {', '.join(LOAD_MODES)}")
    prompt, split = list(prompt), mode == "split"
    res = VirtualResult(len(prompt), mode, interval_ms=target_tpot_ms)
    dev = None
    if split:
        t, p = plan_for(profile, len(prompt), max_new_tokens, target_tpot_ms, refine, cloud)
        if budget != "auto":
            p = Plan(budget, target_tpot_ms, False, len(prompt), "fixed budget")
        dev = VirtualDevice(t, p, p.device_prompt_tokens if refine is None else len(prompt), max_new_tokens,
                            target_tpot_ms)
        res.budget, res.interval_ms = p.budget, p.interval_ms
    rid = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()
    try:
        ch = await proto_ws.open_channel(url, fingerprint, token, client="relayinfer-virtual", open_timeout=timeout_s)
    except Exception as e:  # refused or unreachable
        res.error = f"{type(e).__name__}: {e}"
        return res
    io = _Live(ch, rid, res, t0)
    io.dev = dev
    rx = dv = None
    left = lambda: max(0.0, timeout_s - io.now() / 1e3)  # noqa: E731
    try:
        g = generate_message(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, min_tokens=min_tokens),
                             cloud_budget=res.budget if split else None, refine=refine if split else None)
        io.table.send(g)
        await ch.send(g)
        rx = asyncio.create_task(io.receive())
        dv = asyncio.create_task(io.device(refine, len(prompt))) if dev is not None else None
        await asyncio.wait_for(asyncio.shield(rx), left())
        if dv is not None:
            if io.done is not None and io.done.reason == "budget" and res.error is None:
                await asyncio.wait_for(asyncio.shield(dv), left())  # the budget is spent: the device takes over
            elif not dv.done():
                dv.cancel()
            await asyncio.gather(dv, return_exceptions=True)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s} s"
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        for task in (rx, dv):
            if task is not None:
                task.cancel()
        try:
            await asyncio.wait_for(ch.close(), 5.0)
        except Exception:
            pass
    res.total_ms = io.now()
    n = answer_len if answer_len is not None else (max_new_tokens if dev is not None and dev.handoff is not None else None)
    _finish(res, io, n)
    return res


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(results: list[VirtualResult], offered_rps: float, wall_s: float, ttft_slo_ms: float = 1000.0) -> dict:
    """TTFT p50/p99 (ms, over successful requests; a failed request counts as an SLO miss),
    goodput (requests/s that succeeded with TTFT <= the SLO, over the run's wall time), mean cloud
    tokens and cloud busy ms per request, success count."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok]
    good = sum(1 for r in ok if r.ttft_ms <= ttft_slo_ms)
    # p99 with failures as +inf: a run that drops requests cannot pass the SLO
    p99_all = float(np.percentile([r.ttft_ms if r.ok else np.inf for r in results], 99, method="higher")) \
        if results else None
    return {"offered_rps": offered_rps, "requests": len(results), "ok": len(ok), "wall_s": wall_s,
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": p99_all, "goodput_rps": good / wall_s if wall_s else 0.0,
            "slo_ms": ttft_slo_ms, "errors": _count(r.error.split(":")[0] for r in results if r.error), "meets_slo": bool(results) and p99_all is not None and p99_all <= ttft_slo_ms,
            "cloud_tokens_mean": float(np.mean([r.cloud_tokens for r in ok])) if ok else None,
            "cloud_busy_ms_mean": float(np.mean([r.cloud_busy_ms for r in ok])) if ok else None}


async def run_load(url: str, fingerprint: str, prompts: Sequence[Sequence[int]], rate_rps: float,
                   duration_s: float = 20.0, max_requests: int | None = None, mode: str = "split",
                   profile: DeviceProfile | str = "phone", max_new_tokens: int = 64, seed: int = 0,
                   refine: float | None = None, target_tpot_ms: float = 50.0, timeout_s: float = 30.0,
                   ttft_slo_ms: float = 1000.0, min_tokens: int = 0) -> dict:
    """Poisson arrivals (the first at t = 0) at `rate_rps` (requests/s) of virtual devices, each on its own connection,
    prompts drawn at random (seeded) from `prompts`. Arrivals stop after `duration_s` seconds or
    `max_requests`; each request is abandoned after `timeout_s` (counted as failed), so the run
    lasts at most duration_s + timeout_s. Returns `summarize(...)` plus 'results' (per request)."""
    rng = random.Random(seed)
    prof = load_profile(profile) if isinstance(profile, str) else profile
    tasks, t0, t = [], time.perf_counter(), 0.0
    while True:  # the first arrival at t = 0, then exponential gaps
        if tasks:
            t += rng.expovariate(rate_rps)
        if t > duration_s or (max_requests is not None and len(tasks) >= max_requests):
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        p = prompts[rng.randrange(len(prompts))]
        tasks.append(asyncio.create_task(virtual_request(url, fingerprint, p, mode, prof, max_new_tokens,
                                                         refine=refine, target_tpot_ms=target_tpot_ms,
                                                         timeout_s=timeout_s, min_tokens=min_tokens)))
    results = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - t0
    out = summarize(results, rate_rps, wall, ttft_slo_ms)
    out.update(mode=mode if refine is None else f"{mode}+refine", profile=prof.name, max_new_tokens=max_new_tokens,
               min_tokens=min_tokens,
               results=[asdict(r) for r in results])
    return out


async def capacity_sweep(url: str, fingerprint: str, prompts: Sequence[Sequence[int]], mode: str,
                         rates: Sequence[float] = (0.25, 0.5, 1, 2, 4), duration_s: float = 20.0,
                         max_requests: int = 20, ttft_slo_ms: float = 1000.0, settle_s: float = 1.0,
                         **kw) -> dict:
    """Run `run_load` at increasing rates, stopping at the first rate that misses TTFT p99 <= the
    SLO. capacity_rps: the highest rate that met it (0.0 if none did). 'runs': each rate's summary
    (without per-request results)."""
    runs, cap = [], 0.0
    for rate in rates:
        r = await run_load(url, fingerprint, prompts, rate, duration_s, max_requests, mode,
                           ttft_slo_ms=ttft_slo_ms, **kw)
        runs.append({k: v for k, v in r.items() if k != "results"})
        if not r["meets_slo"]:
            break
        cap = rate
        await asyncio.sleep(settle_s)  # let the cloud drain before the next rate
    return {"mode": mode if kw.get("refine") is None else f"{mode}+refine", "capacity_rps": cap,
            "ttft_slo_ms": ttft_slo_ms, "runs": runs}
