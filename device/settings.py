"""The settings algorithm: how many tokens the cloud streams (budget N) and the display interval I.

Model (all times in ms, t = 0 when the device sends Generate):

* The device prefills its prompt of L tokens from t = s (0, or later when it waits for the refined
  prompt): done at D0 = s + a + b*L (profile fit).
* Cloud token k (k = 0, 1, ...) reaches the device at T + k*c (T: cloud TTFT seen by the device,
  round trip included; c: cloud TPOT).
* Catch-up: whenever the device is idle and holds received tokens it has not prefilled, it prefills
  all of them in one call costing a + b*n (amortized), until it has covered every token the cloud
  will send (N of them). Its hand-off time R(N) is when that last batch ends; token N is then ready
  at R(N) and token N + j at R(N) + j*d (d: device decode TPOT).
* The display shows token 0 at T and token k at T + k*I (speed controller, steady interval).

Interval: I = max(target, c, d) -- the display cannot run ahead of the cloud (c) before the
hand-off nor of the device (d) after it, and one steady interval keeps TPOT max = I.

Budget: the display never waits iff every token is ready by its slot. Cloud tokens are (c <= I);
device token N is iff R(N) <= T + N*I. In the one-batch case R(N) = max(D0, T + (N-1)*c) + a + b*N,
so with D0 late enough, N*(I - b) >= D0 + a - T, i.e.

    N >= (D0 + a - T) / (I - b),   feasible only if b < I.

If b >= I the device cannot catch up with the display (each received token costs more to
prefill than the time it buys), and the cloud streams to the end (N = None). Catch-up in several
batches pays `a` more than once, so instead of the closed form we take the smallest N for which
`simulate` (this very model, batch by batch) shows no late token, times (1 + margin) for safety.
P/D-Device (the paper this project follows) derives the same trade-off; the derivation here is ours.

During a request the device refines the estimate when the refined prompt arrives and again when its
prompt prefill is done: it re-plans from "now" with the tokens it still has to prefill and the
measured T and c; if the budget they imply is larger, it sends ExtendBudget (before the cloud
reaches the old budget, or the extension comes too late and is skipped). After the hand-off only
the device's pace matters, so the display interval drops to max(target, d).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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

    def scaled(self, device: float = 1.0, cloud: float = 1.0) -> "Timing":
        """Device times x `device`, cloud times x `cloud` (for error analysis)."""
        return Timing(self.prefill_ms_base * device, self.prefill_ms_per_token * device,
                      self.decode_ms_per_token * device, self.cloud_ttft_ms * cloud, self.cloud_tpot_ms * cloud,
                      self.device_start_ms)


@dataclass(frozen=True)
class Settings:
    """cloud_budget: N (None = the cloud streams to the end); interval_ms: I; handoff_ms: when the
    device is expected to take over (None when it does not)."""

    cloud_budget: int | None
    interval_ms: float
    handoff_ms: float | None


def handoff_time(t: Timing, prompt_tokens: int, n: int) -> float:
    """R(N): when the device has prefilled the prompt and all `n` cloud tokens (ms), batch by batch."""
    a, b, T, c = t.prefill_ms_base, t.prefill_ms_per_token, t.cloud_ttft_ms, t.cloud_tpot_ms
    now, covered = t.device_start_ms + (a + b * prompt_tokens if prompt_tokens else 0.0), 0
    while covered < n:
        arrived = n if c == 0 else min(n, max(0, math.floor((now - T) / c + 1e-9) + 1))
        if arrived <= covered:  # idle until token `covered` arrives
            now, arrived = max(now, T + covered * c), covered + 1
        now += a + b * (arrived - covered)
        covered = arrived
    return now


def simulate(t: Timing, prompt_tokens: int, answer_tokens: int, budget: int | None, interval_ms: float,
             target_tpot_ms: float, stall_factor: float = 2.0) -> dict:
    """Shown times of a split answer under timing `t` with the given settings.

    Returns {'shown_ms': float64 [answer_tokens], 'stalls': gaps > stall_factor*max(target, interval),
    'late': tokens shown after their slot T + k*I, 'handoff': N or None, 'tpot_max_ms'}.
    """
    n = answer_tokens if budget is None else min(budget, answer_tokens)
    ready = t.cloud_ttft_ms + t.cloud_tpot_ms * np.arange(answer_tokens, dtype=np.float64)
    handoff = None
    if n < answer_tokens:
        handoff = n
        r = handoff_time(t, prompt_tokens, n)
        ready[n:] = r + t.decode_ms_per_token * np.arange(answer_tokens - n)
    shown = np.empty(answer_tokens)
    for k in range(answer_tokens):
        shown[k] = ready[k] if k == 0 else max(ready[k], shown[k - 1] + interval_ms)
    gaps = np.diff(shown)
    slots = t.cloud_ttft_ms + interval_ms * np.arange(answer_tokens)
    return {"shown_ms": shown, "stalls": int((gaps > stall_factor * max(target_tpot_ms, interval_ms)).sum()),
            "late": int((shown > slots + 1e-6).sum()), "handoff": handoff,
            "tpot_max_ms": float(gaps.max()) if gaps.size else 0.0}


def choose_settings(t: Timing, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                    margin: float = 0.2) -> Settings:
    """The fewest cloud tokens N with no late token under `t` (see the module docstring), then
    N * (1 + margin); cloud-to-the-end when the device cannot catch up (b >= I) or N >= the answer.

    Raises:
        ValueError: target_tpot_ms <= 0 or prompt_tokens < 1.
    """
    if target_tpot_ms <= 0 or prompt_tokens < 0:
        raise ValueError("target_tpot_ms must be > 0 and prompt_tokens >= 0")
    interval = max(target_tpot_ms, t.cloud_tpot_ms, t.decode_ms_per_token)
    if t.prefill_ms_per_token >= interval:
        return Settings(None, interval, None)
    slot = lambda n: t.cloud_ttft_ms + n * interval  # noqa: E731
    ok = lambda n: handoff_time(t, prompt_tokens, n) <= slot(n)  # noqa: E731
    # R(n) - slot(n) is not monotone (each extra catch-up batch pays `a` again): scan upwards
    first = next((n for n in range(1, max_new_tokens) if ok(n)), None)
    if first is None:
        return Settings(None, interval, None)
    n = next((m for m in range(math.ceil(first * (1 + margin)), max_new_tokens) if ok(m)), None)
    if n is None:
        return Settings(None, interval, None)
    return Settings(n, interval, handoff_time(t, prompt_tokens, n))
