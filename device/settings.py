"""The settings algorithm: how many tokens the cloud streams (budget N) and the display interval I.

Model (all times in ms, t = 0 when the device sends Generate):

* The device prefills its prompt of L tokens from t = s (0, or later when it waits for the refined
  prompt): done at D0 = s + a + b*L (profile fit).
* Cloud token k (k = 0, 1, ...) reaches the device at T + k*c (T: cloud TTFT seen by the device,
  round trip included; c: cloud TPOT).
* Catch-up (`CatchUp`, the one rule the model, the real device and the virtual device share):
  whenever the device is idle and holds received tokens it has not prefilled, it prefills all of
  them in one call costing a + b*n (amortized; a one-token call costs d), and the first time it
  finds nothing new it takes over at h = the tokens covered (h <= N; h < N when it caught the
  stream early). Its hand-off time R is when that last batch ends; token h is then ready at R and
  token h + j at R + j*d (d: device decode TPOT).
* The display shows token 0 at T and token k at T + k*I (speed controller, steady interval).

Interval: I = max(target, c, d) -- the display cannot run ahead of the cloud (c) before the
hand-off nor of the device (d) after it, and one steady interval keeps TPOT max = I.

Budget: the display never waits iff every token is ready by its slot. Cloud tokens are (c <= I);
device token h is iff R <= T + h*I. In the one-batch case R(N) = max(D0, T + (N-1)*c) + a + b*N,
so with D0 late enough, N*(I - b) >= D0 + a - T, i.e.

    N >= (D0 + a - T) / (I - b),   feasible only if b < I.

If b >= I the device cannot catch up with the display (each received token costs more to
prefill than the time it buys), and the cloud streams to the end (N = None). Catch-up in several
batches pays `a` more than once, so instead of the closed form we take the smallest N for which
`simulate` (this very model, batch by batch) shows no late token, times (1 + margin) for safety.
P/D-Device (the paper this project follows) derives the same trade-off; the derivation here is ours.

The display interval can be a decision as well (`max_interval_ms`): when no budget fits at
I = max(target, c, d), the least slower I (up to that bound) for which one does; the display then
slows down to buy the device time (P/D-Device's speed controller).

During a request the device refines the estimate when the refined prompt arrives, after every
prompt chunk, and whenever a measured figure moves by more than 10 % (T on the first cloud token,
c on later ones, the device's own prefill ms/token; `policy.moved`): it re-plans from "now" with
the tokens it still has to prefill and the measured figures; if the budget they imply is larger,
it sends ExtendBudget (before the cloud reaches the old budget, or the extension comes too late
and is skipped), and it may slow the display; a device a cloud-to-the-end plan keeps idle starts
when a hand-off became feasible. After the hand-off only
the device's pace matters, so the display interval drops to max(target, d).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .speed import count_stalls, release_time


def cost_line(xs, ys) -> tuple[float, float]:
    """The least-squares line y = base + slope*x with base >= 0 and slope >= 0 (a cost: ms against
    tokens or batch size) through points `xs`, `ys` (equal-length sequences, >= 2 distinct x).

    An unconstrained fit of a few noisy timings can give a negative slope (a longer prompt "cheaper")
    or base; the constrained optimum then lies on a boundary, so the candidates are the free fit, the
    flat line (slope 0, base = mean y) and the line through the origin (base 0), and the feasible one
    with the least squared error is returned. Returns (base, slope). Raises ValueError for fewer than
    two distinct x or unequal lengths."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if x.shape != y.shape or len(set(x.tolist())) < 2:
        raise ValueError(f"a cost line needs >= 2 distinct x of equal-length data, got {len(x)} x, {len(y)} y")
    slope, base = np.polyfit(x, y, 1)
    cands = [(float(base), float(slope)), (max(0.0, float(y.mean())), 0.0),
             (0.0, max(0.0, float(x @ y / (x @ x))))]
    ok = [(b, s) for b, s in cands if b >= 0 and s >= 0]
    return min(ok, key=lambda bs: float(((bs[0] + bs[1] * x - y) ** 2).sum()))


@dataclass(frozen=True)
class Timing:
    """What the algorithm knows: device fit (a, b ms; d ms/token), cloud TTFT T and TPOT c (ms),
    and when the device starts (or resumes) prefilling its remaining prompt (device_start_ms;
    later than 0 when it must wait for a refined prompt, or when re-planning mid-request)."""

    prefill_ms_base: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    cloud_ttft_ms: float
    cloud_tpot_ms: float
    device_start_ms: float = 0.0

    def prefill_ms(self, n: int) -> float:
        """Device time of one prefill call of `n` tokens after a cache (ms): a + b*n, and for n = 1
        the decode time d (a one-token call is a decode step; `DeviceProfile.prefill_ms` and
        `PacedEngine` charge the same)."""
        if n == 1 and self.decode_ms_per_token:
            return self.decode_ms_per_token
        return self.prefill_ms_base + self.prefill_ms_per_token * n

    def arrived(self, now_ms: float, cap: int) -> int:
        """Cloud tokens received by `now_ms` (token k arrives at T + k*c), at most `cap`."""
        if now_ms < self.cloud_ttft_ms:
            return 0
        if self.cloud_tpot_ms <= 0:
            return cap
        return min(cap, math.floor((now_ms - self.cloud_ttft_ms) / self.cloud_tpot_ms + 1e-9) + 1)

    def scaled(self, device: float = 1.0, cloud: float = 1.0) -> "Timing":
        """Device times x `device`, cloud times x `cloud` (for error analysis)."""
        return Timing(self.prefill_ms_base * device, self.prefill_ms_per_token * device,
                      self.decode_ms_per_token * device, self.cloud_ttft_ms * cloud, self.cloud_tpot_ms * cloud,
                      self.device_start_ms)


@dataclass
class CloudEstimate:
    """Running estimates of the cloud as this device sees it (ms): TTFT = ttft_base_ms +
    prefill_ms_per_token * prompt tokens (round trip included), fitted by least squares over the
    last `window` requests (base and slope together), TPOT and the KV hand-off rate (bytes/s, None
    until one came) by exponential averaging from the first measurement on. The defaults are
    deliberately pessimistic and hold only until measured: with one prompt length seen, the TTFT
    line passes through that length's mean (the default slope kept, or lowered so that the base is
    not negative); with two, it is the fit."""

    ttft_base_ms: float = 150.0
    prefill_ms_per_token: float = 1.0
    tpot_ms: float = 40.0
    alpha: float = 0.5
    window: int = 32
    samples: list = field(default_factory=list)
    retry_at: float = 0.0  # time.monotonic() before which the cloud asked not to be called (OVERLOADED)
    kv_bytes_per_s: float | None = None  # KV hand-offs as they came: bytes / ms from token 0 to the last piece
    tpot_measured: bool = False  # tpot_ms is a measurement (else the default, replaced by the first one)

    def update_kv(self, nbytes: int, ms: float) -> None:
        """Fold in one whole KV hand-off: `nbytes` bytes of pieces that took `ms` from the first
        token to the last piece (exponential average of the rate, bytes/s)."""
        if nbytes <= 0 or ms <= 0:
            return
        rate = nbytes / ms * 1e3
        self.kv_bytes_per_s = rate if self.kv_bytes_per_s is None else \
            self.kv_bytes_per_s + self.alpha * (rate - self.kv_bytes_per_s)

    def back_off(self, retry_after_ms: float | None) -> None:
        """Honour an OVERLOADED hint: no cloud for `retry_after_ms` (default 1 s, at most 10 min)."""
        ms = 1000.0 if retry_after_ms is None else min(max(retry_after_ms, 0.0), 600_000.0)
        self.retry_at = max(self.retry_at, time.monotonic() + ms / 1e3)

    def ttft_ms(self, prompt_tokens: int) -> float:
        """Expected cloud TTFT (ms) for a prompt of `prompt_tokens` tokens."""
        return self.ttft_base_ms + self.prefill_ms_per_token * prompt_tokens

    def update(self, prompt_tokens: int, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """Fold in one request's measured TTFT and TPOT (ms; None: not measured)."""
        if ttft_ms is not None:
            self.samples = (self.samples + [(prompt_tokens, ttft_ms)])[-self.window:]
            xs = np.array([x for x, _ in self.samples], float)
            ys = np.array([y for _, y in self.samples], float)
            if np.ptp(xs) > 0:
                self.ttft_base_ms, self.prefill_ms_per_token = cost_line(xs, ys)
            else:  # one prompt length so far: the line through its mean, the slope lowered if the base would be < 0
                mean, n = float(ys.mean()), float(xs[0])
                if n > 0:
                    self.prefill_ms_per_token = min(self.prefill_ms_per_token, mean / n)
                self.ttft_base_ms = max(0.0, mean - self.prefill_ms_per_token * n)
        if tpot_ms is not None:
            self.tpot_ms = self.tpot_ms + self.alpha * (tpot_ms - self.tpot_ms) if self.tpot_measured else tpot_ms
            self.tpot_measured = True


def device_fit(local: tuple[float, float, float], profile: tuple[float, float, float] | None,
               lo: int = 8, hi: int = 256) -> tuple[float, float, float]:
    """The (a, b, d) the settings use for a device that runs `local` (this machine's calibrated
    (prefill ms base, ms per token, decode ms per token)) but is never faster than `profile`
    (`PacedEngine`: every call lasts max(local, profile)). A call of n tokens then costs the upper
    envelope max(a_l + b_l*n, a_p + b_p*n); its line through n = `lo` and n = `hi` tokens (the
    catch-up batches and the prompts) is the fit. Taking max(a) and max(b) separately instead
    (130 ms + 16.7 ms/token for the phone profile here) overstated a small catch-up batch ~2x and
    made the hand-off look infeasible. d = max(d_l, d_p).

    Raises:
        ValueError: lo >= hi."""
    if profile is None:
        return tuple(local)
    if lo >= hi:
        raise ValueError(f"lo ({lo}) must be < hi ({hi}) tokens")
    env = lambda n: max(local[0] + local[1] * n, profile[0] + profile[1] * n)  # noqa: E731
    b = (env(hi) - env(lo)) / (hi - lo)
    return max(0.0, env(lo) - b * lo), b, max(local[2], profile[2])


@dataclass(frozen=True)
class Settings:
    """cloud_budget: N (None = the cloud streams to the end); interval_ms: I; handoff_ms: when the
    device is expected to take over (None when it does not)."""

    cloud_budget: int | None
    interval_ms: float
    handoff_ms: float | None


@dataclass
class CatchUp:
    """The device's catch-up rule, written once: after its prompt, the device prefills every cloud
    token received and not yet prefilled in one call (amortising the per-call cost a), again and
    again; the first time it finds nothing new (covered == received, checked atomically with the
    hand-off) it takes over at index `covered` (0: it was ready before the first cloud token, so it
    answers alone). Used by `catch_up` (the model), `split._Run._device` (the real device) and
    `virtual.virtual_request` (the simulated one).

    covered: answer tokens the device has prefilled (int, tokens)."""

    covered: int = 0

    def next_batch(self, received: int) -> tuple[int, int] | None:
        """Answer indices [start, end) to prefill next given `received` cloud tokens, or None:
        caught up, hand off at `covered`.

        Raises:
            ValueError: received < covered (tokens cannot be un-received)."""
        if received < self.covered:
            raise ValueError(f"received ({received}) < covered ({self.covered})")
        return (self.covered, received) if received > self.covered else None

    def prefilled(self, end: int) -> None:
        """The batch ending at answer index `end` is prefilled."""
        self.covered = end


def catch_up(t: Timing, prompt_tokens: int, budget: int) -> tuple[int, float]:
    """(h, R(h)): the hand-off index and time (ms) of the `CatchUp` rule under timing `t` when the
    cloud streams at most `budget` tokens: the device starts at device_start_ms, prefills the
    prompt (one call of `prompt_tokens`, none if 0), then catches up batch by batch; h <= budget
    (h < budget when it catches the stream early)."""
    now, rule = t.device_start_ms + (t.prefill_ms(prompt_tokens) if prompt_tokens else 0.0), CatchUp()
    while (batch := rule.next_batch(t.arrived(now, budget))) is not None:
        now += t.prefill_ms(batch[1] - batch[0])
        rule.prefilled(batch[1])
    return rule.covered, now


def handoff_time(t: Timing, prompt_tokens: int, n: int) -> float:
    """R: when the device takes over with a cloud budget of `n` tokens (ms; `catch_up`)."""
    return catch_up(t, prompt_tokens, n)[1]


def simulate(t: Timing, prompt_tokens: int, answer_tokens: int, budget: int | None, interval_ms: float,
             target_tpot_ms: float, stall_factor: float = 2.0) -> dict:
    """Shown times of a split answer under timing `t` with the given settings: cloud tokens at
    max(interval_ms, c), the pace the speed controller's source floor holds on a cloud streaming
    every c ms (`speed.source_floor`), the device's tokens (from the hand-off on) at interval_ms.

    Returns {'shown_ms': float64 [answer_tokens], 'stalls': gaps > stall_factor*max(target, pace),
    'late': tokens shown after their slot T + k*max(I, c), 'handoff': N or None, 'tpot_max_ms'}.
    """
    n = answer_tokens if budget is None else min(budget, answer_tokens)
    ready = t.cloud_ttft_ms + t.cloud_tpot_ms * np.arange(answer_tokens, dtype=np.float64)
    handoff = None
    if n < answer_tokens:
        handoff, r = catch_up(t, prompt_tokens, n)
        ready[handoff:] = r + t.decode_ms_per_token * np.arange(answer_tokens - handoff)
    cloud_pace = max(interval_ms, t.cloud_tpot_ms)
    pace = np.full(answer_tokens, cloud_pace)
    if handoff is not None:
        pace[handoff:] = interval_ms
    shown = np.empty(answer_tokens)
    for k in range(answer_tokens):
        shown[k] = release_time(ready[k], shown[k - 1] if k else None, pace[k])
    gaps = np.diff(shown)
    slots = t.cloud_ttft_ms + cloud_pace * np.arange(answer_tokens)
    return {"shown_ms": shown, "stalls": count_stalls(shown, pace, target_tpot_ms, stall_factor),
            "late": int((shown > slots + 1e-6).sum()), "handoff": handoff,
            "tpot_max_ms": float(gaps.max()) if gaps.size else 0.0}


def _budget_at(t: Timing, prompt_tokens: int, max_new_tokens: int, interval: float, margin: float) -> int | None:
    """The fewest cloud tokens N with no late token at display interval `interval` (ms), times
    (1 + margin); None when none below `max_new_tokens` fits."""
    def ok(n: int) -> bool:  # the first device token (index h <= n) is ready by its display slot
        h, r = catch_up(t, prompt_tokens, n)
        return r <= t.cloud_ttft_ms + h * interval
    # R(n) - slot(n) is not monotone (each extra catch-up batch pays `a` again): scan upwards
    first = next((n for n in range(1, max_new_tokens) if ok(n)), None)
    if first is None:
        return None
    return next((m for m in range(math.ceil(first * (1 + margin)), max_new_tokens) if ok(m)), None)


def choose_settings(t: Timing, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                    margin: float = 0.2, max_interval_ms: float | None = None) -> Settings:
    """The fewest cloud tokens N with no late token under `t` (see the module docstring), then
    N * (1 + margin); cloud-to-the-end when the device cannot catch up (b >= I) or N >= the answer.

    The display interval is I0 = max(target, c, d). With `max_interval_ms` > I0 (ms/token) the
    interval is a decision too (the speed controller of P/D-Device slowing the display to buy the
    device time): when no budget fits at I0, the smallest I in (I0, max_interval_ms] (to 0.5 ms,
    by bisection: a slower display only moves every slot later, so feasibility is monotone in I)
    whose budget leaves the device at least the margin's share of the answer (N <= answer /
    (1 + margin); else the smallest I with any budget: a hand-off at the answer's last tokens is
    worth little); cloud-to-the-end at I0 when none fits. The per-call base `a` is charged per
    prefill call of the catch-up (`catch_up`), never per token.

    Raises:
        ValueError: target_tpot_ms <= 0 or prompt_tokens < 0.
    """
    if target_tpot_ms <= 0 or prompt_tokens < 0:
        raise ValueError("target_tpot_ms must be > 0 and prompt_tokens >= 0")
    interval = max(target_tpot_ms, t.cloud_tpot_ms, t.decode_ms_per_token)
    n = None if t.prefill_ms_per_token >= interval else _budget_at(t, prompt_tokens, max_new_tokens, interval, margin)
    if n is None and max_interval_ms is not None and max_interval_ms > interval and \
            t.prefill_ms_per_token < max_interval_ms:
        def budget(i: float) -> int | None:
            return None if t.prefill_ms_per_token >= i else _budget_at(t, prompt_tokens, max_new_tokens, i, margin)

        roomy = lambda b: b is not None and b <= max_new_tokens / (1 + margin)  # noqa: E731
        n_hi = budget(max_interval_ms)
        if n_hi is not None:
            # the least interval whose budget leaves the device the margin's share of the answer (else any budget)
            fits = roomy if roomy(n_hi) else (lambda b: b is not None)
            lo, hi = interval, max_interval_ms  # fits(budget(lo)) is False, fits(budget(hi)) is True
            while hi - lo > 0.5:
                mid = (lo + hi) / 2
                n_mid = budget(mid)
                lo, hi, n_hi = (lo, mid, n_mid) if fits(n_mid) else (mid, hi, n_hi)
            interval, n = hi, n_hi
    if n is None:
        return Settings(None, interval, None)
    return Settings(n, interval, handoff_time(t, prompt_tokens, n))
