"""The speed controller: shows tokens to the user at a steady pace, whatever their source.

Cloud tokens arrive in bursts (network, cloud batching) and faster than a person reads; device tokens
arrive at the device's decode speed. The controller releases token k at

    shown[k] = max(ready[k], shown[k-1] + interval)

so a buffer of cloud tokens is spread out evenly instead of dumped, and the time it buys covers the
device's catch-up prefill (P/D-Device, the "speed controller" of the paper; interval chosen by the
settings algorithm, else the target TPOT). The first token is shown as soon as it is ready (TTFT).
A *stall* is a gap between two shown tokens longer than `stall_factor` x the pace in use when the
later token was shown (the target TPOT, or the interval when the settings algorithm had to choose a
slower one; the interval may change during a request, e.g. drop to the device's pace after the
hand-off, so each gap is judged against the interval in force for it).

While cloud tokens are the source and the display has caught up with them (fewer than
`SOURCE_WINDOW` tokens waiting), it also never runs faster than the pace the cloud has sustained
lately (`source_floor`, the *floor*): a cloud slower than the chosen interval would otherwise drain
the buffer and show its own jitter as gaps of 2x the interval; at the cloud's pace the buffer
absorbs that jitter. Tokens already waiting cannot be outrun, so a backlog is shown at the interval
(a burst that arrives after a long wait, e.g. tokens queued on the link behind a KV transfer, is not
slowed to the pace of that wait). The floor is a fact about the source, not a choice: it is lifted
(0) when the device takes over, and the gaps it causes are reported as TPOT like any other. The
display re-evaluates a pending release whenever a token arrives (`release_ms`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def release_time(ready_ms: float, prev_shown_ms: float | None, interval_ms: float) -> float:
    """When a token ready at `ready_ms` is shown: max(ready, previous shown + interval) (ms); the
    first token (`prev_shown_ms` None) as soon as it is ready."""
    return ready_ms if prev_shown_ms is None else max(ready_ms, prev_shown_ms + interval_ms)


SOURCE_WINDOW = 3
"""Gaps of the source's recent arrivals that `source_pace` averages."""


def source_pace(ready_ms: Sequence[float], window: int = SOURCE_WINDOW) -> float:
    """The pace the token source has sustained lately: `tpot_from_arrivals` over the last `window`
    gaps of `ready_ms` (arrival times, ms, ascending), ms/token; 0.0 with fewer than 2 arrivals."""
    return tpot_from_arrivals(ready_ms[-(window + 1):]) or 0.0


def source_floor(arrivals_ms: Sequence[float], backlog: int, window: int = SOURCE_WINDOW) -> float:
    """The display's floor (ms/token) while cloud tokens are shown: `source_pace(arrivals_ms)` while
    fewer than `window` tokens wait to be shown (`backlog`: ready, not yet shown, counting the next
    one), else 0.0 (a token already here cannot be outrun)."""
    return source_pace(arrivals_ms, window) if backlog < window else 0.0


def release_ms(k: int, ready_ms: Sequence[float], prev_shown_ms: float | None, interval_ms: float,
               follow_source: bool) -> float:
    """When token k (ready at `ready_ms[k]`, ms) is shown, the previous one shown at
    `prev_shown_ms`: `release_time` with interval max(interval_ms, `source_floor`) where the floor
    (only with `follow_source`) is recomputed at each arrival before the release, from the
    arrivals known then, as the display loop of `split` does. `ready_ms` holds every arrival known
    to the caller (ascending); those after the release do not change it."""
    if prev_shown_ms is None:
        return ready_ms[k]
    at = max(prev_shown_ms, ready_ms[k])
    while True:
        known = bisect.bisect_right(ready_ms, at, lo=k)
        fl = source_floor(ready_ms[:known], known - k) if follow_source else 0.0
        t = release_time(ready_ms[k], prev_shown_ms, max(interval_ms, fl))
        if known < len(ready_ms) and ready_ms[known] < t:  # an arrival before then: re-evaluate
            at = ready_ms[known]
            continue
        return t


def display_ms(ready_ms, interval_ms: float, interval_after_ms: float | None = None,
               handoff_ms: float | None = None, follow_source: bool = False) -> list[float]:
    """Shown times (ms) of tokens ready at `ready_ms` (ms, one per answer token, in order) under the
    speed controller (`release_time`, as `SpeedController` runs it): token 0 when ready, token k at
    max(ready[k], shown[k-1] + I), where I is `interval_ms`, or `interval_after_ms` for a token the
    display turns to at or after `handoff_ms` (the moment the device takes over and the interval
    drops to its pace; the display turns to token k at max(shown[k-1], ready[k])). `follow_source`:
    before the hand-off (the tokens are the cloud's) I is at least the `source_floor` (`release_ms`),
    as `SpeedController.floor_ms` holds it on the real device."""
    shown: list[float] = []
    ready_ms = list(ready_ms)
    for k, r in enumerate(ready_ms):
        prev = shown[-1] if shown else None
        at = r if prev is None else max(prev, r)
        turned = handoff_ms is not None and at >= handoff_ms  # the device's pace from here on
        iv = interval_after_ms if turned and interval_after_ms is not None else interval_ms
        shown.append(release_ms(k, ready_ms, prev, iv, follow_source and not turned))
    return shown


def tpot_p90_ms(shown_ms) -> float | None:
    """The user-visible TPOT of one answer: the 90th percentile (linear interpolation) of its
    inter-token gaps as shown, ms (the per-request TPOT of DistServe / vLLM's goodput). shown_ms:
    shown times of its tokens, ms, ascending. None for an answer of fewer than 2 tokens (no gap)."""
    if len(shown_ms) < 2:
        return None
    return float(np.percentile(np.diff(np.asarray(shown_ms, dtype=np.float64)), 90))


def count_stalls(shown_ms, pace_ms, target_tpot_ms: float, stall_factor: float = 2.0) -> int:
    """Stalls of a shown stream: gaps between consecutive shown times (`shown_ms`, ms) longer than
    `stall_factor` x max(target_tpot_ms, the interval in force when the later token was shown).
    `pace_ms[k]` is that interval for token k (a number: the same for every token)."""
    shown = np.asarray(shown_ms, dtype=np.float64)
    if shown.size < 2:
        return 0
    pace = np.broadcast_to(np.asarray(pace_ms, dtype=np.float64), shown.shape)[1:]
    return int((np.diff(shown) > stall_factor * np.maximum(target_tpot_ms, pace)).sum())


def tpot_from_arrivals(times_ms) -> float | None:
    """Mean time per output token of a stream from its arrival times (ms): (last - first) /
    (count - 1); None with fewer than 2 arrivals."""
    n = len(times_ms)
    return (times_ms[-1] - times_ms[0]) / (n - 1) if n > 1 else None


@dataclass
class SpeedController:
    """Pacing state of one answer. Times are ms on any monotonic clock.

    Attributes:
        target_tpot_ms: the TPOT the user should see (ms per token).
        interval_ms: the current release interval (defaults to the target; the settings algorithm
            may set it lower or higher during a request).
        floor_ms: the source's sustained pace while cloud tokens are shown and the display has
            caught up with them (`source_floor`, ms/token); tokens are released at
            max(interval_ms, floor_ms); 0 = no floor.
        stall_factor: a gap above stall_factor x max(target_tpot_ms, interval_ms in force for that
            gap) counts as a stall.
    """

    target_tpot_ms: float = 50.0
    interval_ms: float | None = None
    stall_factor: float = 2.0
    floor_ms: float = 0.0
    shown_ms: list[float] = field(default_factory=list)
    pace_ms: list[float] = field(default_factory=list)  # interval in force when each token was shown
    late_ms: list[float] = field(default_factory=list)  # how long after its release each token was shown

    def __post_init__(self):
        if self.target_tpot_ms <= 0:
            raise ValueError(f"target_tpot_ms must be > 0, got {self.target_tpot_ms}")
        if self.interval_ms is None:
            self.interval_ms = self.target_tpot_ms

    def release_at(self, ready_ms: float) -> float:
        """When to show the next token, ready since `ready_ms` (`release_time`)."""
        return release_time(ready_ms, self.shown_ms[-1] if self.shown_ms else None, self.pace)

    @property
    def pace(self) -> float:
        """The release interval in force: max(interval_ms, floor_ms) (ms)."""
        return max(self.interval_ms, self.floor_ms)

    def shown(self, t_ms: float, release_ms: float | None = None) -> None:
        """Record that the next token was shown at `t_ms`, due at `release_ms` (the `release_at` the
        display waited for; None: on time). Its lateness, t_ms - release_ms (ms, >= 0), is the time
        the display's own loop took to get to a token that was due (`late_ms`)."""
        self.shown_ms.append(t_ms)
        self.pace_ms.append(self.pace)
        self.late_ms.append(0.0 if release_ms is None else max(t_ms - release_ms, 0.0))

    def gaps(self) -> np.ndarray:
        """Inter-token gaps as shown (ms), float64 [n_shown - 1]."""
        return np.diff(np.asarray(self.shown_ms, dtype=np.float64))

    def stats(self, start_ms: float) -> dict:
        """ttft_ms (first shown - start), tpot_ms_p50, tpot_ms_max and stalls of the shown stream."""
        g = self.gaps()
        return {
            "ttft_ms": (self.shown_ms[0] - start_ms) if self.shown_ms else float("nan"),
            "tpot_ms_p50": float(np.median(g)) if g.size else 0.0,
            "tpot_ms_max": float(g.max()) if g.size else 0.0,
            "stalls": count_stalls(self.shown_ms, self.pace_ms, self.target_tpot_ms, self.stall_factor),
        }
