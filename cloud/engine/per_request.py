"""The per-request engine: one request's decode loop on a `TorchEngine`, behind `EngineClient`.

Model steps of every request run on one worker thread (a FIFO executor), so concurrent requests
interleave step by step and the event loop stays free for I/O. Beyond what the batching engine
does, a request here can ask for prompt refinement (`refine`: the kept prompt positions come as
`RefinedIndices` right after token 0) or the KV hand-off (`kv_from`: the prompt's KV comes as
`KVParts` right after token 0), and can reuse the KV of its session's previous turn
(`SessionSlot`: the longest common prefix is not prefilled again).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from relayinfer.protocol.model.decoding import SamplingParams, finish_reason, sample
from relayinfer.protocol.model.grammar import new_guide_async
from relayinfer.protocol.kvhandoff import common_prefix
from relayinfer.protocol.transport.limits import Charge, MemoryBudget
from relayinfer.cloud.refine import WINDOW, select
from relayinfer.protocol.model.refine import TemplateMarkers

from .interface import EngineLimits, EngineOutput, KVParts, RefinedIndices
from .llm_engine import MAX_FORWARD_FAILURES, RequestStats, StepOutput

REUSE_WAIT_S = 1.0  # longest wait of a new turn for the previous, stopping turn's KV (s)
STATS_KEPT = 1000  # finished requests whose `RequestStats` stay readable (count)


@dataclass
class KeptKV:
    """The KV cache of a session's last finished request: `ids` are the tokens whose K/V `kv` holds
    (prompt + the answer tokens the cloud decoded); `charge`: its bytes in the memory budget."""

    ids: list[int]
    kv: object
    charge: Charge | None = None


class KeptKVStore:
    """Multi-turn reuse over all sessions: each session keeps its last turn's KV cache
    (`SessionSlot`) while `kept_tokens` stays within `max_kept_tokens` and the memory budget holds
    its bytes (`kv_bytes_per_token` x the cache's capacity, under the path 'kept_kv')."""

    def __init__(self, budget: MemoryBudget, max_kept_tokens: int, kv_bytes_per_token: Callable[[], int]):
        self.budget, self.max_kept_tokens = budget, max_kept_tokens
        self._per_token = kv_bytes_per_token
        self.kept_tokens = 0

    def slot(self) -> "SessionSlot":
        """A new session's slot (empty)."""
        return SessionSlot(self)

    def _keep(self, ids: list[int], kv) -> KeptKV | None:
        if self.kept_tokens + len(ids) > self.max_kept_tokens:
            return None
        charge = self.budget.try_charge("kept_kv", self._per_token() * kv.capacity)
        if charge is None:
            return None
        self.kept_tokens += len(ids)
        return KeptKV(ids, kv, charge)

    def _drop(self, kept: KeptKV) -> None:
        self.kept_tokens -= len(kept.ids)
        kept.kv = None
        if kept.charge is not None:
            kept.charge.release()


class SessionSlot:
    """One session's kept KV (at most one cache: the last turn's, taken by the next turn)."""

    def __init__(self, store: KeptKVStore):
        self._store = store
        self._kept: KeptKV | None = None
        self._ending: set[asyncio.Event] = set()  # per-request requests of the session being stopped

    async def take(self) -> KeptKV | None:
        """The kept cache, now this request's alone (its bytes leave the kept-KV charge: the
        request's own charge covers them). While the slot is empty and a request of the session is
        stopping, wait for it (at most `REUSE_WAIT_S`): its KV comes."""
        if self._kept is None and self._ending:
            waits = [asyncio.create_task(e.wait()) for e in self._ending]
            try:
                await asyncio.wait(waits, timeout=REUSE_WAIT_S)
            finally:
                for w in waits:
                    w.cancel()
        kept, self._kept = self._kept, None
        if kept is not None:
            self._store.kept_tokens -= len(kept.ids)
            if kept.charge is not None:
                kept.charge.release()
        return kept

    def offer(self, ids: list[int], kv) -> None:
        """Keep a finished turn's cache when the slot is empty and the store admits it."""
        if self._kept is None:
            self._kept = self._store._keep(ids, kv)

    def close(self) -> None:
        """The session ended: its kept cache is freed."""
        if self._kept is not None:
            self._store._drop(self._kept)
            self._kept = None


@dataclass
class _Live:
    n_prompt: int
    budget: int | None
    slot: SessionSlot | None
    aborted: bool = False
    cached: int = 0  # prompt tokens whose KV came from the session's previous turn
    generated: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class PerRequestEngine:
    """`EngineClient` over a `TorchEngine` (or anything with its `prefill` / `prefill_scored` /
    `decode` / `warmup` interface, `eos_id`, `context_length`, `cfg`), one request at a time per
    step on one worker thread.

    Fault isolation: an exception while serving one request (its sampling, a model step, the
    hand-off) ends that request alone (the exception leaves its `generate`, its KV is dropped).
    `MAX_FORWARD_FAILURES` requests in a row (over all requests) ending in a failed model step
    (prefill or decode) mean the model itself cannot go on: `health()` then names the last failure
    (the service's /healthz answers 503 and the process exits non-zero after draining). A request
    that ends without one starts the count again.

    Args:
        engine: the model runtime; logits float32 numpy [vocab], KV a `StaticKV`.
        markers: returns the chat template's scaffold refinement keeps whole (read on first use).
        step_delay_ms: extra wait before each decode step (ms; simulates a slower cloud in tests
            and benchmarks, 0 in production).
    """

    def __init__(self, engine, markers: Callable[[], TemplateMarkers], step_delay_ms: float = 0.0):
        self.engine, self.step_delay_ms = engine, step_delay_ms
        self._markers = markers
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloud-model")
        self._live: dict[str, _Live] = {}
        self._step_failures = 0  # requests in a row that ended in a failed model step
        self._failed: str | None = None  # why the model cannot go on, once it cannot
        self._ended: OrderedDict[str, RequestStats] = OrderedDict()  # the last STATS_KEPT finished

    @property
    def limits(self) -> EngineLimits:
        """The model's context and vocabulary; a request's cache grows up to the context."""
        return EngineLimits(self.engine.context_length, self.engine.cfg.vocab_size)

    @property
    def prefill_tok_s(self) -> float | None:
        return None  # not measured on this path

    @property
    def metrics_registry(self) -> None:
        return None

    def health(self) -> str | None:
        """None while the model steps; else why not (`MAX_FORWARD_FAILURES` requests in a row
        ended in a failed model step)."""
        return self._failed

    async def _step(self, fn, *args):
        """Run one model step `fn(*args)` on the worker; a failure is counted (once per request:
        the exception ends it) before it propagates."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)
        except Exception as e:
            self._step_failures += 1
            if self._step_failures >= MAX_FORWARD_FAILURES and self._failed is None:
                self._failed = (f"engine failed: {self._step_failures} requests in a row failed in a model step, "
                                f"the last: {type(e).__name__}: {e}")
            raise

    def state(self) -> dict:
        return {"running": len(self._live)}

    def request_stats(self, request_id: str) -> RequestStats | None:
        """Counters of a live or recently finished request (the last `STATS_KEPT`), None when
        unknown: `prefix_hit_tokens` = tokens reused from the session's previous turn."""
        live = self._live.get(request_id)
        if live is None:
            return self._ended.get(request_id)
        return RequestStats(live.n_prompt, live.cached, 0, live.generated, None, None, None)

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.aborted:
            return
        live.aborted = True
        if live.slot is not None:  # the session's next turn waits for this one's KV
            live.slot._ending.add(live.ended)

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.budget = cloud_budget

    async def warmup(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.worker, self.engine.warmup)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       cloud_budget: int | None = None, *, refine: float | None = None, kv_from: int | None = None,
                       session: SessionSlot | None = None) -> AsyncIterator[EngineOutput]:
        """Prefill, then one `StepOutput` per token until EOS / stop id / length / budget (set as
        the token's `finish_reason`) or `abort` (the stream ends without one). `refine`: keep
        ratio in (0, 1] (a `RefinedIndices` after token 0); `kv_from`: first prompt position of
        the KV hand-off (a `KVParts` after token 0). `session`: the slot whose kept KV a request
        without refinement reuses, and where it keeps its own when it ends (not when the consumer
        leaves early). Raises ValueError for a request id that is already running."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already running")
        self._ended.pop(request_id, None)
        # registered first: an abort or a budget that comes while the grammar compiles applies
        live = self._live[request_id] = _Live(len(prompt_ids), cloud_budget, session)
        kv, ids, out_ids, ended = None, list(prompt_ids), [], False
        loop = asyncio.get_running_loop()
        try:
            # GrammarError first; compiled on a worker thread while the loop streams the other requests
            guide = await new_guide_async(params, lambda: self.engine.tokenizer, self.engine.cfg.vocab_size)
            if live.aborted:
                return
            past = await session.take() if session is not None else None  # taken: no two requests share a cache
            logits, kv, kept, live.cached = await self._step(self._prefill, ids, refine, past)
            del past
            for i in range(params.max_new_tokens):
                if live.aborted:
                    break
                tok = sample(logits, params, i, ids + out_ids if params.needs_context else (), len(ids),
                             self.engine.eos_id, guide)
                out_ids.append(tok)
                live.generated = i + 1
                end = finish_reason(tok, i + 1, params, self.engine.eos_id, live.budget, guide)
                yield StepOutput(request_id, tok, i, end)
                if i == 0 and kept is not None:
                    yield RefinedIndices(request_id, kept)
                if i == 0 and kv_from is not None:
                    yield await loop.run_in_executor(self.worker, _kv_transfer, request_id, kv, kv_from,
                                                     len(ids) - 1)
                if end:
                    break
                if self.step_delay_ms:
                    await asyncio.sleep(self.step_delay_ms / 1e3)
                logits, kv = await self._step(self.engine.decode, tok, kv)
            ended = True
            self._step_failures = 0  # this request's model steps all worked
        finally:
            self._ended[request_id] = self.request_stats(request_id)
            while len(self._ended) > STATS_KEPT:
                self._ended.popitem(last=False)
            del self._live[request_id]
            if ended and session is not None and refine is None and kv is not None:
                session.offer((ids + out_ids)[:kv.length], kv)  # the next turn's prefix
            if session is not None:
                session._ending.discard(live.ended)
            live.ended.set()
            del kv  # freed here unless kept for the session's next turn

    def _prefill(self, ids: list[int], refine: float | None, past: KeptKV | None):
        """(logits, kv, kept indices or None, reused tokens). Without refinement the KV of the
        session's previous turn (`past`) is reused for the longest common prefix of its ids and the
        prompt (at most all prompt tokens but the last, whose logits are needed); only the rest is
        prefilled. With refinement the prompt positions to keep are selected from SnapKV-style scores."""
        if refine is not None:
            logits, kv, scores = self.engine.prefill_scored(ids, WINDOW)
            return logits, kv, select(scores, ids, refine, self._markers()), 0  # SELECTION
        k = min(common_prefix(past.ids, ids), len(ids) - 1) if past is not None else 0
        if k > 0:
            kv = past.kv
            kv.length = k  # keep the first k cached tokens (StaticKV is overwritten from `length` on)
            logits, kv = self.engine.prefill(ids[k:], kv)
            return logits, kv, None, k
        logits, kv = self.engine.prefill(ids)
        return logits, kv, None, 0


def _kv_transfer(request_id: str, kv, start: int, end: int) -> KVParts:
    """The KV hand-off to the device: prompt tokens [start, end) as float16 [layers, 2, kv_heads,
    tokens, head_dim] (the ONNX past-KV layout per layer, keys after RoPE)."""
    import torch

    with torch.inference_mode():
        t = torch.stack([kv.k[:, 0, :, start:end], kv.v[:, 0, :, start:end]], dim=1)
        arr = t.to(torch.float16).cpu().numpy()
    return KVParts(request_id, arr, start)
