"""The device's split policy, sans-I/O: the phases of one request and every decision the device
makes in them, as pure functions of small frozen inputs. No sockets, no clocks, no asyncio, no
engine: `device.split` (the real device, ONNX Runtime) and `device.virtual` (profile timing, no
model) drive the same functions, so both decide alike.

Phases (`Phase`, the rules as data in `TRANSITIONS`, applied by `Phases`):

* CONNECTING: the Generate is not out yet.
* CLOUD_PACED: the cloud streams; the display paces its tokens; the device prefills its prompt
  (or holds in the background while a cloud-to-the-end plan keeps it idle).
* CATCHING_UP: the device's prompt is prefilled; it prefills the cloud tokens received, batch by
  batch (`settings.CatchUp`), until it has covered every one.
* HANDED_OFF: the device covered tokens 0..h-1 (h > 0) and decodes from h; cloud tokens >= h are
  dropped. Entered by one transition (`Phases.hand_off`), which requires covered == received.
* DEVICE_ALONE: the device answers every token (device-only mode, no cloud reachable, or the
  device was ready before the first cloud token: a hand-off at 0).
* CLOUD_ALONE: the cloud streams to the end with no device behind it (cloud-only mode, or the
  device runtime failed).
* FAULT: the cloud stream ended early; the device prefills what it lacks and takes over.
* DONE: the answer is complete. The result's mode is that of the phase the answer ended in
  (`MODE_OF`).

Decisions: `plan` (the initial cloud budget and display interval), `replan` (an ExtendBudget and/or
a slower display), `replan_held` (release a device held by a cloud-to-the-end plan), `moved`
(whether a measured figure moved the plan: when to re-plan), `catch_up_step` (prefill a batch,
hold, or hand off), `on_done` (what the cloud's Done means), `stall_is_fault` (whether a
silent cloud ends the stream). The math is `device.settings` (`choose_settings`, `CatchUp`) and
`device.speed` (`tpot_from_arrivals`), reused here. Times are ms since the request started.

The display interval is a decision, not only max(target, cloud TPOT, device TPOT): when the device
cannot catch up at that pace within the answer, the plan may slow the display down to
`max_interval_ms` (the speed controller of P/D-Device buying the device time; 1.8 x the target
by the real device's default, `split.SplitOptions.max_tpot_ms`), the smallest interval for which a
hand-off fits (`settings.choose_settings`). The cloud's pace is never set as the interval
(`display_interval`): the display follows it through `speed.source_floor`. The plan is revisited whenever a measured figure
moves it (`moved`: the cloud's TTFT or TPOT, the device's prefill ms/token, by more than 10 %) and
whenever the device finishes a prompt chunk, not only at fixed token counts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Sequence, Union

import numpy as np

from .settings import CatchUp, Timing, choose_settings
from .speed import tpot_from_arrivals

SLOWEST_PACE = 1.8  # default slowest display interval, x the target TPOT: TPOT max stays under 2x the target
                    # (the stall bound) with room for the jitter of the arrivals and the event loop
BACKGROUND_CHUNK = 32  # tokens per low-priority prefill call while the plan keeps the device idle
FIRST_CHUNK = 64  # tokens of the first prompt call: the prefill rate is measured after it (`Progress`), so a
                 # plan resting on a fit the device does not meet is revisited within ~64 tokens, not 256


def prompt_chunk(done: int, chunk: int, held: bool) -> int:
    """Tokens of the device's next prompt prefill call after `done` prompt tokens: `chunk`
    (`SplitOptions.prefill_chunk`), at most BACKGROUND_CHUNK while a plan holds the device, at most
    FIRST_CHUNK for the first call (the measured rate comes after it; `revisit` re-plans on it)."""
    n = min(chunk, BACKGROUND_CHUNK) if held else chunk
    return min(n, FIRST_CHUNK) if done == 0 else n

__all__ = [
    "Phase", "Event", "IGNORED", "TRANSITIONS", "MODE_OF", "PhaseError", "Phases", "PlanInput", "Plan", "Progress",
    "plan", "replan", "Replan", "replan_held", "moved", "MOVED_TOL", "Prefill", "HandOff", "HOLD", "catch_up_step", "on_done", "stall_is_fault",
    "BACKGROUND_CHUNK", "FIRST_CHUNK", "prompt_chunk", "SLOWEST_PACE", "PACE_STEPS", "device_pace", "display_interval", "refined_tokens",
]


class Phase(enum.Enum):
    """The phase of one split request at the device (see the module docstring)."""

    CONNECTING = "connecting"
    CLOUD_PACED = "cloud_paced"
    CATCHING_UP = "catching_up"
    HANDED_OFF = "handed_off"
    DEVICE_ALONE = "device_alone"
    CLOUD_ALONE = "cloud_alone"
    FAULT = "fault"
    DONE = "done"


class Event(enum.Enum):
    """What moves a request from one phase to the next."""

    START_SPLIT = "start_split"  # the Generate went out for a split request
    START_CLOUD_ONLY = "start_cloud_only"  # the Generate went out for a cloud-only request
    NO_CLOUD = "no_cloud"  # device-only: asked for, no cloud URL, or the cloud refused/unreachable
    PROMPT_PREFILLED = "prompt_prefilled"  # the device's prompt is in its KV cache
    HAND_OFF = "hand_off"  # the device covered every cloud token received (> 0) and takes over
    READY_FIRST = "ready_first"  # ... with none received: it answers alone (a hand-off at 0)
    CLOUD_FAULT = "cloud_fault"  # the cloud stream ended early (lost, Error, stalled, Done early)
    DEVICE_FAILED = "device_failed"  # the device runtime raised while the cloud still streams
    ANSWER_ENDED = "answer_ended"  # the finish rule fired, or nobody is left to go on


P, E = Phase, Event
IGNORED = "ignored"
"""Transition value: the event is legal in this phase but changes nothing."""

TRANSITIONS: dict[Phase, dict[Event, Union[Phase, str]]] = {
    P.CONNECTING: {E.START_SPLIT: P.CLOUD_PACED, E.START_CLOUD_ONLY: P.CLOUD_ALONE, E.NO_CLOUD: P.DEVICE_ALONE},
    P.CLOUD_PACED: {E.PROMPT_PREFILLED: P.CATCHING_UP, E.CLOUD_FAULT: P.FAULT, E.DEVICE_FAILED: P.CLOUD_ALONE,
                    E.ANSWER_ENDED: P.DONE},
    P.CATCHING_UP: {E.HAND_OFF: P.HANDED_OFF, E.READY_FIRST: P.DEVICE_ALONE, E.CLOUD_FAULT: P.FAULT,
                    E.DEVICE_FAILED: P.CLOUD_ALONE, E.ANSWER_ENDED: P.DONE},
    P.FAULT: {E.PROMPT_PREFILLED: IGNORED, E.HAND_OFF: P.HANDED_OFF, E.READY_FIRST: P.DEVICE_ALONE,
              E.CLOUD_FAULT: IGNORED, E.ANSWER_ENDED: P.DONE},
    P.HANDED_OFF: {E.CLOUD_FAULT: IGNORED, E.ANSWER_ENDED: P.DONE},
    P.DEVICE_ALONE: {E.PROMPT_PREFILLED: IGNORED, E.READY_FIRST: IGNORED, E.CLOUD_FAULT: IGNORED,
                     E.ANSWER_ENDED: P.DONE},
    P.CLOUD_ALONE: {E.CLOUD_FAULT: P.DONE, E.ANSWER_ENDED: P.DONE},
    P.DONE: {E.CLOUD_FAULT: IGNORED, E.DEVICE_FAILED: IGNORED},
}
"""``TRANSITIONS[phase][event]`` -> the next phase, or ``IGNORED``; an event not listed is illegal
in that phase (`Phases.fire` raises `PhaseError`)."""

MODE_OF: dict[Phase, str] = {
    P.CLOUD_PACED: "cloud-only", P.CATCHING_UP: "cloud-only", P.CLOUD_ALONE: "cloud-only", P.FAULT: "cloud-only",
    P.HANDED_OFF: "split", P.DEVICE_ALONE: "device-only",
}
"""`GenerationResult.mode` by the phase the answer ended in: the cloud streamed the whole answer
(cloud-only), the device took over at h > 0 (split), or answered every token (device-only)."""


class PhaseError(RuntimeError):
    """An event the phase table does not allow (a bug in the driver, never the peer's fault)."""


class Phases:
    """The phase of one request (`phase`), moved only by `fire` and `hand_off`.

    Attributes:
        phase: the current `Phase`.
        ended_in: the phase the answer ended in (None until DONE).
        handoff: answer index of the first device token (None: the device never took over).
    """

    def __init__(self) -> None:
        self.phase, self.ended_in, self.handoff = P.CONNECTING, None, None

    def fire(self, event: Event) -> Phase:
        """Apply `event`; returns the phase after it. Raises `PhaseError` if `event` is illegal now."""
        nxt = TRANSITIONS[self.phase].get(event)
        if nxt is None:
            raise PhaseError(f"{event.value} is not allowed in phase {self.phase.value}")
        if nxt == IGNORED:
            return self.phase
        if nxt is P.DONE:
            self.ended_in = self.phase
        self.phase = nxt
        return nxt

    def hand_off(self, covered: int, received: int) -> int:
        """The device takes over at answer index `covered` (tokens), which must equal the cloud
        tokens `received`: from here cloud tokens are dropped (`takes_cloud_tokens` is False).
        Returns the hand-off index. Raises `PhaseError` when covered != received or the phase
        allows no hand-off."""
        if covered != received:
            raise PhaseError(f"hand-off at {covered} with {received} cloud tokens received")
        self.fire(E.HAND_OFF if covered else E.READY_FIRST)
        self.handoff = covered
        return covered

    @property
    def done(self) -> bool:
        """The answer is complete."""
        return self.phase is P.DONE

    @property
    def takes_cloud_tokens(self) -> bool:
        """Cloud tokens extend the answer only before any hand-off and before its end."""
        return self.phase in (P.CLOUD_PACED, P.CATCHING_UP, P.CLOUD_ALONE)

    @property
    def mode(self) -> str:
        """'split', 'device-only' or 'cloud-only', from the phase the answer ended in (the
        current phase before the end)."""
        return MODE_OF.get(self.ended_in or self.phase, "cloud-only")


# -- planning -----------------------------------------------------------------------------------------

def refined_tokens(prompt_tokens: int, keep: float | None) -> int:
    """Prompt tokens left after refinement at keep ratio `keep` (None: no refinement): at least 1."""
    return max(1, int(prompt_tokens * keep)) if keep else prompt_tokens


@dataclass(frozen=True)
class PlanInput:
    """What the initial plan knows.

    timing: the device fit (a, b ms; d ms/token) and the expected cloud TTFT/TPOT (ms), device
    start 0. prompt_tokens: uncached prompt tokens the device must prefill. max_new_tokens: answer
    length bound (tokens). target_tpot_ms: the pace shown to the user (ms/token). refine: the keep
    ratio the cloud applies (None: off). kv_transfer_ms: KV hand-off, ms from the cloud's first
    token to the imported KV (None: the device prefills the prompt). max_interval_ms: the slowest
    display interval the plan may choose to let the device catch up (ms/token; None: no slower
    than max(target, cloud TPOT, device TPOT))."""

    timing: Timing
    prompt_tokens: int
    max_new_tokens: int
    target_tpot_ms: float
    refine: float | None = None
    kv_transfer_ms: float | None = None
    max_interval_ms: float | None = None


@dataclass(frozen=True)
class Plan:
    """The initial plan. budget: most cloud tokens (None: the cloud streams to the end); interval_ms:
    the display interval; held: the device cannot catch up, so it prefills in the background and
    holds (cloud to the end); device_prompt_tokens: the prompt tokens the plan assumed the device
    prefills; reason: the plan in words."""

    budget: int | None
    interval_ms: float
    held: bool
    device_prompt_tokens: int
    reason: str


def display_interval(t: Timing, target_tpot_ms: float, chosen_ms: float) -> float:
    """The speed controller's interval (ms/token) for the display interval `chosen_ms` that
    `settings.choose_settings` chose under `t`: `chosen_ms` where the plan slowed the display past
    I0 = max(target, cloud TPOT c, device TPOT d) to let the device catch up (a decision, at most
    `max_interval_ms`); else max(target, d). The cloud's pace c is the plan's arithmetic, not a
    setting: while cloud tokens are shown the display already follows their sustained pace
    (`speed.source_floor`), which falls as soon as the cloud speeds up, whereas an interval never
    falls before the hand-off: one slow measured gap (another request's prefill sharing the cloud's
    step) set as the interval would slow every token until the device takes over."""
    pace = max(target_tpot_ms, t.cloud_tpot_ms, t.decode_ms_per_token)
    return chosen_ms if chosen_ms > pace + 0.5 else max(target_tpot_ms, t.decode_ms_per_token)


def plan(p: PlanInput) -> Plan:
    """The cloud budget and display interval of `settings.choose_settings` for `p`: with the KV
    hand-off the device starts after token 0 and the transfer and prefills one token; with
    refinement it starts after token 0 and prefills the kept share. Raises ValueError as
    `choose_settings` does."""
    t, n = p.timing, refined_tokens(p.prompt_tokens, p.refine)
    if p.kv_transfer_ms is not None:
        t, n = replace(t, device_start_ms=t.cloud_ttft_ms + p.kv_transfer_ms), 1
    elif p.refine:
        t = replace(t, device_start_ms=t.cloud_ttft_ms)
    st = choose_settings(t, n, p.max_new_tokens, p.target_tpot_ms, max_interval_ms=p.max_interval_ms)
    interval = display_interval(t, p.target_tpot_ms, st.interval_ms)
    if st.cloud_budget is not None:
        pace = max(p.target_tpot_ms, t.cloud_tpot_ms, t.decode_ms_per_token)
        slowed = f", slowed from {pace:.0f} ms so that the device catches up" if st.interval_ms > pace + 0.5 else ""
        return Plan(st.cloud_budget, interval, False, n,
                    f"a cloud budget of {st.cloud_budget} tokens, then the device takes over; the device "
                    f"extends the budget if its prefill runs late (settings: display interval {interval:.0f} ms{slowed})")
    why = (f"the device cannot catch up: its prefill takes {t.prefill_ms_per_token:.0f} ms a token, not less "
           f"than the {st.interval_ms:.0f} ms display interval" if t.prefill_ms_per_token >= st.interval_ms else
           f"the device cannot catch up within {p.max_new_tokens} tokens (prompt of {n} tokens: about "
           f"{t.prefill_ms_base + t.prefill_ms_per_token * n:.0f} ms to prefill on the device)")
    return Plan(None, interval, True, n, why)


@dataclass(frozen=True)
class Progress:
    """What the device has measured so far. now_ms: time since the request started; arrivals_ms:
    when each cloud token received arrived (ms, ascending; may be empty); prompt_left: prompt tokens
    the device has still to prefill; device_ms_per_token: the device's measured prefill ms per
    token on this request's prompt chunks, their per-call base taken out (None: none measured);
    behind: cloud tokens received and not yet prefilled (None: not known)."""

    now_ms: float
    arrivals_ms: tuple[float, ...]
    prompt_left: int
    device_ms_per_token: float | None = None
    behind: int | None = None

    def measured(self, t: Timing) -> Timing:
        """`t` re-based on the measurements: cloud TTFT = the first arrival (`t`'s, but never
        earlier than now, before it), TPOT from the arrivals (`speed.tpot_from_arrivals`; `t`'s
        with fewer than two), the device's prefill ms/token as measured (`t`'s before a chunk),
        the device going on from now."""
        tpot = tpot_from_arrivals(self.arrivals_ms)
        ttft = self.arrivals_ms[0] if self.arrivals_ms else max(t.cloud_ttft_ms, self.now_ms)
        b = t.prefill_ms_per_token if self.device_ms_per_token is None else self.device_ms_per_token
        return replace(t, cloud_ttft_ms=ttft, cloud_tpot_ms=t.cloud_tpot_ms if tpot is None else tpot,
                       prefill_ms_per_token=b, device_start_ms=self.now_ms)


MOVED_TOL = 0.1
"""Relative change of a measured figure that makes the device re-plan (`moved`)."""


def moved(planned: Timing, now: Timing, tol: float = MOVED_TOL) -> bool:
    """Whether a figure the plan rests on moved by more than `tol` (relative) between the timing
    the last plan used (`planned`) and the measured one (`now`, `Progress.measured`): the cloud's
    TTFT or TPOT, or the device's prefill ms/token (ms). The driver re-plans when it did."""
    pairs = ((planned.cloud_ttft_ms, now.cloud_ttft_ms), (planned.cloud_tpot_ms, now.cloud_tpot_ms),
             (planned.prefill_ms_per_token, now.prefill_ms_per_token))
    return any(abs(b - a) > tol * max(abs(a), 1e-9) for a, b in pairs)


@dataclass(frozen=True)
class Replan:
    """A re-plan's answer: budget, the cloud budget to ask for (tokens; an ExtendBudget when larger
    than the one in force); interval_ms, the display interval from now (ms, never faster than the
    one in force)."""

    budget: int
    interval_ms: float


def replan(t: Timing, progress: Progress, budget: int, max_new_tokens: int, target_tpot_ms: float,
           interval_ms: float | None = None, max_interval_ms: float | None = None) -> Replan | None:
    """Re-plan from now (`progress.measured(t)`, `progress.prompt_left` prompt tokens left, margin
    0.1) at a display no faster than the `interval_ms` in force and no slower than
    `max_interval_ms`: a `Replan` when the budget must grow (the whole answer when the device can
    no longer catch up) or the display must slow down; None to keep both."""
    floor = max(target_tpot_ms, interval_ms or 0.0)
    m = progress.measured(t)
    st = choose_settings(m, progress.prompt_left, max_new_tokens, floor, margin=0.1, max_interval_ms=max_interval_ms)
    want = st.cloud_budget if st.cloud_budget is not None else max_new_tokens
    iv = display_interval(m, floor, st.interval_ms)
    slower = st.cloud_budget is not None and iv > floor + 0.5
    if want <= budget and not slower:
        return None
    return Replan(max(want, budget), iv if slower else floor)


def replan_held(t: Timing, progress: Progress, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                max_interval_ms: float | None = None) -> float | None:
    """Whether a device held by a cloud-to-the-end plan should go, re-planned with the measured
    figures (`progress.measured(t)`) and min(prompt_tokens, prompt_left) tokens left. The driver
    asks whenever a figure `moved` and whenever a background prompt chunk is done. Returns the
    display interval (ms, at most `max_interval_ms` when slowed) of the feasible hand-off, or
    None: keep holding."""
    m = progress.measured(t)
    if progress.prompt_left == 0 and progress.behind == 0:  # it covered every token received: it can go now
        return display_interval(m, target_tpot_ms, 0.0)
    st = choose_settings(m, min(prompt_tokens, progress.prompt_left), max_new_tokens, target_tpot_ms,
                         max_interval_ms=max_interval_ms)
    return None if st.cloud_budget is None else display_interval(m, target_tpot_ms, st.interval_ms)


# -- catching up --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prefill:
    """Prefill answer tokens [start, end) (indices) in one call."""

    start: int
    end: int


@dataclass(frozen=True)
class HandOff:
    """Caught up: take over at answer index `index` (tokens covered == received)."""

    index: int


HOLD = "hold"
"""`catch_up_step`'s answer while a plan holds the device and it has covered every token received:
wait for the next cloud token, a fault or a re-plan."""


def catch_up_step(rule: CatchUp, received: int, held: bool, chunk: int = BACKGROUND_CHUNK) -> Prefill | HandOff | str:
    """The device's next move after its prompt (`settings.CatchUp` on `received` cloud tokens): a
    `Prefill` of every token not yet covered (at most `chunk` while `held`), `HOLD` when held and
    caught up, else `HandOff(covered)`. Raises ValueError as `CatchUp.next_batch` does."""
    batch = rule.next_batch(received)
    if batch is None:
        return HOLD if held else HandOff(rule.covered)
    lo, hi = batch
    return Prefill(lo, min(hi, lo + chunk) if held else hi)


PACE_STEPS = 3  # device decode steps measured before the display follows them instead of the calibration


def device_pace(target_tpot_ms: float, calibrated_ms: float, steps_ms: Sequence[float]) -> float:
    """The display interval after the hand-off (ms) when the settings are automatic: the device's
    own decode pace, never faster than `target_tpot_ms`. Until PACE_STEPS decode steps are measured
    (`steps_ms`, wall ms of each device call) it is the calibrated decode step `calibrated_ms`; then
    the median of the last PACE_STEPS steps, so that a calibration taken under another load (or a
    profile the device runs slower than) sets the pace for a few tokens only, not the whole answer."""
    pace = float(np.median(steps_ms[-PACE_STEPS:])) if len(steps_ms) >= PACE_STEPS else calibrated_ms
    return max(target_tpot_ms, pace)


# -- the cloud's signals ------------------------------------------------------------------------------

def on_done(phase: Phase, reason: str) -> str:
    """What the cloud's Done (reason `reason`) means in `phase`: 'take-over' (its budget is spent:
    the device goes on from the tokens received), 'end' (a cloud-alone answer ended: eos, stop or
    length), 'ignore' (the answer ended or the device took over already) or 'fault' (the cloud
    ended the stream early: cancelled, stopped, or an end the device cannot follow)."""
    if phase in (P.DONE, P.HANDED_OFF, P.DEVICE_ALONE, P.FAULT):
        return "ignore"
    if reason == "budget" and phase in (P.CLOUD_PACED, P.CATCHING_UP):
        return "take-over"
    if phase is P.CLOUD_ALONE and reason in ("eos", "stop", "length"):
        return "end"
    return "fault"


def stall_is_fault(device_busy: bool, waiting_kv: bool, held: bool) -> bool:
    """Whether no cloud frame within the progress timeout ends the stream: not while the device
    works toward a hand-off on its own (`device_busy`, neither waiting for the cloud's KV nor held
    by the plan), since it then takes over without the cloud."""
    return not (device_busy and not waiting_kv and not held)
