"""Virtual devices: a load generator that speaks the device side of the split protocol with a
profile's timing but runs no model.

One virtual request: connect + handshake (`open_channel`), send `Generate` (prompt ids, cloud
budget, optional refine ratio), receive `Token`s; the device's work is simulated by sleeping the
profile's prefill time (`Timing.prefill_ms`, the same cost as `DeviceProfile.prefill_ms`) of the
prompt (the kept prompt with refinement, once `RefinedPrompt` arrived), then of the cloud tokens
received meanwhile by the one catch-up rule of the settings model and the real `SplitSession`
(`settings.CatchUp`, run by `device_loop`); when it covers every token received it sends
`Stop{handoff}` (Stop{0}: it was ready before the first cloud token), waits for `Done` and closes.
After `Done(reason='budget')` it still catches up and takes over (no Stop is needed then). In
`cloud-only` mode it just receives to the end (`Done`).

Per request (`VirtualResult`, times in ms):
* ttft_ms: first `Token` arrival - `Generate` sent (the connect/handshake is before, not counted);
  with a hand-off at 0, when the device was ready (it answers alone).
* cloud_tokens: tokens the cloud streamed (`Done.cloud_tokens`, else tokens received).
* cloud_busy_ms: how long the cloud held the request (its KV cache and a slot in the worker's
  queue): `Done.prefill_ms` (Generate received -> first token ready, queueing included) + the stream
  duration (last Token's `t_cloud_ms` - first Token's `t_cloud_ms`).
* ok: the request got its first token and a `Done` within `timeout_s`, with no error.

`run_load` drives many of them with Poisson arrivals, bounded in count and in time;
`capacity_sweep` finds the highest rate at which the cloud still meets TTFT p99 <= a bound.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.messages import Done, Error, RefinedPrompt, Stop, Token
from relayinfer.protocol.model.decoding import SamplingParams, generate_message
from relayinfer.protocol.requests import RequestTable, RequestViolation, Role

from .policy import HOLD, HandOff, PlanInput, catch_up_step, plan
from .profiles import DeviceProfile, load_profile
from .settings import CatchUp, CloudEstimate, Timing

LOAD_MODES = ("split", "cloud-only")


@dataclass
class VirtualResult:
    """One virtual request (ms; see the module docstring for the definitions)."""

    prompt_tokens: int
    mode: str
    ok: bool
    ttft_ms: float | None = None
    cloud_tokens: int = 0
    cloud_busy_ms: float | None = None
    budget: int | None = None
    handoff: int | None = None
    device_prompt_tokens: int = 0
    total_ms: float | None = None
    error: str | None = None


def profile_timing(profile: DeviceProfile, cloud_ttft_ms: float = 0.0, cloud_tpot_ms: float = 0.0) -> Timing:
    """The settings model's `Timing` of a profile (its device fit; cloud T and c as given, ms)."""
    return Timing(profile.prefill_ms_base, profile.prefill_ms_per_token, profile.decode_ms_per_token,
                  cloud_ttft_ms, cloud_tpot_ms)


async def device_loop(t: Timing, prompt_tokens: int, received: Callable[[], int], finished: Callable[[], bool],
                      sleep: Callable[[float], Awaitable] = asyncio.sleep) -> int | None:
    """The simulated device: sleep `t.prefill_ms(prompt_tokens)`, then follow the real device's
    catch-up decisions (`policy.catch_up_step`) on the count `received()` of cloud tokens, sleeping
    each batch's `t.prefill_ms(n)` (`sleep` takes seconds); returns the hand-off index, or None when
    `finished()` says the cloud ended the answer first. With `received()` = `t.arrived(clock)` and a
    clock that `sleep` advances, it hands off exactly where and when `settings.catch_up` says (tested)."""
    if prompt_tokens:
        await sleep(t.prefill_ms(prompt_tokens) / 1e3)
    rule = CatchUp()
    while not finished():
        step = catch_up_step(rule, received(), held=False)
        if isinstance(step, HandOff):
            return step.index
        assert step != HOLD  # a virtual device is never held by its plan
        await sleep(t.prefill_ms(step.end - step.start) / 1e3)
        rule.prefilled(step.end)
    return None


def auto_budget(profile: DeviceProfile, prompt_tokens: int, max_new_tokens: int, target_tpot_ms: float,
                refine: float | None = None, cloud: CloudEstimate | None = None) -> int | None:
    """The cloud budget the real device's plan (`policy.plan`) picks for this profile (device fit =
    the profile's, cloud = a fresh client's pessimistic `CloudEstimate`; `refine`: keep ratio, the
    device starting after the cloud's first token); None = the cloud streams to the end (tokens)."""
    c = cloud or CloudEstimate()
    t = profile_timing(profile, c.ttft_ms(prompt_tokens), c.tpot_ms)
    return plan(PlanInput(t, prompt_tokens, max_new_tokens, target_tpot_ms, refine)).budget


async def virtual_request(url: str, fingerprint: str, prompt: Sequence[int], mode: str = "split",
                          profile: DeviceProfile | str = "phone", max_new_tokens: int = 64,
                          budget: int | None | str = "auto", refine: float | None = None,
                          target_tpot_ms: float = 50.0, token: str | None = None,
                          timeout_s: float = 60.0, min_tokens: int = 0) -> VirtualResult:
    """Run one virtual device request against the cloud at `url` (see the module docstring).
    min_tokens: no EOS before this many tokens (`Generate.min_tokens`; max_new_tokens: fixed-length
    answers, a decode-heavy load)."""
    if mode not in LOAD_MODES:
        raise ValueError(f"unknown load mode {mode!r}; choose one of {', '.join(LOAD_MODES)}")
    prof = load_profile(profile) if isinstance(profile, str) else profile
    prompt = list(prompt)
    split = mode == "split"
    if budget == "auto":
        budget = auto_budget(prof, len(prompt), max_new_tokens, target_tpot_ms, refine) if split else None
    res = VirtualResult(len(prompt), mode, False, budget=budget if split else None, device_prompt_tokens=0)
    rid = uuid.uuid4().hex[:12]
    try:
        ch = await proto_ws.open_channel(url, fingerprint, token, client="relayinfer-virtual", open_timeout=timeout_s)
    except Exception as e:  # refused or unreachable
        res.error = f"{type(e).__name__}: {e}"
        return res
    table = RequestTable(Role.DEVICE)  # the request's protocol state: token order, crossings, its end
    first, last = None, None
    kept: list[int] | None = None
    done: Done | None = None
    got_first, got_refined, got_done, ended = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    received = lambda: table.tokens(rid)  # noqa: E731  cloud tokens received so far

    async def receive():
        nonlocal first, last, kept, done
        try:
            async for msg in ch:
                ev = table.receive(msg)
                if isinstance(ev, RequestViolation):
                    res.error = f"protocol violation: {ev.message}"
                    return
                if isinstance(msg, Token):
                    if first is None:
                        first = msg
                        res.ttft_ms = (time.perf_counter() - t0) * 1e3
                        got_first.set()
                    last = msg
                    if msg.finish_reason:  # the token that ends the answer, as the cloud's sampler decided
                        ended.set()
                elif isinstance(msg, RefinedPrompt):
                    kept = list(msg.kept_indices)
                    got_refined.set()
                elif isinstance(msg, Done):
                    done = msg
                    return
                elif isinstance(msg, Error):
                    res.error = f"cloud error [{msg.code}]: {msg.message}"
                    return
        finally:
            got_first.set(), got_refined.set(), got_done.set()

    async def device():
        """Simulated device (`device_loop`), then Stop{handoff} unless the cloud is done already."""
        n = len(prompt)
        if refine is not None:
            await got_refined.wait()
            n = len(kept) if kept else n
        res.device_prompt_tokens = n
        finished = lambda: ended.is_set() or (done is not None and done.reason != "budget")  # noqa: E731
        h = await device_loop(profile_timing(prof), n, received, finished)
        if h is None:
            return  # the cloud finished the answer first: no hand-off
        res.handoff = h
        if h == 0 and res.ttft_ms is None:  # ready before the first cloud token: the device answers alone
            res.ttft_ms = (time.perf_counter() - t0) * 1e3
        if not table.send(Stop(rid, h)).ignored:  # ignored: the cloud's Done came first
            await ch.send(Stop(rid, h))

    t0 = time.perf_counter()
    try:
        g = generate_message(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, min_tokens=min_tokens),
                             cloud_budget=budget if split else None, refine=refine if split else None)
        table.send(g)
        await ch.send(g)
        rx = asyncio.create_task(receive())
        dev = asyncio.create_task(device()) if split else None
        await asyncio.wait_for(asyncio.shield(rx), timeout_s)
        if dev is not None and done is not None and done.reason == "budget" and res.error is None:
            # the budget is spent: the device still catches up and takes over (bounded by the timeout)
            await asyncio.wait_for(asyncio.shield(dev), max(0.0, timeout_s - (time.perf_counter() - t0)))
        if dev is not None:
            dev.cancel()
            await asyncio.gather(dev, return_exceptions=True)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s} s"
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        for t in [x for x in (locals().get("rx"), locals().get("dev")) if x is not None]:
            t.cancel()
        await ch.close()
    res.total_ms = (time.perf_counter() - t0) * 1e3
    res.cloud_tokens = done.cloud_tokens if done is not None else received()
    if done is not None:  # no Token at all: a hand-off at 0 (the cloud held the request for its prefill)
        res.cloud_busy_ms = done.prefill_ms + (last.t_cloud_ms - first.t_cloud_ms if first is not None else 0.0)
    res.ok = done is not None and (first is not None or res.handoff == 0) and res.error is None
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
