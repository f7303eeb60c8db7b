"""A ranking instance: HSTU + HBM prefix pool + DRAM tier + trigger + expander (in-process core).

pre_infer(user, history) is the retrieval-time signal: the trigger admits it or not; an admitted
prefix is computed and kept in the HBM pool until its ranking request consumes it or ttl_s expires.
rank(user, history, candidates) scores from the cached prefix when there is one (source "hbm"),
reloads it from DRAM when the user returned within the window ("dram"), and otherwise runs full
inference ("recompute"; "none" when the relay is disabled, i.e. the baseline). After ranking the
prefix moves to DRAM. A prefix is keyed by (user id, digest of the exact history), so a stale or
different history can never be served from the cache.

The network server (relayinfer.cloud.relay.server) runs the same object: submit_pre_infer() decides
admission on the event loop and returns a job for the compute worker; rank() cancels a still-queued
job of its own key (full inference instead) or waits for a running one.
Source: RelayGR (pre-inferred user prefixes for long-sequence GR ranking).
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from relayinfer.cloud.models.hstu import HSTU, PrefixKV, kv_bytes_per_token
from relayinfer.cloud.relay.expander import Expander
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.pool import DramTier, Entry, HBMPool
from relayinfer.cloud.relay.trigger import Trigger, TriggerConfig
from relayinfer.protocol.validate import MAX_TIMESTAMP, FieldError, check, check_ids

MAX_HISTORY = 16_384
MAX_CANDS = 4_096


@dataclass
class InstanceConfig:
    """Instance settings: byte budgets, lifecycle timeout and reuse window (s), trigger settings."""
    relay: bool = True                  # False: baseline, full inference on the critical path
    hbm_bytes: int = 64 << 20           # prefix pool budget (accounted "HBM")
    dram_bytes: int = 256 << 20         # DRAM tier budget
    ttl_s: float = 5.0                  # lifecycle timeout of a pre-inferred prefix in the pool
    dram_window_s: float = 10.0         # reuse window in DRAM
    trigger: TriggerConfig = field(default_factory=TriggerConfig)


def history_key(user: int, items: np.ndarray, ts: np.ndarray) -> tuple[int, str]:
    """Cache key: (user id, blake2b digest of the exact item ids and timestamps)."""
    d = hashlib.blake2b(np.ascontiguousarray(items, np.int64).tobytes(), digest_size=12)
    d.update(np.ascontiguousarray(ts, np.int64).tobytes())
    return int(user), d.hexdigest()


class PreInferJob:
    """An admitted pre-inference waiting for the compute worker. state: queued|running|done|cancelled."""

    def __init__(self, inst: "RankingInstance", key, items, ts, reserved: int):
        self.inst, self.key, self.items, self.ts, self.reserved = inst, key, items, ts, reserved
        self.state, self.event = "queued", threading.Event()
        self.boosted = False   # a ranking request waits on it: finish at ranking priority

    def priority(self) -> int:
        """Worker priority: 1 (behind rankings), 0 once a ranking request waits for this prefix."""
        return 0 if self.boosted else 1

    def steps(self):
        """Generator: the chunked pre-inference (yields between attention chunks), then the pool put."""
        inst = self.inst
        with inst.lock:
            if self.state != "queued":
                return
            self.state = "running"
            inst.counts["preinfer_started"] += 1
        try:
            kv = yield from inst.model.prefix_forward_steps(self.items[None], self.ts[None], torch.tensor([len(self.items)]))
            inst.pool.put(Entry(self.key, kv, self.reserved, inst.clock() + inst.cfg.ttl_s), self.reserved)
            inst.counts["preinfer_done"] += 1
        except BaseException:
            inst.pool.release(self.reserved)
            raise
        finally:
            with inst.lock:
                self.state = "done"
                inst.pending.pop(self.key, None)
            self.event.set()

    def __call__(self) -> None:
        """Run all steps now."""
        for _ in self.steps():
            pass


class RankingInstance:
    """Thread-safe ranking instance. Errors: ValueError on bad input (empty history, unknown ids,
    length mismatch, too long); the instance stays usable."""

    def __init__(self, model: HSTU, latency: LatencyModel, cfg: InstanceConfig | None = None, clock=time.monotonic):
        self.model, self.latency, self.cfg, self.clock = model.eval(), latency, cfg or InstanceConfig(), clock
        c = self.cfg
        self.bpt = kv_bytes_per_token(model.cfg) + 8      # K, V of all layers + the timestamp
        self.pool = HBMPool(c.hbm_bytes, clock)
        self.dram = DramTier(c.dram_bytes, c.dram_window_s, clock)
        self.expander = Expander(self.pool, self.dram, c.ttl_s, copy=PrefixKV.clone)
        self.trigger = Trigger(c.trigger, latency.full_ms, self.pool, self.bpt, clock)
        self.pending: dict[tuple, PreInferJob] = {}
        self.counts: Counter = Counter()
        self.lock = threading.RLock()

    # ---- input checks ----------------------------------------------------------------------------
    def _tensors(self, items, ts, cands=None):
        # the shared rules (`protocol.validate`): item ids of this model's catalogue, timestamps in
        # [0, 2**40] s (no gap overflows), one timestamp per history item; FieldError names the field
        n = self.model.cfg.num_items
        items = check_ids("item_ids", items, n, rule="item_id", min_len=1, max_len=MAX_HISTORY)
        ts = check_ids("timestamps", ts, MAX_TIMESTAMP, rule="timestamp")
        if len(ts) != len(items):
            raise FieldError("timestamps", f"a list of {len(items)} timestamps (one per item_ids entry)", ts)
        if cands is not None:
            cands = torch.as_tensor(np.asarray(check_ids("candidate_ids", cands, n, rule="item_id", min_len=1,
                                                         max_len=MAX_CANDS), np.int64))
        items = torch.as_tensor(np.asarray(items, np.int64))
        ts = torch.as_tensor(np.asarray(ts, np.int64))
        return items, ts, cands

    # ---- pre-infer -------------------------------------------------------------------------------
    def submit_pre_infer(self, user: int, items, ts) -> tuple[str, PreInferJob | None]:
        """Admission only. Outcome: admitted | pending | cached | dram | disabled | short | load | footprint."""
        items, ts, _ = self._tensors(items, ts)
        check("user_id", user)
        key = history_key(user, items.numpy(), ts.numpy())
        with self.lock:
            if not self.cfg.relay:
                outcome, job = "disabled", None
            elif key in self.pending:
                outcome, job = "pending", None
            elif self.pool.get(key) is not None:
                outcome, job = "cached", None
            elif key in self.dram and self.expander.reload(key) is not None:
                outcome, job = "dram", None
            else:
                ok, reason, nbytes = self.trigger.admit(len(items))
                if ok:
                    job = self.pending[key] = PreInferJob(self, key, items, ts, nbytes)
                    outcome = "admitted"
                else:
                    outcome, job = reason, None
            self.counts[f"preinfer_{outcome}"] += 1
        return outcome, job

    def pre_infer(self, user: int, items, ts) -> str:
        """Admit and (if admitted) compute the prefix now. Returns the outcome string."""
        outcome, job = self.submit_pre_infer(user, items, ts)
        if job is not None:
            job()
        return outcome

    def running_job(self, user: int, items, ts) -> PreInferJob | None:
        """The started (partly computed) pre-inference of this exact history, if any. A server
        waits for it before queueing the ranking request behind it."""
        try:
            items, ts, _ = self._tensors(items, ts)
        except ValueError:
            return None
        with self.lock:
            job = self.pending.get(history_key(user, items.numpy(), ts.numpy()))
            return job if job is not None and job.state == "running" else None

    # ---- rank ------------------------------------------------------------------------------------
    def rank(self, user: int, items, ts, cands, request_ts: int | None = None) -> tuple[np.ndarray, str]:
        """Scores (N,) float32 for the candidates at request time request_ts (int seconds; None: the last
        history event's time) and the prefix source hbm | dram | recompute | none. The cached prefix
        does not depend on the request time, so one prefix serves the user's rankings at any time."""
        items, ts, cands = self._tensors(items, ts, cands)
        check("user_id", user)
        check("timestamp", request_ts, "request_ts", optional=True)
        rts = None if request_ts is None else torch.tensor([int(request_ts)])
        key = history_key(user, items.numpy(), ts.numpy())
        with self.lock:
            job = self.pending.get(key)
            if job is not None and job.state == "queued":   # not started: cheaper to rank in full now
                job.state = "cancelled"
                self.pending.pop(key, None)
                self.pool.release(job.reserved)
                self.counts["preinfer_cancelled"] += 1
                job = None
        if job is not None:
            job.event.wait(60)
        entry, source = None, "none"
        if self.cfg.relay:
            entry, source = self.pool.get(key), "hbm"
            if entry is None:
                with self.lock:
                    in_dram = key in self.dram
                entry, source = (self.expander.reload(key), "dram") if in_dram else (None, "recompute")
                if entry is None:
                    source = "recompute"
        if entry is not None:
            scores = self.model.rank(entry.kv, cands[None], rts)[0]
            self.expander.demote(key)
        else:
            kv = self.model.prefix_forward(items[None], ts[None], torch.tensor([len(items)]))
            scores = self.model.rank(kv, cands[None], rts)[0]
            if self.cfg.relay:
                self.expander.keep(Entry(key, kv, len(items) * self.bpt, 0.0))
        self.counts[f"rank_{source}"] += 1
        return scores.numpy().astype(np.float32), source

    def stats(self) -> dict:
        """Counters plus pool/DRAM occupancy (bytes) and trigger/expander counters."""
        with self.lock:
            return {**dict(self.counts), "hbm_used": self.pool.used, "hbm_reserved": self.pool.reserved,
                    "hbm_peak": self.pool.peak, "hbm_capacity": self.pool.capacity, "hbm_expired": self.pool.expired,
                    "dram_used": self.dram.used, "reloads": self.expander.reloads,
                    "reload_waits": self.expander.reload_waits, "trigger": dict(self.trigger.counts),
                    "preinfer_tokens": self.trigger.admitted_tokens}
