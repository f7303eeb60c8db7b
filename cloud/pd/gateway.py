"""The P/D gateway: scenario groups, on-demand forwarding (or the push router), KV hand-off,
retries on instance faults.

Requests are classified into a **scenario** (by a request tag, else by prompt length class); each
scenario has its own **group**: prefill and decode pools, TTFT/TPOT SLOs and P/D ratio (P/D-Serve,
arXiv 2408.08147, sec. 3.2).

**Forwarding** (sec. 3.3), one code path and a flag:

* `on-demand`: the gateway offers the request to the group's prefill instances in turn; each accepts
  only if its own local queue lets it start within the remaining TTFT budget, else rejects at once,
  and the gateway tries the next. When all reject it backs off briefly and retries until the budget
  is spent (back-off 10 ms doubling up to 200 ms), then sends it to the instance that reported the
  shortest wait (forced).
* `push`: the gateway picks the prefill instance with the shortest queue **as last reported**
  (every `report_interval_s`, so stale in between) and pushes the request; the instance always
  accepts. This is the baseline P/D-Serve compares against.

After the prefill the first token goes to the client at once (TTFT), the `Handoff` (token ids + KV
payload) goes to the group's decode instance with the fewest requests in flight from this gateway,
and its tokens stream on.

**Prefix-aware routing** (`prefix.py`): the gateway keeps a table of the block-hash chains each
instance has prefilled or decoded. Prefill offers start at the instance with the longest cached
prefix of the request (within `prefix_slack` in-flight requests of the least loaded prefill
instance), then go round-robin; the decode pick prefers the decode instance holding the longest
prefix (its own cache shares those blocks instead of writing them) under the same bound, else the
fewest in flight. The prompt tokens each request reused from a prefill instance's cache are kept
(`request_stats`) and counted (`relayinfer_pd_prefix_hit_tokens`). Split-service requests (a device `Generate` with a cloud budget) never
use a decode instance: they run on the prefill instance for their few tokens (`split=True`).

**Faults**: an instance that dies (an actor crash, a lost KV object, an injected fault) raises
`InstanceDied` in the handle; the gateway retries the request from where it is: the prompt plus the
tokens already sent are prefilled again on a live prefill instance (prefix cache helps; answer
positions continue, so greedy and seeded answers are unchanged) and handed to a live decode
instance. After `max_retries` the request fails with `PDError` naming the instances and causes.
A request that fails by itself on an instance (`RequestFailed`: its sampling raised, say) fails at
once with that error; it is not retried.

**Replacement**: an instance whose process died or whose engine failed (its load report raises)
is replaced by the gateway (`handle.restart()`: a new actor, or a new in-process `Instance`), at
most `RestartBudget.max_restarts` times per instance in any `window_s` seconds. Between death and
replacement `/healthz` names it (`health_state`); when a pool has no live instance and none can
be restarted (budget spent), `health()` names the group and the service exits (code 3).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayinfer.cloud.engine.llm_engine import RequestFailed, RequestStats, StepOutput
from relayinfer.cloud.engine.metrics import LATENCY_BUCKETS, TPOT_BUCKETS
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.errors import RelayInferError
from relayinfer.protocol.messages import Cancel, Done, Error, ExtendBudget, Generate, Token
from relayinfer.protocol.requests import RequestState, RequestTable, RequestViolation, Role

from .instance import Handoff, Instance, InstanceDied, Rejected
from .prefix import PrefixRouter

log = logging.getLogger("relayinfer.pd")

FORWARDING = ("on-demand", "push")


class PDError(RuntimeError):
    """A request the P/D pools could not serve (no live instance, retries exhausted)."""


@dataclass
class Scenario:
    """A class of requests with its SLOs. `max_prompt_tokens`: the length class (prompts up to it
    belong here when no tag says otherwise)."""

    name: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    max_prompt_tokens: int = 1 << 30


@dataclass
class Group:
    """One scenario's P/D group: its own pools (handles), SLOs and measured latencies."""

    scenario: Scenario
    prefill: list = field(default_factory=list)
    decode: list = field(default_factory=list)
    ttft_ms: deque = field(default_factory=lambda: deque(maxlen=512))
    tpot_ms: deque = field(default_factory=lambda: deque(maxlen=2048))

    @property
    def name(self) -> str:
        return self.scenario.name

    @property
    def ratio(self) -> str:
        return f"{len(self.prefill)}P:{len(self.decode)}D"


class LocalHandle:
    """An in-process `Instance` behind the handle interface the gateway uses (`RayHandle` is the
    same over a Ray actor)."""

    def __init__(self, instance: Instance):
        self.instance, self.name = instance, instance.name

    @property
    def role(self) -> str:
        return self.instance.role

    async def set_role(self, role: str) -> None:
        self.instance.role = role

    async def prefill(self, request_id, prompt_ids, params, output_ids=(), ttft_budget_ms=None):
        return await self.instance.prefill(request_id, prompt_ids, params, output_ids, ttft_budget_ms)

    async def decode(self, handoff: Handoff, request_id: str, cloud_budget=None) -> AsyncIterator[StepOutput]:
        async for o in self.instance.decode(handoff, request_id, cloud_budget):
            yield o

    async def generate(self, request_id, prompt_ids, params, cloud_budget=None, output_ids=(), ttft_budget_ms=None):
        async for o in self.instance.generate(request_id, prompt_ids, params, cloud_budget, output_ids,
                                              ttft_budget_ms):
            yield o

    async def abort(self, request_id: str) -> None:
        self.instance.abort(request_id)

    async def set_budget(self, request_id: str, budget: int) -> None:
        self.instance.set_budget(request_id, budget)

    async def load(self) -> dict:
        return self.instance.load()

    async def prefix_hits(self, request_id: str) -> int:
        return self.instance.prefix_hits(request_id)

    async def restart(self) -> None:
        """Replace the instance by a fresh one (same model, name, role and config); the old one's
        engine thread is stopped. Its requests fail over (InstanceDied) to the live instances."""
        old = self.instance
        self.instance = Instance(old.engine.model, old.name, old.role, old.config)
        await asyncio.to_thread(old.shutdown, 5.0)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.instance.shutdown)


class RestartBudget:
    """At most `max_restarts` restarts per instance in any `window_s` seconds (a sliding window,
    so an instance that crashes now and then is replaced for ever, one that crash-loops is not)."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0, clock=time.monotonic):
        if max_restarts < 0 or window_s <= 0:
            raise ValueError(f"restart budget needs max_restarts >= 0 and window_s > 0, got {max_restarts}, {window_s}")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._times: dict[str, deque] = {}

    def recent(self, name: str) -> int:
        """Restarts of `name` within the last `window_s` seconds."""
        q = self._times.setdefault(name, deque())
        now = self.clock()
        while q and now - q[0] > self.window_s:
            q.popleft()
        return len(q)

    def take(self, name: str) -> bool:
        """Count one restart of `name` if the budget allows it; False when it is spent."""
        if self.recent(name) >= self.max_restarts:
            return False
        self._times[name].append(self.clock())
        return True


@dataclass
class GroupSpec:
    """How many instances a scenario group starts with (the ratio controller may move them)."""

    scenario: Scenario
    n_prefill: int = 1
    n_decode: int = 1


def local_groups(model, specs: list[GroupSpec], config=None) -> list[Group]:
    """Groups of in-process instances sharing one loaded model (tests, benchmarks, one process)."""
    from .instance import InstanceConfig

    groups = []
    for spec in specs:
        mk = lambda role, i: LocalHandle(Instance(model, f"{spec.scenario.name}-{role[0]}{i}", role,  # noqa: E731
                                                  config or InstanceConfig()))
        groups.append(Group(spec.scenario, [mk("prefill", i) for i in range(spec.n_prefill)],
                            [mk("decode", i) for i in range(spec.n_decode)]))
    return groups


class GatewayMetrics:
    """The `relayinfer_pd_*` series. TTFT and KV transfer times use the cloud's latency buckets
    (`cloud.engine.metrics.LATENCY_BUCKETS`, 5 ms .. 30 min), TPOT the cloud engine's TPOT buckets."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("relayinfer_pd_requests", "P/D requests by group and outcome", ["group", "outcome"],
                                registry=r)
        self.offers = Counter("relayinfer_pd_forward_offers", "Requests offered to prefill instances", ["group"],
                              registry=r)
        self.rejections = Counter("relayinfer_pd_forward_rejections", "Offers rejected (TTFT budget)", ["group"],
                                  registry=r)
        self.forced = Counter("relayinfer_pd_forward_forced", "Requests sent after every instance rejected until "
                              "the budget was spent", ["group"], registry=r)
        self.retries = Counter("relayinfer_pd_retries", "Requests resumed after an instance fault", ["group"],
                               registry=r)
        self.kv_bytes = Counter("relayinfer_pd_kv_bytes", "KV bytes handed from prefill to decode", ["mode"],
                                registry=r)
        self.kv_objects = Counter("relayinfer_pd_kv_objects", "KV objects handed over", ["mode"], registry=r)
        self.kv_transfer = Histogram("relayinfer_pd_kv_transfer_seconds", "Prefill end to decode admission",
                                     ["mode"], registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("relayinfer_pd_ttft_seconds", "Time to first token", ["group"], registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("relayinfer_pd_tpot_seconds", "Time between output tokens", ["group"], registry=r,
                              buckets=TPOT_BUCKETS)
        self.prompt_tokens = Counter("relayinfer_pd_prompt_tokens", "Prompt tokens prefilled on prefill instances",
                                     ["group"], registry=r)
        self.prefix_hit_tokens = Counter("relayinfer_pd_prefix_hit_tokens", "Of those, tokens reused from the "
                                         "instance's prefix cache", ["group"], registry=r)
        self.prefix_routed = Counter("relayinfer_pd_prefix_routed", "Picks that went to an instance by its cached "
                                     "prefix", ["group", "role"], registry=r)
        self.local_prefills = Counter("relayinfer_pd_local_prefills", "Requests run whole on a decode instance "
                                      "that held most of their prompt's KV", ["group"], registry=r)
        self.moves = Counter("relayinfer_pd_ratio_moves", "Instances moved by the ratio controller",
                             ["kind", "src", "dst"], registry=r)
        self.live = Gauge("relayinfer_pd_live_requests", "Requests in the gateway", registry=r)
        self.instances = Gauge("relayinfer_pd_instances", "Instances by group and role", ["group", "role"],
                               registry=r)


@dataclass
class _Live:
    group: Group
    where: list = field(default_factory=list)  # (handle, instance request id) currently holding it
    budget: int | None = None


class Gateway:
    """Front of the P/D pools.

    Args:
        groups: one `Group` per scenario (the first one whose `max_prompt_tokens` fits the prompt
            serves untagged requests; the last one takes the rest).
        forwarding: 'on-demand' or 'push' (see the module docstring).
        report_interval_s: how often instances report their load (the push router's stale view, the
            `/healthz` numbers, the ratio controller).
        retry_backoff_s: pause after a round of rejections (on-demand).
        max_retries: resumptions after instance faults before the request fails.
        restart_wait_s: how long a request waits for a pool whose instances are all dead to come
            back (the gateway replaces them) before it fails with `PDError`.
        restarts: the replacement budget (default 5 per instance per 60 s); instances whose handle
            has no `restart` are never replaced.
        restart_timeout_s: how long one replacement may take (an actor starting, s).
        prefix_routing: route by cached prefix (`prefix.py`); False: round-robin / fewest in flight.
        block_size: the instances' KV block size (tokens): the routing table hashes such blocks.
        prefix_slack: a longer cached prefix wins while its instance has at most this many more
            requests in flight than the least loaded one.
        prefix_max_blocks: block hashes the routing table keeps (LRU).
        local_prefill_tokens: a request whose picked decode instance holds a longer cached prefix
            than any prefill instance runs there whole when at most this many tokens are left to
            prefill and at most as many as it holds cached (`_local_prefill`); 0 never.
        max_request_stats: finished requests whose prefix hits `request_stats` still answers.

    Raises:
        ValueError: an unknown `forwarding`, no groups, or a bad prefix-routing setting.
    """

    def __init__(self, groups: list[Group], forwarding: str = "on-demand", report_interval_s: float = 0.5,
                 retry_backoff_s: float = 0.01, max_retries: int = 2, restart_wait_s: float = 60.0,
                 registry: CollectorRegistry | None = None, restarts: RestartBudget | None = None,
                 restart_timeout_s: float = 300.0, prefix_routing: bool = True, block_size: int = 16,
                 prefix_slack: int = 2, prefix_max_blocks: int = 1 << 16, max_request_stats: int = 10000,
                 local_prefill_tokens: int = 256):
        if forwarding not in FORWARDING:
            raise ValueError(f"unknown forwarding {forwarding!r}; choose from {', '.join(FORWARDING)}")
        if not groups:
            raise ValueError("at least one P/D group is needed")
        self.groups = groups
        self.forwarding, self.report_interval_s = forwarding, report_interval_s
        self.retry_backoff_s, self.max_retries, self.restart_wait_s = retry_backoff_s, max_retries, restart_wait_s
        self.metrics = GatewayMetrics(registry)
        self.reports: dict[str, dict] = {}   # last load report per instance (stale by design)
        self.report_time = 0.0
        self._rr = {g.name: itertools.count() for g in groups}
        self._decode_active: dict[str, int] = {}
        self._prefill_active: dict[str, int] = {}
        self.prefix = PrefixRouter(block_size, prefix_max_blocks, prefix_slack, enabled=prefix_routing)
        self._stats: OrderedDict[str, RequestStats] = OrderedDict()  # request id -> its prefill's prefix hits
        self.max_request_stats = max_request_stats
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        self.local_prefill_tokens = local_prefill_tokens
        self._live: dict[str, _Live] = {}
        self.requests = RequestTable(Role.CLOUD)  # the per-request rules: duplicate ids, late aborts
        self._ids = itertools.count()
        self._reporter: asyncio.Task | None = None
        self.dead: dict[str, str] = {}  # instance name -> last failure, until it reports again
        self.restarts = restarts if restarts is not None else RestartBudget()
        self.restart_timeout_s = restart_timeout_s
        self.num_restarts: dict[str, int] = {}  # replacements per instance since the start
        self._failed: set[str] = set()  # dead for sure (not just slow to report): to be replaced
        self._restarting: dict[str, asyncio.Task] = {}
        self._update_instance_gauges()

    # --- set-up -----------------------------------------------------------------------------------
    @property
    def handles(self) -> list:
        return [h for g in self.groups for h in g.prefill + g.decode]

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def classify(self, num_prompt_tokens: int, tag: str | None = None) -> Group:
        """The scenario group of a request: its tag if it names a group, else its length class."""
        if tag:
            for g in self.groups:
                if g.name == tag:
                    return g
        for g in sorted(self.groups, key=lambda g: g.scenario.max_prompt_tokens):
            if num_prompt_tokens <= g.scenario.max_prompt_tokens:
                return g
        return self.groups[-1]

    async def start(self) -> None:
        await self.refresh_reports()
        if self._reporter is None:
            self._reporter = asyncio.create_task(self._report_loop())

    async def stop(self, shutdown_instances: bool = True) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            self._reporter = None
        for t in list(self._restarting.values()):
            t.cancel()
        if self._restarting:
            await asyncio.wait(list(self._restarting.values()), timeout=10)
        if shutdown_instances:
            await asyncio.gather(*(h.shutdown() for h in self.handles), return_exceptions=True)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            try:
                await self.refresh_reports()
                self.replace_dead()
            except Exception:  # pragma: no cover - a report round must never kill the loop
                log.exception("load report round failed")

    async def refresh_reports(self) -> None:
        """Ask every instance for its load (the push router's view until the next round)."""
        hs = self.handles
        res = await asyncio.gather(*(asyncio.wait_for(h.load(), 10.0) for h in hs), return_exceptions=True)
        for h, r in zip(hs, res):
            if h.name in self._restarting:
                continue  # being replaced: the old one's reports mean nothing
            if isinstance(r, BaseException):
                self.dead[h.name] = f"{type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''}"
                if not isinstance(r, (asyncio.TimeoutError, TimeoutError, asyncio.CancelledError)):
                    self._failed.add(h.name)  # it answered with its death (engine failed, actor gone)
            else:
                self.reports[h.name] = r
                self.dead.pop(h.name, None)
                self._failed.discard(h.name)
        self.report_time = time.perf_counter()

    # --- replacement ------------------------------------------------------------------------------
    def replace_dead(self) -> None:
        """Start replacing every instance known failed (its report raised, not timed out) whose
        handle can restart, within the restart budget."""
        for h in self.handles:
            if h.name not in self._failed or h.name in self._restarting or not hasattr(h, "restart"):
                continue
            if not self.restarts.take(h.name):
                continue  # budget spent: stays dead (health() says so when its pool is empty)
            self._restarting[h.name] = asyncio.create_task(self._restart(h))

    async def _restart(self, h) -> None:
        why = self.dead.get(h.name, "failed")
        log.warning("replacing instance %s (%s)", h.name, why)
        try:
            await asyncio.wait_for(h.restart(), self.restart_timeout_s)
            report = await asyncio.wait_for(h.load(), 30.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.dead[h.name] = f"replacement failed: {type(e).__name__}: {e}"
            log.error("instance %s: replacement failed: %s: %s", h.name, type(e).__name__, e)
        else:
            self.prefix.forget(h.name)  # a new engine: its prefix cache is empty
            self.reports[h.name] = report
            self.dead.pop(h.name, None)
            self._failed.discard(h.name)
            self.num_restarts[h.name] = self.num_restarts.get(h.name, 0) + 1
            log.warning("instance %s replaced (restart %d)", h.name, self.num_restarts[h.name])
        finally:
            self._restarting.pop(h.name, None)

    def _replaceable(self, h) -> bool:
        return h.name in self._restarting or (
            hasattr(h, "restart") and self.restarts.recent(h.name) < self.restarts.max_restarts)

    def health(self) -> str | None:
        """None while every group's prefill and decode pools have a live instance or one being (or
        able to be) replaced; else why not, naming the group, the role and each instance's failure."""
        for g in self.groups:
            for role, pool in (("prefill", g.prefill), ("decode", g.decode)):
                if any(h.name not in self.dead or self._replaceable(h) for h in pool):
                    continue
                spent = [h.name for h in pool if hasattr(h, "restart")]
                budget = (f"; restart budget spent ({self.restarts.max_restarts} per {self.restarts.window_s:.0f} s)"
                          if spent else "")
                return f"P/D group {g.name!r} has no live {role} instance ({self._dead_text(pool)}){budget}"
        return None

    def health_state(self) -> dict:
        """`/healthz` of the gateway: status 'ok', 'degraded' (an instance is dead or being replaced;
        every pool still has a live one) or 'unavailable' (a pool has none right now), the dead
        instances with their failure, the ones being replaced, and replacements per instance."""
        dead = {h.name: self.dead[h.name] for h in self.handles if h.name in self.dead}
        empty = any(all(h.name in self.dead for h in pool) for g in self.groups for pool in (g.prefill, g.decode))
        return {"status": "unavailable" if empty else "degraded" if dead else "ok", "dead": dead,
                "restarting": sorted(self._restarting), "restarts": dict(self.num_restarts)}

    def _update_instance_gauges(self) -> None:
        for g in self.groups:
            self.metrics.instances.labels(g.name, "prefill").set(len(g.prefill))
            self.metrics.instances.labels(g.name, "decode").set(len(g.decode))

    async def move(self, handle, src: Group, dst: Group, to_role: str) -> None:
        """Move an instance to another role and/or group (the ratio controller). Requests already on
        it finish there; new ones follow the new role."""
        for pool in (src.prefill, src.decode):
            if handle in pool:
                pool.remove(handle)
        (dst.prefill if to_role == "prefill" else dst.decode).append(handle)
        await handle.set_role(to_role)
        self._update_instance_gauges()

    # --- requests ---------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its KV is freed on that instance at its next step. An
        unknown, finished or already aborted request is left alone (the table ignores it)."""
        ev = self.requests.receive(Cancel(request_id))
        live = self._live.get(request_id)
        if isinstance(ev, RequestViolation) or ev.ignored or live is None:
            return
        for h, irid in list(live.where):
            asyncio.ensure_future(self._quiet(h.abort(irid)))

    def _aborted(self, request_id: str) -> bool:
        return self.requests.state(request_id) is RequestState.CANCELLING

    def set_budget(self, request_id: str, budget: int) -> None:
        """Change a live request's cloud budget (ignored once it was aborted or ended)."""
        ev = self.requests.receive(ExtendBudget(request_id, budget))
        live = self._live.get(request_id)
        if isinstance(ev, RequestViolation) or ev.ignored or live is None:
            return
        live.budget = budget
        for h, irid in list(live.where):
            asyncio.ensure_future(self._quiet(h.set_budget(irid, budget)))

    @staticmethod
    async def _quiet(coro) -> None:
        try:
            await coro
        except Exception:  # the instance is gone: nothing left to stop there
            pass

    def _ordered(self, group: Group, role: str, chain: list[int], base: list) -> list:
        """`base` (the load order) with the instance holding the longest cached prefix of `chain`
        first, if its in-flight count is within the slack (`PrefixRouter.order`)."""
        active = self._prefill_active if role == "prefill" else self._decode_active
        order = self.prefix.order(chain, base, active)
        if order and base and order[0] is not base[0]:
            self.metrics.prefix_routed.labels(group.name, role).inc()
        return order

    async def _offer(self, h, offer, budget_ms):
        self._prefill_active[h.name] = self._prefill_active.get(h.name, 0) + 1
        try:
            return await offer(h, budget_ms)
        finally:
            self._prefill_active[h.name] -= 1

    async def _forward(self, group: Group, t0: float, n_tokens: int, offer, chain: list[int] = ()):
        """Pick a prefill instance and run `offer(handle, ttft_budget_ms)` on it; returns
        (handle, result). On-demand: try instances in turn (the one holding the longest cached
        prefix of `chain` first) until one accepts; push: the longest cached prefix among those within
        the load slack, else the shortest reported queue, always accepted."""
        m, gname = self.metrics, group.name
        slo = group.scenario.ttft_slo_ms
        backoff = self.retry_backoff_s
        while True:
            pool = await self._live_pool(group, "prefill")
            k = next(self._rr[gname])
            if self.forwarding == "push":
                base = sorted(pool, key=lambda h: (self.reports.get(h.name, {}).get("queued_prefill_tokens", 0),
                                                   (pool.index(h) - k) % len(pool)))
                h = self._ordered(group, "prefill", list(chain), base)[0]
                m.offers.labels(gname).inc()
                return h, await self._offer(h, offer, None)
            order = self._ordered(group, "prefill", list(chain), pool[k % len(pool):] + pool[:k % len(pool)])
            best = None
            for h in order:
                budget = slo - (time.perf_counter() - t0) * 1e3
                m.offers.labels(gname).inc()
                r = await self._offer(h, offer, max(budget, 0.0))
                if not isinstance(r, Rejected):
                    return h, r
                m.rejections.labels(gname).inc()
                if best is None or r.est_wait_ms < best[1]:
                    best = (h, r.est_wait_ms)
            if (time.perf_counter() - t0) * 1e3 + backoff * 1e3 >= slo:
                m.forced.labels(gname).inc()  # every instance keeps rejecting: the shortest wait takes it
                return best[0], await self._offer(best[0], offer, None)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 0.2)  # exponential back-off: 10 ms, 20 ms, ... 200 ms

    def _dead_text(self, handles) -> str:
        return "; ".join(f"{h.name}: {self.dead.get(h.name, 'not reporting')}" for h in handles) or "none configured"

    async def _live_pool(self, group: Group, role: str) -> list:
        """The group's instances of `role` not known dead; when all are, wait up to
        `restart_wait_s` for one to report again (Ray restarts dead actors), else PDError."""
        handles = group.prefill if role == "prefill" else group.decode
        t0 = time.perf_counter()
        while True:
            pool = [h for h in handles if h.name not in self.dead]
            if pool:
                return pool
            if time.perf_counter() - t0 > self.restart_wait_s:
                raise PDError(f"group {group.name!r} has no live {role} instance after waiting "
                              f"{self.restart_wait_s:.0f} s ({self._dead_text(handles)})")
            await asyncio.sleep(0.2)
            await self.refresh_reports()

    async def _pick_decode(self, group: Group, chain: list[int] = ()):
        """The decode instance holding the longest cached prefix of `chain` within the load slack,
        else the one with the fewest requests in flight from this gateway."""
        pool = await self._live_pool(group, "decode")
        base = sorted(pool, key=lambda h: self._decode_active.get(h.name, 0))  # stable: ties keep pool order
        return self._ordered(group, "decode", list(chain), base)[0]

    async def _local_prefill(self, group: Group, tokens: list[int]):
        """The decode instance to run the whole request on, or None (prefill -> KV -> decode).
        Conditional disaggregation (Dynamo's): when the decode instance picked for the request
        (`_pick_decode`) holds a longer cached prefix than every prefill instance, e.g. the previous
        turn's answer of a conversation that only it decoded, and the tokens left to compute are at
        most `local_prefill_tokens` and at most the ones it holds (a continuation, not a new prompt
        that merely shares a system turn), it prefills them itself; no KV moves."""
        if not self.prefix.enabled or self.local_prefill_tokens <= 0:
            return None
        chain = self.prefix.chain(tokens)
        if not chain:
            return None
        dh = await self._pick_decode(group, chain)
        on_decode = self.prefix.overlap(chain, dh.name)
        on_prefill = max((self.prefix.overlap(chain, h.name) for h in group.prefill if h.name not in self.dead),
                         default=0)
        cached = on_decode * self.prefix.block_size
        left = len(tokens) - cached
        if on_decode <= on_prefill or left > self.local_prefill_tokens or left > cached:
            return None
        self.metrics.local_prefills.labels(group.name).inc()
        return dh

    def _note_hits(self, request_id: str, group: Group, n_prompt: int, n_tokens: int, hits: int | None) -> None:
        """Keep the prefix hits of a request's first prefill (for `request_stats`) and count them."""
        if request_id in self._stats or hits is None:
            return
        self._stats[request_id] = RequestStats(n_prompt, int(hits), 0, 0, None, None, None)
        while len(self._stats) > self.max_request_stats:
            self._stats.popitem(last=False)
        self.metrics.prompt_tokens.labels(group.name).inc(n_tokens)
        self.metrics.prefix_hit_tokens.labels(group.name).inc(int(hits))

    def request_stats(self, request_id: str) -> RequestStats | None:
        """Counters of a live or recently finished request: its prompt tokens and the tokens its
        prefill reused from the instance's prefix cache (`prefix_hit_tokens`, summed as the engine
        does over the prompt and any answer tokens prefilled again after a fault); the other
        fields are 0 / None (they live on the instances). None for an unknown request."""
        return self._stats.get(request_id)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       cloud_budget: int | None = None, tag: str | None = None,
                       split: bool = False) -> AsyncIterator[StepOutput]:
        """Serve one request; yields `StepOutput`s with this `request_id` (answer index from 0).
        Leaving the iteration early aborts it. `split`: stay on the prefill instance (device
        requests with a cloud budget). Every request goes through `requests` (its tokens, its end).
        Raises `PDError` when it cannot be served, ValueError for an id that is already running."""
        group = self.classify(len(prompt_ids), tag)
        ev = self.requests.receive(Generate(request_id, list(prompt_ids), params.max_new_tokens,
                                            cloud_budget=cloud_budget))
        if isinstance(ev, RequestViolation):
            raise ValueError(f"request {request_id!r} is already running") from ev
        live = self._live[request_id] = _Live(group, budget=cloud_budget)
        self._stats.pop(request_id, None)  # a reused id: its last run's numbers are not this one's
        self.metrics.live.inc()
        outcome, outs, retries = "error", [], 0
        t0 = time.perf_counter()
        last = [t0]
        ended = [None]  # finish reason of the last token handed out

        def emit(o: StepOutput) -> StepOutput:
            now = time.perf_counter()
            if not outs:
                group.ttft_ms.append((now - t0) * 1e3)
                self.metrics.ttft.labels(group.name).observe(now - t0)
            else:
                group.tpot_ms.append((now - last[0]) * 1e3)
                self.metrics.tpot.labels(group.name).observe(now - last[0])
            last[0] = now
            self.requests.send(Token(request_id, o.token_id, len(outs), (now - t0) * 1e3, 0, o.finish_reason))
            outs.append(o.token_id)
            ended[0] = o.finish_reason
            return StepOutput(request_id, o.token_id, len(outs) - 1, o.finish_reason, o.logprobs)

        try:
            while True:
                try:
                    if split:
                        async for o in self._run_split(group, live, request_id, prompt_ids, params, outs, t0):
                            yield emit(o)
                            if o.finish_reason:
                                break
                    else:
                        local = await self._local_prefill(group, list(prompt_ids) + outs)
                        run = self._run_split(group, live, request_id, prompt_ids, params, outs, t0, on=local) \
                            if local is not None else self._run_pd(group, live, request_id, prompt_ids, params, outs, t0)
                        async for o in run:
                            yield emit(o)
                            if o.finish_reason:
                                break
                    outcome = "aborted" if self._aborted(request_id) else "ok"
                    return
                except InstanceDied as e:
                    if self._aborted(request_id):
                        outcome = "aborted"
                        return
                    retries += 1
                    self.metrics.retries.labels(group.name).inc()
                    if retries > self.max_retries:
                        raise PDError(f"request {request_id!r} failed after {retries - 1} retries: {e}") from e
                    log.warning("request %s: %s; resuming after %d tokens (retry %d)", request_id, e, len(outs),
                                retries)
        except (GeneratorExit, asyncio.CancelledError):  # the consumer left: after the last token, or early
            outcome = "ok" if ended[0] else "aborted"
            raise
        finally:
            for h, irid in live.where:  # whatever still runs somewhere stops and frees its KV
                await self._quiet(h.abort(irid))
            self._live.pop(request_id, None)
            end = Error("internal", "the request failed", request_id) if outcome == "error" else \
                Done(request_id, ended[0] or ("cancel" if outcome == "aborted" else "length"), len(outs), 0.0)
            self.requests.send(end)  # the id may be used again
            self.metrics.live.dec()
            self.metrics.requests.labels(group.name, outcome).inc()

    def _irid(self, request_id: str) -> str:
        return f"{request_id}#{next(self._ids)}"  # unique per attempt and instance

    async def _run_split(self, group, live, request_id, prompt_ids, params, outs, t0, on=None):
        """The whole request on one instance, no KV transfer: a (short) split request on a prefill
        instance, or with `on` (a decode instance already holding most of the prompt's KV) the
        whole request there (local prefill)."""
        irid = self._irid(request_id)
        streams = {}

        async def offer(h, budget_ms):
            gen = h.generate(irid, prompt_ids, params, live.budget, outs, budget_ms)
            first = await self._guard(h, gen.__anext__())
            if isinstance(first, Rejected):
                await gen.aclose()
                return first
            streams[h] = gen
            return first

        tokens = list(prompt_ids) + list(outs)
        chain = self.prefix.chain(tokens)
        active = self._decode_active
        if on is None:
            h, first = await self._forward(group, t0, len(tokens), offer, chain)
        else:
            h = on
            active[h.name] = active.get(h.name, 0) + 1
            try:
                first = await offer(h, None)
            except BaseException:
                active[h.name] -= 1
                raise
        live.where.append((h, irid))
        gen = streams[h]
        self.prefix.record(chain, h.name)
        if hasattr(h, "prefix_hits"):
            try:
                hits = await self._guard(h, h.prefix_hits(irid))
            except InstanceDied:
                await gen.aclose()
                live.where.remove((h, irid))
                if on is not None:
                    active[h.name] -= 1
                raise
            self._note_hits(request_id, group, len(prompt_ids), len(tokens), hits)
        try:
            o = first
            while True:
                yield o
                if o.finish_reason or self._aborted(request_id):
                    return
                o = await self._guard(h, gen.__anext__())
        except StopAsyncIteration:
            return
        finally:
            if on is not None:
                active[h.name] -= 1
            if h.name not in self.dead:  # it holds its answer's KV too (but the last token's)
                self.prefix.record(self.prefix.chain(list(prompt_ids) + outs[:-1]), h.name)
            live.where.remove((h, irid))
            await gen.aclose()

    async def _guard(self, h, aw):
        """Await `aw` from instance `h`, turning its death into `InstanceDied` (and marking it)."""
        try:
            return await aw
        except InstanceDied as e:
            self.dead[h.name] = str(e)
            self.prefix.forget(h.name)
            raise
        except (StopAsyncIteration, asyncio.CancelledError, GeneratorExit, PDError):
            raise
        except (RelayInferError, ValueError, RequestFailed):  # the request's own fault (too long, duplicate id,
            raise                                              # its sampling raised): not retried
        except Exception as e:
            cause = getattr(e, "cause", None)  # Ray wraps an error raised inside the actor
            if isinstance(cause, (RelayInferError, ValueError, RequestFailed)) and not isinstance(cause, InstanceDied):
                raise cause from None
            if "Actor" in type(e).__name__:  # the actor itself died: skip it until it reports again
                self.dead[h.name] = f"{type(e).__name__}"
                self.prefix.forget(h.name)  # restarted by Ray with an empty cache
            elif isinstance(cause, InstanceDied):  # its engine failed: dead until it is replaced
                self.dead[h.name] = str(cause)
                self.prefix.forget(h.name)
            raise InstanceDied(f"instance {h.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               ) from e

    async def _run_pd(self, group, live, request_id, prompt_ids, params, outs, t0):
        """Prefill on the group's prefill pool, first token out, then decode on its decode pool."""
        irid = self._irid(request_id)

        async def offer(h, budget_ms):
            live.where.append((h, irid))
            try:
                return await self._guard(h, h.prefill(irid, prompt_ids, params, list(outs), budget_ms))
            finally:
                live.where.remove((h, irid))

        tokens = list(prompt_ids) + list(outs)
        chain = self.prefix.chain(tokens)
        ph, ho = await self._forward(group, t0, len(tokens), offer, chain)
        if ho is None or self._aborted(request_id):  # aborted while prefilling
            return
        self.prefix.record(chain, ph.name)
        self._note_hits(request_id, group, len(prompt_ids), len(tokens), getattr(ho, "prefix_hit_tokens", None))
        reason = ho.finish_reason
        if reason == "budget" and (live.budget is None or ho.num_output_tokens < live.budget):
            reason = None  # the prefill instance stopped after one token by design: decode goes on
        yield StepOutput(request_id, ho.new_token, ho.num_output_tokens - 1, reason, getattr(ho, "logprobs", None))
        if reason or self._aborted(request_id):
            return
        dh = await self._pick_decode(group, chain)
        self._decode_active[dh.name] = self._decode_active.get(dh.name, 0) + 1
        drid = self._irid(request_id)
        live.where.append((dh, drid))
        t_hand = time.perf_counter()
        gen = dh.decode(ho, drid, live.budget)
        first = True
        try:
            while True:
                try:
                    o = await self._guard(dh, gen.__anext__())
                except StopAsyncIteration:
                    return
                if first:
                    first = False
                    kv = ho.kv
                    self.metrics.kv_bytes.labels(kv.mode).inc(kv.nbytes)
                    self.metrics.kv_objects.labels(kv.mode).inc(kv.num_objects)
                    self.metrics.kv_transfer.labels(kv.mode).observe(time.perf_counter() - t_hand)
                yield o
                if o.finish_reason or self._aborted(request_id):
                    return
        finally:
            self._decode_active[dh.name] -= 1
            if dh.name not in self.dead:  # it holds the prompt and the answer so far (but the last token)
                self.prefix.record(self.prefix.chain(list(prompt_ids) + outs[:-1]), dh.name)
            live.where.remove((dh, drid))
            await gen.aclose()

    # --- state ------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Groups, ratios, SLOs and the last reports (for /healthz and the benchmark)."""
        return {"forwarding": self.forwarding, "live_requests": len(self._live),
                "report_age_s": round(time.perf_counter() - self.report_time, 3),
                "groups": [{"name": g.name, "ratio": g.ratio, "ttft_slo_ms": g.scenario.ttft_slo_ms,
                            "tpot_slo_ms": g.scenario.tpot_slo_ms,
                            "prefill": [h.name for h in g.prefill], "decode": [h.name for h in g.decode]}
                           for g in self.groups],
                "instances": {n: r for n, r in self.reports.items()}, "dead": dict(self.dead),
                "prefix_routing": self.prefix.stats()}
