"""The settings algorithm on simulated timelines (hypothesis) and the speed controller."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from relayinfer.device.settings import CatchUp, Timing, catch_up, choose_settings, device_fit, handoff_time, simulate
from relayinfer.device.speed import SpeedController

timings = st.builds(
    Timing,
    prefill_ms_base=st.floats(0, 200),
    prefill_ms_per_token=st.floats(0.5, 40),
    decode_ms_per_token=st.floats(5, 80),
    cloud_ttft_ms=st.floats(30, 2000),
    cloud_tpot_ms=st.floats(5, 60),
)
cases = dict(t=timings, prompt=st.integers(8, 2048), answer=st.integers(16, 256), target=st.floats(20, 100))


@settings(max_examples=150, deadline=None)
@given(**cases)
def test_no_stall_when_profile_is_exact(t, prompt, answer, target):
    s = choose_settings(t, prompt, answer, target)
    sim = simulate(t, prompt, answer, s.cloud_budget, s.interval_ms, target)
    assert sim["stalls"] == 0 and sim["late"] == 0
    assert s.interval_ms >= target and sim["tpot_max_ms"] <= s.interval_ms + 1e-6
    if s.cloud_budget is not None:
        assert 1 <= s.cloud_budget < answer and sim["handoff"] <= s.cloud_budget  # < when it caught the stream early
    else:  # cloud to the end only when the device could not catch up within the answer
        assert t.prefill_ms_per_token >= s.interval_ms or handoff_time(t, prompt, answer) > 0


@settings(max_examples=150, deadline=None)
@given(**cases, device_err=st.sampled_from([0.8, 1.2]), cloud_err=st.sampled_from([0.8, 1.0, 1.2]))
def test_bounded_stalls_when_profile_is_off_by_20_percent(t, prompt, answer, target, device_err, cloud_err):
    s = choose_settings(t, prompt, answer, target)
    truth = t.scaled(device=device_err, cloud=cloud_err)
    sim = simulate(truth, prompt, answer, s.cloud_budget, s.interval_ms, target)
    assert sim["stalls"] <= 1  # at most the one wait for a late hand-off


def test_budget_is_the_fewest_tokens_that_fit():
    t = Timing(0.0, 16.67, 52.6, cloud_ttft_ms=150.0, cloud_tpot_ms=20.0)  # phone-class device
    s = choose_settings(t, 512, 256, 60.0, margin=0.0)
    assert s.interval_ms == 60.0
    # closed form of the docstring, one batch: N >= (D0 + a - T) / (I - b)
    bound = (16.67 * 512 - 150.0) / (60.0 - 16.67)
    assert abs(s.cloud_budget - bound) <= 2
    assert simulate(t, 512, 256, s.cloud_budget - 1, 60.0, 60.0)["late"] > 0  # one fewer is too few


def test_device_that_cannot_catch_up_gets_cloud_to_the_end():
    t = Timing(0.0, 80.0, 40.0, cloud_ttft_ms=100.0, cloud_tpot_ms=20.0)  # prefill 80 ms/token > interval
    s = choose_settings(t, 100, 64, 50.0)
    assert s.cloud_budget is None and s.handoff_ms is None


def test_speed_controller_paces_and_counts_stalls():
    sc = SpeedController(target_tpot_ms=50.0)
    for ready in [100.0, 101.0, 102.0, 103.0, 400.0, 401.0]:  # a burst, then a late token
        sc.shown(sc.release_at(ready))
    assert sc.shown_ms == [100.0, 150.0, 200.0, 250.0, 400.0, 450.0]
    st_ = sc.stats(0.0)
    assert st_["ttft_ms"] == 100.0 and st_["tpot_ms_p50"] == 50.0 and st_["tpot_ms_max"] == 150.0
    assert st_["stalls"] == 1


def test_waiting_for_the_refined_prompt_needs_a_larger_budget():
    t = Timing(0.0, 16.67, 52.6, cloud_ttft_ms=800.0, cloud_tpot_ms=20.0)
    now = choose_settings(t, 256, 256, 60.0)
    later = choose_settings(Timing(0.0, 16.67, 52.6, 800.0, 20.0, device_start_ms=800.0), 256, 256, 60.0)
    assert later.cloud_budget > now.cloud_budget
    sim = simulate(Timing(0.0, 16.67, 52.6, 800.0, 20.0, device_start_ms=800.0), 256, 256, later.cloud_budget, 60.0, 60.0)
    assert sim["late"] == 0 and sim["stalls"] == 0


def test_cloud_estimate_fits_base_and_slope():
    from relayinfer.device.settings import CloudEstimate

    est = CloudEstimate()
    for n in (64, 512, 128, 2048):
        est.update(n, 300.0 + 4.0 * n, 25.0)
    assert abs(est.ttft_base_ms - 300.0) < 1e-6 and abs(est.prefill_ms_per_token - 4.0) < 1e-9
    assert abs(est.ttft_ms(1000) - 4300.0) < 1e-6 and 25.0 <= est.tpot_ms < 40.0


def test_cloud_estimate_holds_its_first_measurements():
    """One request measured: the estimate at its prompt length is its TTFT (a fast cloud, 80 ms at
    114 tokens, is below the default slope of 1 ms/token: the slope is lowered, not the base
    clamped to 0, which gave 114 ms) and its TPOT is the measured one, not half the default."""
    from relayinfer.device.settings import CloudEstimate

    est = CloudEstimate()
    est.update(114, 80.0, 54.0)
    assert est.ttft_ms(114) == pytest.approx(80.0) and est.ttft_base_ms >= 0.0 and est.tpot_ms == 54.0
    est.update(114, 100.0, 60.0)  # the same length again: through the mean; TPOT averaged from here on
    assert est.ttft_ms(114) == pytest.approx(90.0) and est.tpot_ms == pytest.approx(57.0)
    slow = CloudEstimate()
    slow.update(100, 900.0, None)  # above the default line: the slope stays, the base moves
    assert slow.prefill_ms_per_token == 1.0 and slow.ttft_ms(100) == pytest.approx(900.0)
    assert not slow.tpot_measured and slow.tpot_ms == 40.0


def test_stalls_judged_against_the_interval_in_force():
    """A gap is a stall against the pace when it was shown: cloud-paced gaps of 180 ms under a
    180 ms interval are not stalls after the interval drops to the device's 40 ms."""
    sc = SpeedController(target_tpot_ms=40.0, interval_ms=180.0)
    for t in (0.0, 180.0, 360.0):
        sc.shown(t)
    sc.interval_ms = 40.0  # the hand-off: device pace from now on
    for t in (400.0, 440.0, 640.0):  # the last gap (200 ms) is a stall at a 40 ms pace
        sc.shown(t)
    assert sc.stats(0.0)["stalls"] == 1


@settings(max_examples=60, deadline=None)
@given(t=timings, prompt=st.integers(0, 2048), budget=st.integers(1, 256))
def test_virtual_device_hands_off_where_the_model_says(t, prompt, budget):
    """The virtual device's loop (`virtual.device_loop`) on a clock its sleeps advance, fed the
    cloud tokens of the same timing, hands off at the index and time `catch_up` predicts."""
    import asyncio

    from relayinfer.device.virtual import device_loop

    clock = [t.device_start_ms]

    async def sleep(s):
        clock[0] += s * 1e3

    h = asyncio.run(device_loop(t, prompt, lambda: t.arrived(clock[0], budget), lambda: False, sleep))
    want_h, want_ms = catch_up(t, prompt, budget)
    assert h == want_h and clock[0] == pytest.approx(want_ms, abs=1e-6)
    assert 0 <= h <= budget and (h == budget or h == t.arrived(clock[0], budget))  # caught up or budget spent


def test_catch_up_rule_batches_every_received_token():
    rule = CatchUp()
    assert rule.next_batch(0) is None  # nothing received yet: ready first, the device answers alone (h = 0)
    assert rule.next_batch(5) == (0, 5)
    rule.prefilled(5)
    assert rule.next_batch(5) is None and rule.next_batch(7) == (5, 7)
    with pytest.raises(ValueError, match="received"):
        rule.next_batch(3)


def test_device_fit_is_the_envelope_of_calibration_and_profile():
    """The shipped phone profile over a calibration of this machine's ONNX engine (the values of
    bench/SPLIT.md: a = 130 ms, b = 3.4 ms/token, d = 79 ms): the fit follows max(local, phone)
    at 8 and 256 tokens instead of 130 + 16.7 n, so a small catch-up batch is not overstated."""
    from relayinfer.device.profiles import load_profile

    p = load_profile("phone")
    phone = (p.prefill_ms_base, p.prefill_ms_per_token, p.decode_ms_per_token)
    local = (129.6, 3.38, 79.1)
    a, b, d = device_fit(local, phone)
    env = lambda n: max(local[0] + local[1] * n, phone[0] + phone[1] * n)  # noqa: E731
    assert a + b * 8 == pytest.approx(env(8)) and a + b * 256 == pytest.approx(env(256))
    assert d == max(local[2], phone[2]) and a < local[0] and b <= phone[1]
    assert device_fit(local, None) == local
    # with the fit, a phone-paced device catches a 89 ms/token cloud after a 512-token prompt within 256 tokens
    t = Timing(a, b, d, cloud_ttft_ms=2500.0, cloud_tpot_ms=89.0)
    new, old = choose_settings(t, 512, 256, 50.0), choose_settings(Timing(129.6, 16.67, 79.1, 2500.0, 89.0), 512, 256, 50.0)
    assert new.cloud_budget is not None and new.handoff_ms < old.handoff_ms  # max(a), max(b) overstated the device


def _cloud_stream(n: int, seed: int) -> list[float]:
    """Arrival times (ms) of a CPU cloud decoding at 110-175 ms a token (the measured range on
    665-1,177-token contexts beside a busy device core)."""
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.uniform(110.0, 175.0)
    return out


def _run_display(ctl: SpeedController, ready: list[float]) -> list[float]:
    """Shown times of `ready` (ms) as split._Run.display runs the controller: the floor from the
    arrivals known and the backlog, re-evaluated at each arrival before a pending release."""
    from relayinfer.device.speed import source_floor

    shown, now = [], 0.0
    for k, r in enumerate(ready):
        now = max(now, r)
        while True:
            known = sum(1 for x in ready if x <= now)
            ctl.floor_ms = source_floor(ready[:known], known - k)
            t = ctl.release_at(r)
            if known < len(ready) and ready[known] < t:
                now = ready[known]                       # an arrival wakes the display first
                continue
            break
        ctl.shown(t)
        shown.append(t)
        now = t
    return shown


def test_a_burst_after_a_long_wait_is_shown_at_the_interval():
    """Cloud tokens queued on the link behind a KV transfer arrive together 4 s after token 0:
    token 1 is shown on arrival, the rest at the interval, not at the pace of the wait."""
    from relayinfer.device.speed import display_ms

    ready = [0.0] + [4000.0 + 0.1 * i for i in range(32)]
    ctl = SpeedController(target_tpot_ms=50.0, interval_ms=53.0)
    shown = _run_display(ctl, ready)
    assert shown == pytest.approx(display_ms(ready, 53.0, follow_source=True))
    assert shown[1] == pytest.approx(4000.0)
    assert np.diff(shown[1:]) == pytest.approx([53.0] * 31)


@pytest.mark.parametrize("seed", range(5))
def test_display_follows_a_cloud_slower_than_its_interval_without_stalls(seed):
    from relayinfer.device.speed import count_stalls, display_ms

    ready = _cloud_stream(60, seed)
    plain = display_ms(ready, 53.0)                       # the display outruns the cloud, then waits
    assert count_stalls(plain, [53.0] * len(plain), 50.0) > 0
    ctl = SpeedController(target_tpot_ms=50.0, interval_ms=53.0)
    shown = _run_display(ctl, ready)
    assert shown == pytest.approx(display_ms(ready, 53.0, follow_source=True))
    assert count_stalls(ctl.shown_ms, ctl.pace_ms, 50.0) == 0
    assert all(p >= 53.0 for p in ctl.pace_ms) and max(ctl.pace_ms) <= 175.0
    # the same average pace as the cloud: nothing is held back for long
    assert shown[-1] - ready[-1] < 2 * 175.0


def test_source_floor_is_lifted_at_the_hand_off():
    from relayinfer.device.speed import display_ms

    ready = [0.0, 150.0, 300.0, 450.0, 460.0, 470.0, 480.0]     # device tokens from 455 ms on, every 10 ms
    got = display_ms(ready, 53.0, 53.0, 455.0, follow_source=True)
    assert got[:4] == pytest.approx([0.0, 150.0, 300.0, 450.0])
    assert got[4:] == pytest.approx([503.0, 556.0, 609.0])          # the device's pace, no cloud floor


def test_cost_line_is_a_non_negative_least_squares_fit():
    from relayinfer.device.settings import cost_line

    xs = [32, 128, 256, 512]
    base, slope = cost_line(xs, [5.0 + 0.25 * x for x in xs])  # an exact line is recovered
    assert base == pytest.approx(5.0) and slope == pytest.approx(0.25)
    # noise on a flat cost whose free fit slopes down: the flat line at the mean
    ys = [41.0, 40.0, 39.5, 38.0]
    assert np.polyfit(xs, ys, 1)[0] < 0
    assert cost_line(xs, ys) == (pytest.approx(float(np.mean(ys))), 0.0)
    # a steep cost whose free fit crosses below zero at x = 0: the line through the origin
    ys = [1.0, 60.0, 125.0, 260.0]
    assert np.polyfit(xs, ys, 1)[1] < 0
    base, slope = cost_line(xs, ys)
    assert base == 0.0 and slope == pytest.approx(np.dot(xs, ys) / np.dot(xs, xs))
    # the fitted line's squared error is never worse than any other feasible candidate's
    for b, s in [(0.0, 0.5), (10.0, 0.4), (float(np.mean(ys)), 0.0)]:
        sse = lambda bb, ss: sum((bb + ss * x - y) ** 2 for x, y in zip(xs, ys))
        assert sse(base, slope) <= sse(b, s) + 1e-9
    with pytest.raises(ValueError, match="distinct x"):
        cost_line([64, 64], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal-length"):
        cost_line([1, 2, 3], [1.0, 2.0])


def test_cloud_estimate_never_learns_a_negative_prefill_cost():
    from relayinfer.device.settings import CloudEstimate

    est = CloudEstimate()
    for n, ttft in ((64, 310.0), (512, 300.0), (2048, 290.0)):  # noise: a longer prompt measured faster
        est.update(n, ttft, 25.0)
    assert est.prefill_ms_per_token == 0.0 and est.ttft_base_ms > 0
    assert est.ttft_ms(4096) >= est.ttft_ms(64)


def test_calibration_keeps_a_noisy_prefill_cost_non_negative(monkeypatch):
    """`device.calibrate.measure` on an engine whose longer prompts happened to time faster (a
    loaded machine): the profile's per-token cost is 0, not negative, and its base is their mean."""
    from relayinfer.device import calibrate

    clock = [0.0]
    cost_ms = {32: 21.0, 128: 20.0, 256: 19.0}

    class Engine:
        def warmup(self):
            pass

        def prefill(self, ids):
            clock[0] += cost_ms[len(ids)] / 1e3
            return None, object()

        def decode(self, tok, kv):
            clock[0] += 0.012
            return None, kv

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    prof = calibrate.measure(Engine(), decode_steps=3, repeats=1)
    assert prof.prefill_ms_per_token == 0.0 and prof.prefill_ms_base == pytest.approx(20.0)
    assert prof.decode_ms_per_token == pytest.approx(12.0)
