"""Cascade front end: spawns ranking-instance processes (`instance_proc`) and talks to them through
the router.

pre_infer() is sent at retrieval time to the instance the router picks for the user; rank() goes to
the same instance (affinity). If that instance is gone, the request is re-routed and the new instance
runs full inference: correctness never depends on the cache.

The model fingerprint a client must present comes from the instance's `GET /healthz`
(`server_fingerprint(url, token)`), not from its log.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import ssl as _ssl
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from relayinfer.cloud.relay.instance_proc import InstanceProc, spawn_instance  # noqa: F401  (public here too)
from relayinfer.cloud.relay.router import Router
from relayinfer.protocol.errors import ChannelClosed, RelayInferError, RemoteError
from relayinfer.protocol.messages import Error, PreInfer, Rank, Scores
from relayinfer.protocol.transport.ws import ClientChannel, open_channel


def server_fingerprint(url: str, token: str | None = None, timeout_s: float = 5.0,
                       ssl_context: _ssl.SSLContext | None = None) -> str:
    """The model fingerprint (hex sha256) of the ranking instance at `url` (ws:// or wss://), read from
    its `GET /healthz` on the same port (https:// for wss://), with `token` as the bearer token when the
    instance has one. Blocking, bounded by `timeout_s` seconds; `ssl_context` verifies a wss:// instance
    (default: the system's CAs).
    Raises ValueError for a url that is not ws:// or wss://; PermissionError when the instance answers
    without the fingerprint (it requires a token and `token` is missing or wrong); OSError (URLError)
    or TimeoutError when it cannot be reached in time."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("ws", "wss"):
        raise ValueError(f"url must be ws://HOST:PORT or wss://HOST:PORT, got {url!r}")
    health = f"{'https' if scheme == 'wss' else 'http'}://{rest.rstrip('/')}/healthz"
    req = urllib.request.Request(health, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ssl_context) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:  # e.g. 426 from a websocket server without /healthz
        raise OSError(f"{health} answered HTTP {e.code} ({e.reason}): not a ranking instance with /healthz") from None
    fp = body.get("model_fingerprint") if isinstance(body, dict) else None
    if not fp:
        raise PermissionError(f"{health} did not name the model fingerprint: the instance requires a bearer "
                              f"token ({'the one given was refused' if token else 'none was given'}; pass token=, "
                              "the instance's --token)")
    return fp


@dataclass
class RelayClient:
    """Router + one protocol channel per instance. Counters in `counts`: sent pre-infers, ranks by
    prefix source, instance_down (a send or reply failed because the instance is gone), fallback (a
    ranking request served by another instance than its pre-infer, so by full inference)."""
    router: Router
    channels: dict[str, ClientChannel] = field(default_factory=dict)
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    ids: itertools.count = field(default_factory=itertools.count)
    readers: list = field(default_factory=list)
    placed: dict[int, str] = field(default_factory=dict)   # user -> instance that got its pre-infer
    owned: list = field(default_factory=list)               # instances launch() started; close() stops them

    @classmethod
    async def launch(cls, n: int, checkpoint: str, latency: str, config: dict | None = None, baseline: bool = False,
                     placement: str = "process", ray_address: str | None = None, lifetime_s: float = 600.0,
                     cpus: list[list[int]] | None = None, **router_kw) -> "RelayClient":
        """Start n ranking instances and connect to them; close() stops them.

        placement "process": child processes of this one on this machine (`spawn_instance`; cpus[k]
        pins instance k to those CPU ids); "ray": Ray actors, each running the instance process on the
        node Ray picks (`ray_place.RayInstances`; a local Ray starts by itself when ray_address is None,
        CPU only, one Ray CPU per instance; starting Ray blocks the calling thread, 10-60 s). The router, the affinity and the protocol are the same either way.
        Raises ValueError for n < 1, an unknown placement, cpus with placement "ray" or of the wrong
        length; RuntimeError if an instance does not start."""
        if n < 1:
            raise ValueError(f"need at least 1 instance, got {n}")
        if placement not in ("process", "ray"):
            raise ValueError(f"placement must be 'process' or 'ray', got {placement!r}")
        if cpus is not None and (placement == "ray" or len(cpus) != n):
            raise ValueError("cpus: one list of CPU ids per instance, with placement 'process' only")
        if placement == "ray":
            from relayinfer.cloud.pd.ray_pool import start_ray
            from relayinfer.cloud.relay.ray_place import RayInstances
            # in the calling thread (blocking): Ray sets up its signal handling in the main thread; a
            # local Ray gets at least one CPU per instance
            start_ray(ray_address, num_cpus=max(n, os.cpu_count() or 1) if ray_address is None else None)
            ri = await asyncio.to_thread(RayInstances, n, checkpoint, latency, config, baseline, ray_address,
                                         lifetime_s=lifetime_s)
            urls, fp, owned, token = ri.urls, ri.fingerprint, [ri], ri.token
        else:
            owned = []
            try:
                for k in range(n):
                    owned.append(await asyncio.to_thread(spawn_instance, f"i{k}", str(checkpoint), str(latency), config,
                                                         baseline, lifetime_s, cpus=cpus[k] if cpus else None))
            except BaseException:
                for p in owned:
                    p.stop()
                raise
            urls, fp, token = {p.name: p.url for p in owned}, owned[0].fingerprint, None
        try:
            self = await cls.connect(urls, fp, token=token, **router_kw)
        except BaseException:
            for p in owned:
                p.stop()
            raise
        self.owned = owned
        return self

    def instance_stats(self) -> list[dict]:
        """GET /stats of the instances launch() started (blocking; [] for a connect()ed client)."""
        out = []
        for p in self.owned:
            out += p.stats() if hasattr(p, "actors") else [p.stats()]
        return out

    @classmethod
    async def connect(cls, instances: dict[str, str], fingerprint: str, token: str | None = None,
                      **router_kw) -> "RelayClient":
        """instances: name -> ws url. Opens one channel each (handshake with the model fingerprint, e.g.
        `server_fingerprint(url)`, and `token`, the instances' bearer token or None).
        Raises RemoteError when an instance refuses the Hello (code FINGERPRINT_MISMATCH: it runs
        another checkpoint; UNAUTHORIZED: wrong or missing token), OSError / TimeoutError when one
        cannot be reached (open_channel: 10 s each); the channels opened before are closed then."""
        self = cls(Router(list(instances), **router_kw))
        try:
            for name, url in instances.items():
                ch = await open_channel(url, fingerprint, token, client="relay-client")
                self.channels[name] = ch
                self.readers.append(asyncio.create_task(self._read(name, ch)))
        except BaseException:
            await self.close()
            raise
        return self

    async def _read(self, name: str, ch: ClientChannel) -> None:
        try:
            async for msg in ch:
                fut = self.pending.pop(getattr(msg, "request_id", None) or "", None)
                if isinstance(msg, Error) and msg.request_id and msg.request_id.startswith("pre-"):
                    self.counts["preinfer_error"] += 1
                elif fut is not None and not fut.done():
                    fut.set_result(msg)
        except RelayInferError:
            pass
        finally:
            self._down(name)

    def _down(self, name: str) -> None:
        if name in self.channels:
            self.channels.pop(name)
            self.router.remove(name)
            self.counts["instance_down"] += 1
        for rid, fut in list(self.pending.items()):
            if rid.endswith(f"@{name}") and not fut.done():
                fut.set_exception(ChannelClosed(f"instance {name} is gone", None))

    async def pre_infer(self, user: int, items, ts) -> str | None:
        """Send the retrieval-time signal; returns the chosen instance (None if it was unreachable)."""
        inst = self.router.route_preinfer(user)
        try:
            await self.channels[inst].send(PreInfer(request_id=f"pre-{next(self.ids)}", user_id=int(user),
                                                    item_ids=[int(i) for i in items], timestamps=[int(t) for t in ts]))
            self.counts["preinfer_sent"] += 1
            self.placed[int(user)] = inst
            if len(self.placed) > 100_000:                  # users who never ranked: forget the oldest
                self.placed.pop(next(iter(self.placed)))
            return inst
        except (KeyError, RelayInferError):
            self._down(inst)
            return None

    async def rank(self, user: int, items, ts, cands, timeout_s: float = 60.0,
                   request_ts: int | None = None) -> tuple[np.ndarray, str, str]:
        """Scores (N,) float32, prefix source, instance, at request time request_ts (int seconds; None:
        the last history event's time). Re-routes once per failed instance.
        Raises RemoteError for a per-request error (e.g. BAD_REQUEST on unknown ids)."""
        for _ in range(len(self.router.load) + 1):
            inst, _affine = self.router.route_rank(user)
            rid = f"rank-{next(self.ids)}@{inst}"
            fut = self.pending[rid] = asyncio.get_running_loop().create_future()
            try:
                await self.channels[inst].send(Rank(request_id=rid, user_id=int(user), item_ids=[int(i) for i in items],
                                                    timestamps=[int(t) for t in ts], candidate_ids=[int(c) for c in cands],
                                                    request_ts=None if request_ts is None else int(request_ts)))
                msg = await asyncio.wait_for(fut, timeout_s)
            except (KeyError, ChannelClosed, OSError):
                self.pending.pop(rid, None)
                self._down(inst)
                continue
            finally:
                self.router.done(inst)
            if isinstance(msg, Error):
                raise RemoteError(msg.code, msg.message, msg.request_id)
            assert isinstance(msg, Scores)
            self.counts[f"rank_{msg.prefix_source}"] += 1
            if self.placed.pop(int(user), inst) != inst:
                self.counts["fallback"] += 1                    # pre-inferred elsewhere: full inference here
            return msg.scores.to_numpy().copy(), msg.prefix_source, inst
        raise RuntimeError("no live ranking instance")

    async def warm_up(self, items, ts, cands, timeout_s: float = 120.0) -> None:
        """One ranking request on every instance directly (first-call initialisation off the clock).
        Uses user id -1, so no user's cache or affinity is touched."""
        for inst, ch in list(self.channels.items()):
            rid = f"warm-{next(self.ids)}@{inst}"
            fut = self.pending[rid] = asyncio.get_running_loop().create_future()
            await ch.send(Rank(request_id=rid, user_id=-1, item_ids=[int(i) for i in items],
                               timestamps=[int(t) for t in ts], candidate_ids=[int(c) for c in cands]))
            await asyncio.wait_for(fut, timeout_s)

    async def close(self) -> None:
        """Close every channel; stop the instances launch() started (connect()ed ones keep running)."""
        for ch in list(self.channels.values()):
            try:
                await ch.close()
            except Exception:
                pass
        for t in self.readers:
            t.cancel()
        for p in self.owned:
            await asyncio.to_thread(p.stop)
        self.owned = []
