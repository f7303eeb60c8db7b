"""The device's split policy without I/O: the phase table (every path to DONE, the one hand-off
transition, illegal events), and the plan / replan / catch-up / Done decisions on the shipped
device profiles (device/profiles/*.json) and the client's default cloud estimate."""
from __future__ import annotations

import numpy as np
import pytest

from relayinfer.device.policy import (
    HOLD, IGNORED, MODE_OF, TRANSITIONS, Event, HandOff, Phase, PhaseError, Phases, PlanInput, Prefill, Progress,
    Replan, catch_up_step, moved, on_done, plan, replan, replan_held, stall_is_fault)
from relayinfer.device.profiles import load_profile
from relayinfer.device.settings import CatchUp, CloudEstimate, Timing, catch_up, simulate
from relayinfer.device.virtual import profile_timing

E, P = Event, Phase


def _walk(*events: Event) -> Phases:
    ph = Phases()
    for e in events:
        ph.fire(e)
    return ph


@pytest.mark.parametrize("events,received,mode", [
    ([E.START_SPLIT, E.PROMPT_PREFILLED], 7, "split"),  # catches up at 7, then decodes
    ([E.START_SPLIT, E.PROMPT_PREFILLED], 0, "device-only"),  # ready before the first cloud token
    ([E.START_SPLIT, E.CLOUD_FAULT, E.PROMPT_PREFILLED], 3, "split"),  # the device takes over after a fault
    ([E.START_SPLIT, E.CLOUD_FAULT], 0, "device-only"),  # a fault before token 0
    ([E.NO_CLOUD, E.PROMPT_PREFILLED], 0, "device-only"),  # no cloud at all
])
def test_hand_off_is_one_transition_and_the_mode_follows_the_phase(events, received, mode):
    ph = _walk(*events)
    assert ph.takes_cloud_tokens is (ph.phase is P.CATCHING_UP)
    assert ph.hand_off(received, received) == received and ph.handoff == received
    assert not ph.takes_cloud_tokens  # from the hand-off on, cloud tokens are dropped
    assert ph.fire(E.CLOUD_FAULT) is ph.phase  # the cloud is no longer needed: a fault changes nothing
    ph.fire(E.ANSWER_ENDED)
    assert ph.done and ph.mode == mode


@pytest.mark.parametrize("events,mode", [
    ([E.START_SPLIT], "cloud-only"),  # the answer ended while the device prefilled its prompt
    ([E.START_SPLIT, E.PROMPT_PREFILLED], "cloud-only"),  # ... or while it caught up
    ([E.START_CLOUD_ONLY], "cloud-only"),
    ([E.START_SPLIT, E.DEVICE_FAILED], "cloud-only"),  # the cloud streams to the end
])
def test_answers_the_cloud_ends_are_cloud_only(events, mode):
    ph = _walk(*events, E.ANSWER_ENDED)
    assert ph.done and ph.handoff is None and ph.mode == mode


def test_a_cloud_fault_with_no_device_behind_ends_the_answer():
    assert _walk(E.START_CLOUD_ONLY).fire(E.CLOUD_FAULT) is P.DONE
    assert _walk(E.START_SPLIT, E.DEVICE_FAILED).fire(E.CLOUD_FAULT) is P.DONE
    assert _walk(E.START_SPLIT).fire(E.CLOUD_FAULT) is P.FAULT  # a device behind: it takes over


def test_illegal_events_raise():
    with pytest.raises(PhaseError, match="hand_off is not allowed in phase cloud_paced"):
        _walk(E.START_SPLIT).hand_off(4, 4)  # no hand-off before the device's prompt is prefilled
    with pytest.raises(PhaseError, match="hand-off at 3 with 5 cloud tokens received"):
        _walk(E.START_SPLIT, E.PROMPT_PREFILLED).hand_off(3, 5)  # tokens 3, 4 not covered
    with pytest.raises(PhaseError, match="answer_ended is not allowed in phase done"):
        _walk(E.START_SPLIT, E.ANSWER_ENDED).fire(E.ANSWER_ENDED)
    with pytest.raises(PhaseError):
        _walk(E.NO_CLOUD).fire(E.START_SPLIT)


def test_every_phase_reaches_done_and_every_end_has_a_mode():
    reach = {P.DONE}
    for _ in TRANSITIONS:  # fixed point of "has a move into a phase that reaches DONE"
        reach |= {ph for ph, row in TRANSITIONS.items() if any(n in reach for n in row.values() if n != IGNORED)}
    assert reach == set(Phase)
    into_done = {ph for ph, row in TRANSITIONS.items() if P.DONE in row.values()}
    assert into_done == set(MODE_OF)


# -- plan / replan on the shipped profiles --------------------------------------------------------------

def _timing(profile: str, prompt_tokens: int) -> Timing:
    c = CloudEstimate()  # a fresh client's pessimistic cloud: TTFT 150 ms + 1 ms/token, TPOT 40 ms
    return profile_timing(load_profile(profile), c.ttft_ms(prompt_tokens), c.tpot_ms)


def test_plan_on_the_laptop_hands_off_and_the_phone_streams_a_long_prompt_to_the_end():
    laptop = plan(PlanInput(_timing("laptop", 512), 512, 256, 50.0))
    assert laptop.budget is not None and 0 < laptop.budget < 256 and not laptop.held
    assert laptop.interval_ms == 50.0 and laptop.device_prompt_tokens == 512
    # the budget is a plan, not a cap: the reason says that the device may extend it (ExtendBudget)
    assert laptop.reason.startswith(f"a cloud budget of {laptop.budget} tokens, then the device takes over")
    assert "extends the budget if its prefill runs late" in laptop.reason
    phone = plan(PlanInput(_timing("phone", 2048), 2048, 256, 50.0))
    # 2048 x 16.67 ms of prefill cannot be caught up within 256 tokens at the phone's 52.6 ms decode pace
    assert phone.budget is None and phone.held and phone.interval_ms == 52.6
    assert "cannot catch up within 256 tokens" in phone.reason and "2048 tokens" in phone.reason


def test_plan_with_refinement_and_with_the_kv_hand_off_prefills_less():
    t = _timing("phone", 256)
    full = plan(PlanInput(t, 256, 256, 50.0))
    refined = plan(PlanInput(t, 256, 256, 50.0, refine=0.25))
    kv = plan(PlanInput(t, 256, 256, 50.0, kv_transfer_ms=20.0))
    assert (full.device_prompt_tokens, refined.device_prompt_tokens, kv.device_prompt_tokens) == (256, 64, 1)
    assert full.budget is not None and kv.budget < refined.budget < full.budget
    # a 512-token prompt the phone cannot catch up on becomes a hand-off once refined to a quarter
    assert plan(PlanInput(_timing("phone", 512), 512, 256, 50.0)).held
    assert not plan(PlanInput(_timing("phone", 512), 512, 256, 50.0, refine=0.25)).held


def test_replan_extends_the_budget_when_the_device_falls_behind_its_plan():
    """Phone, 256-token prompt, planned budget 130 against the estimated cloud (TTFT 406 ms, TPOT
    40 ms). Re-planned with two measured arrivals and the whole prompt still to prefill: at 0.4 s
    (an earlier first token, 300 ms, moves the display slots earlier) a few more tokens; at 2 s
    (the device started late) many more; a 120 ms/token cloud slows the display enough that the
    budget stands and nothing changes (the display follows that cloud through the source floor,
    not through its interval)."""
    t = _timing("phone", 256)
    p = plan(PlanInput(t, 256, 256, 50.0))
    assert p.budget == 130

    def at(now_ms: float, tpot_ms: float) -> Replan | None:
        return replan(t, Progress(now_ms, (300.0, 300.0 + tpot_ms), 256), p.budget, 256, 50.0, p.interval_ms)

    assert at(400.0, 40.0) == Replan(135, 52.6) and at(2000.0, 40.0) == Replan(184, 52.6)
    # a 120 ms/token cloud: the budget stands, the interval too
    assert at(400.0, 120.0) is None and at(2000.0, 120.0) is None
    assert replan(t, Progress(400.0, (300.0, 340.0), 256), 140, 256, 50.0, 52.6) is None  # nothing to change


def test_a_held_device_is_released_when_the_measured_cloud_is_slower():
    """A 1000-token prompt on a phone-like fit: against the estimated cloud (TPOT 40 ms) the device
    cannot catch up within 256 tokens and holds (cloud to the end). The device re-plans when a
    measured figure moved (`moved`): the first token (TTFT 1 s, not the planned 1.15 s) and the
    second (TPOT measured); at 200 ms a token the re-plan after cloud token 2 finds a hand-off (the
    interval is the device's 79.1 ms pace; the display follows the slower cloud through its source
    floor); at the estimated 40 ms nothing moves after token 1 and
    it keeps holding."""
    c = CloudEstimate(ttft_base_ms=150.0, prefill_ms_per_token=1.0, tpot_ms=40.0)
    t = Timing(24.0, 16.57, 79.1, c.ttft_ms(1000), c.tpot_ms)
    p = plan(PlanInput(t, 1000, 256, 50.0))
    assert p.held and p.budget is None

    def released_at(tpot_ms: float):
        planned, replans = t, []
        for k in range(1, 17):  # cloud token k measured at 1 s + k x TPOT; re-planned when a figure moved
            progress = Progress(1000.0 + (k - 1) * tpot_ms, tuple(1000.0 + i * tpot_ms for i in range(k)), 1000)
            if not moved(planned, progress.measured(t)):
                continue
            planned = progress.measured(t)
            replans.append(k)
            interval = replan_held(t, progress, p.device_prompt_tokens, 256, 50.0)
            if interval is not None:
                return k, interval, replans
        return None, None, replans

    assert released_at(200.0) == (2, 79.1, [1, 2])
    assert released_at(40.0) == (None, None, [1])  # nothing moved after the first token: no re-plan


def test_moved_is_a_relative_change_of_a_figure_the_plan_rests_on():
    t = Timing(0.0, 16.67, 52.6, cloud_ttft_ms=1000.0, cloud_tpot_ms=40.0)
    assert not moved(t, t) and not moved(t, Timing(0.0, 16.67, 52.6, 1090.0, 43.0, device_start_ms=500.0))
    assert moved(t, Timing(0.0, 16.67, 52.6, 1200.0, 40.0))  # TTFT +20 %
    assert moved(t, Timing(0.0, 16.67, 52.6, 1000.0, 94.0))  # the cloud is slower under load
    assert moved(t, Timing(0.0, 8.0, 52.6, 1000.0, 40.0))  # the device prefills faster than its fit


# -- the display interval as a decision; the per-call base charged per call --------------------------

def test_a_long_phone_prompt_hands_off_at_a_slowed_display_within_the_tpot_bound():
    """The phone prefills 60 tokens/s (16.67 ms/token): a 709-token prompt takes 11.8 s on it, and
    at the 52.6 ms display interval (its decode pace) 256 tokens are shown in 13.5 s, too little for
    prompt + catch-up, so at that pace the plan is cloud-to-the-end. Allowed a display up to 90 ms
    (1.8 x the 50 ms target), the plan slows the display to the least interval for which a hand-off
    fits with the device answering at least a fifth of the answer; the simulated timeline has no
    late token and no gap above 90 ms."""
    t = _timing("phone", 709)
    assert plan(PlanInput(t, 709, 256, 50.0)).held
    p = plan(PlanInput(t, 709, 256, 50.0, max_interval_ms=90.0))
    assert not p.held and p.budget < 256 and 52.6 < p.interval_ms <= 90.0
    assert "slowed from 53 ms" in p.reason, p.reason
    sim = simulate(t, 709, 256, p.budget, p.interval_ms, 50.0)
    assert sim["late"] == 0 and sim["stalls"] == 0 and sim["tpot_max_ms"] <= p.interval_ms + 1e-6
    # the budget leaves the device the margin's share of the answer (20 %), and a slower display than
    # that needs is not chosen: 1 ms faster and the budget would leave less (or none fits)
    assert p.budget <= 256 / 1.2
    less = plan(PlanInput(t, 709, 256, 50.0, max_interval_ms=p.interval_ms - 1.0))
    assert less.held or less.budget > 256 / 1.2
    # a short prompt keeps the normal pace
    assert plan(PlanInput(_timing("phone", 256), 256, 256, 50.0, max_interval_ms=90.0)).interval_ms == 52.6


def test_a_per_call_base_is_charged_per_call_not_per_token():
    """The LTE run's device fit had a 130 ms per-call base (a), 16.67 ms/token (b) and a 79 ms decode
    step (d); its cloud TTFT was 2.5 s and TPOT 89 ms. a + b = 147 ms exceeds the display interval,
    yet the device catches up: each catch-up call prefills every token received (a paid once per
    call), so the hand-off is planned. Charged per token (a + b a token) the same device could not."""
    t = Timing(129.6, 16.67, 79.1, cloud_ttft_ms=2500.0, cloud_tpot_ms=89.0)
    p = plan(PlanInput(t, 512, 256, 50.0, max_interval_ms=90.0))
    assert t.prefill_ms_base + t.prefill_ms_per_token > p.interval_ms and not p.held
    now, rule, calls = t.prefill_ms(512), CatchUp(), []  # the catch-up on the model's clock, call by call
    while isinstance(step := catch_up_step(rule, t.arrived(now, p.budget), held=False), Prefill):
        calls.append(step.end - step.start)
        now += t.prefill_ms(step.end - step.start)
        rule.prefilled(step.end)
    assert (step.index, now) == catch_up(t, 512, p.budget) and sum(calls) == step.index
    assert len(calls) < step.index / 4  # batches of many tokens: a is paid len(calls) times, not h times
    assert simulate(t, 512, 256, p.budget, p.interval_ms, 50.0)["late"] == 0
    per_token = Timing(0.0, t.prefill_ms_base + t.prefill_ms_per_token, 79.1, 2500.0, 89.0)
    assert plan(PlanInput(per_token, 512, 256, 50.0, max_interval_ms=90.0)).held


def test_a_held_device_is_released_by_its_measured_prefill_before_any_cloud_token():
    """Not only tokens move the plan: the device's own prefill rate, measured on its first prompt
    chunks, does. Planned with the phone's 16.67 ms/token, a 1140-token prompt holds; the first
    chunks measure 8 ms/token (with 2 s of the prompt done), and the re-plan releases the device
    before the cloud's first token (a late first token moves the TTFT the same way)."""
    t = _timing("phone", 1140)
    p = plan(PlanInput(t, 1140, 256, 50.0, max_interval_ms=90.0))
    assert p.held
    slow = Progress(600.0, (), 1140 - 32, device_ms_per_token=16.67)  # as planned: keep holding
    assert replan_held(t, slow, 1140, 256, 50.0, 90.0) is None
    fast = Progress(600.0, (), 1140 - 32, device_ms_per_token=8.0)
    assert moved(t, fast.measured(t)) and replan_held(t, fast, 1140, 256, 50.0, 90.0) is not None
    # a device held by the plan that covered every token received can go at once
    caught = Progress(9000.0, tuple(1200.0 + 40.0 * i for i in range(100)), 0, 16.67, behind=0)
    assert replan_held(t, caught, 1140, 256, 50.0, 90.0) == 52.6


def test_replan_slows_the_display_when_the_device_falls_far_behind():
    """Planned at 52.6 ms with a budget, the device measures 30 ms/token instead of 16.67 on a
    512-token prompt: more cloud tokens alone no longer fit in 256, so the re-plan also slows the
    display (at most to 90 ms) and asks for a larger budget; without the slower bound it asks for
    the whole answer (the cloud streams to the end)."""
    t = _timing("phone", 300)
    p = plan(PlanInput(t, 300, 256, 50.0, max_interval_ms=90.0))
    assert not p.held and p.interval_ms == 52.6
    behind = Progress(1000.0, (450.0, 490.0), 300 - 64, device_ms_per_token=30.0)
    r = replan(t, behind, p.budget, 256, 50.0, p.interval_ms, 90.0)
    assert r is not None and 52.6 < r.interval_ms <= 90.0 and p.budget < r.budget < 256
    assert replan(t, behind, p.budget, 256, 50.0, p.interval_ms) == Replan(256, 52.6)


# -- catching up ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile,prompt_tokens,budget", [("phone", 64, 40), ("laptop", 512, 30), ("phone", 256, 200)])
def test_catch_up_steps_on_a_simulated_clock_hand_off_where_the_model_says(profile, prompt_tokens, budget):
    t = _timing(profile, prompt_tokens)
    now, rule = t.prefill_ms(prompt_tokens), CatchUp()
    while not isinstance(step := catch_up_step(rule, t.arrived(now, budget), held=False), HandOff):
        assert isinstance(step, Prefill) and step.start == rule.covered < step.end
        now += t.prefill_ms(step.end - step.start)
        rule.prefilled(step.end)
    assert (step.index, now) == catch_up(t, prompt_tokens, budget)


def test_a_held_device_prefills_small_chunks_and_holds_when_caught_up():
    rule = CatchUp()
    assert catch_up_step(rule, 100, held=True, chunk=32) == Prefill(0, 32)
    rule.prefilled(32)
    assert catch_up_step(rule, 100, held=False, chunk=32) == Prefill(32, 100)  # released: one batch
    rule.prefilled(100)
    assert catch_up_step(rule, 100, held=True) == HOLD
    assert catch_up_step(rule, 100, held=False) == HandOff(100)
    with pytest.raises(ValueError):
        catch_up_step(rule, 99, held=False)  # tokens cannot be un-received


# -- the cloud's signals -------------------------------------------------------------------------------

def test_what_the_clouds_done_means_in_each_phase():
    assert on_done(P.CLOUD_PACED, "budget") == on_done(P.CATCHING_UP, "budget") == "take-over"
    assert on_done(P.CLOUD_ALONE, "eos") == on_done(P.CLOUD_ALONE, "length") == "end"
    assert on_done(P.CLOUD_PACED, "cancel") == on_done(P.CLOUD_ALONE, "budget") == "fault"
    assert on_done(P.CATCHING_UP, "eos") == "fault"  # the finish came on no Token: the stream ended early
    assert on_done(P.HANDED_OFF, "stop") == on_done(P.DONE, "eos") == "ignore"


def test_a_silent_cloud_is_a_fault_unless_the_device_works_on_alone():
    assert not stall_is_fault(device_busy=True, waiting_kv=False, held=False)
    assert stall_is_fault(device_busy=True, waiting_kv=True, held=False)  # it waits for the cloud's KV
    assert stall_is_fault(device_busy=True, waiting_kv=False, held=True)  # the plan holds it for the cloud
    assert stall_is_fault(device_busy=False, waiting_kv=False, held=False)


def test_device_pace_follows_the_measured_decode_steps_once_there_are_enough():
    from relayinfer.device.policy import PACE_STEPS, device_pace

    # a calibration taken under load (127 ms) sets the pace only until PACE_STEPS steps are measured
    assert device_pace(50.0, 127.0, []) == 127.0
    assert device_pace(50.0, 127.0, [53.0] * (PACE_STEPS - 1)) == 127.0
    assert device_pace(50.0, 127.0, [53.0] * PACE_STEPS) == 53.0
    # the median of the last steps: one slow call (a page fault, a busy core) does not move it
    assert device_pace(50.0, 127.0, [200.0, 300.0, 54.0, 400.0, 55.0, 56.0]) == 56.0
    # a device slower than its calibration is shown at its real pace, never faster than the target
    assert device_pace(50.0, 40.0, [90.0, 95.0, 92.0]) == 92.0
    assert device_pace(50.0, 40.0, [20.0, 21.0, 22.0]) == 50.0


def test_one_slow_cloud_gap_does_not_slow_the_display_until_the_hand_off():
    """A real request's arrivals (118-token prompt, phone fit, target 90 ms): the first cloud gap
    took 329 ms (another request's prefill shared the cloud's step), the next ones 63 ms. Re-planned
    after each arrival, no interval above the target is set (the cloud's pace is not a setting), so
    the display, following the source floor, shows the backlog at 90 ms once the cloud speeds up
    instead of at 329 ms until the hand-off."""
    from relayinfer.device.speed import display_ms

    t = Timing(0.0, 16.67, 52.6, 300.0, 60.0)
    p = plan(PlanInput(t, 118, 256, 90.0, max_interval_ms=162.0))
    assert not p.held and p.interval_ms == 90.0
    ready = [303.8, 632.4] + [632.4 + 63.2 * i for i in range(1, 25)]
    interval = p.interval_ms
    for k in range(2, len(ready) + 1):
        r = replan(t, Progress(ready[k - 1], tuple(ready[:k]), 118 - 30), p.budget, 256, 90.0, interval, 162.0)
        interval = max(interval, r.interval_ms) if r is not None else interval
        assert interval == 90.0, k
    shown = display_ms(ready, interval, follow_source=True)
    gaps = np.diff(shown)
    assert gaps[0] == pytest.approx(328.6) and max(gaps[2:]) <= 90.0 + 1e-6
    # with the cloud's measured pace as the interval (329 ms) the display would crawl
    assert np.diff(display_ms(ready, 328.6, follow_source=True))[2:].min() > 300.0
    # a caught-up held device is released at the device's pace, not at a slow cloud's
    assert replan_held(t, Progress(700.0, (303.8, 632.4), 0, behind=0), 118, 256, 90.0, 162.0) == 90.0
