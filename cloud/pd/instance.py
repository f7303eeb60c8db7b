"""One P/D instance: the continuous-batching engine in a prefill or a decode role.

Every instance runs the same `LLMEngine` (paged KV cache, prefix cache, chunked prefill), so the
ratio controller can move it between roles without a restart; the role only says which requests
the gateway sends it.

* **prefill** (`prefill`): runs the prompt (plus the answer so far when a request is resumed after
  a fault), samples the first token, keeps the blocks (`hold_kv`), exports the K/V (contiguous or
  block-fixed, `kv.py`), frees the blocks and returns a `Handoff`. With a TTFT budget it first
  decides by its own local state whether it can start the prompt in time (queued prompt tokens /
  measured prefill tokens per second) and otherwise rejects at once (`Rejected`): P/D-Serve's
  on-demand forwarding.
* **decode** (`decode`): admits a `Handoff` with its K/V (`LLMEngine.add_prefilled`: shared prefix
  blocks from its own cache, one scatter into fresh blocks for the rest) and streams the tokens that
  follow, decoding in its continuous batch.
* `generate`: the whole request on this instance (split-service requests that the device takes
  over after a few tokens, and the aggregated baseline).

`fault` injects failures for tests (a prefill instance that dies after its export, a decode instance
that dies after some tokens); in a Ray actor "die" is `os._exit`, in-process it raises
`InstanceDied`.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, EngineFailed, LLMEngine, StepOutput
from relayinfer.protocol.model.decoding import SamplingParams

from .kv import MODES, KVPayload, export_kv, writer


class InstanceDied(RuntimeError):
    """The instance (or its process / actor) failed while serving the request."""


@dataclass
class Rejected:
    """On-demand forwarding: the instance cannot start the prompt within the TTFT budget."""

    instance: str
    est_wait_ms: float
    budget_ms: float


@dataclass
class Handoff:
    """A prefilled request on its way to a decode instance.

    token_ids: prompt + answer so far (the token sampled at the prefill instance last);
        `kv` covers all of them but the last.
    finish_reason: the engine's reason after the first new token ('budget' just means "prefill
        done": the gateway decides whether the request goes on).
    prefill_ms / queue_ms: the prefill's time here and its wait before it was scheduled (ms).
    prefix_hit_tokens: tokens the prefill reused from this instance's prefix cache.
    logprobs: the new token's (logprob, top alternatives) when `params.logprobs` is set, else None.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    finish_reason: str | None
    kv: KVPayload | None
    instance: str
    prefill_ms: float = 0.0
    queue_ms: float = 0.0
    prefix_hit_tokens: int = 0
    logprobs: tuple | None = None

    @property
    def new_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class InstanceConfig:
    kv_cache_bytes: int = 64 << 20
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    transfer: str = "contiguous"
    prefill_tok_s: float = 1000.0   # prior until measured (EWMA of the engine's prefill steps)
    overhead_ms: float = 5.0        # per-request fixed cost added to the wait estimate


@dataclass
class _Faults:
    die_after_export: int = 0       # the next n prefills die after exporting their KV
    die_after_tokens: int | None = None  # the next decode dies after this many tokens
    counts: dict = field(default_factory=dict)


class Instance:
    """A P/D instance over one `LLMEngine` (create inside the event loop that uses it)."""

    def __init__(self, model, name: str, role: str = "prefill", config: InstanceConfig | None = None,
                 in_process: bool = True):
        self.name, self.role = name, role
        self.config = c = config or InstanceConfig()
        if c.transfer not in MODES:
            raise ValueError(f"unknown KV transfer mode {c.transfer!r}; choose from {', '.join(MODES)}")
        self.llm = AsyncLLMEngine(LLMEngine(model, kv_cache_bytes=c.kv_cache_bytes, block_size=c.block_size,
                                            max_num_batched_tokens=c.max_num_batched_tokens,
                                            max_num_seqs=c.max_num_seqs,
                                            enable_prefix_caching=c.enable_prefix_caching))
        self.engine = self.llm.engine
        self.outstanding: dict[str, int] = {}  # accepted prompts not prefilled yet: tokens
        self.in_process = in_process
        self.faults = _Faults()
        self.counters = {"prefills": 0, "decodes": 0, "generates": 0, "rejected": 0, "kv_bytes_out": 0,
                         "kv_bytes_in": 0, "kv_objects_out": 0, "kv_objects_in": 0}
        self.transfers: list[dict] = []  # recent hand-off timings (export / import), newest last

    # --- local state ------------------------------------------------------------------------------
    @property
    def prefill_tok_s(self) -> float:
        return self.engine.prefill_tok_s or self.config.prefill_tok_s

    def est_wait_ms(self, n_new: int = 0) -> float:
        """Time until a prompt of `n_new` tokens would have its first token here: queued prompt
        tokens ahead of it plus its own, at the measured prefill speed."""
        return (sum(self.outstanding.values()) + n_new) / self.prefill_tok_s * 1e3 + self.config.overhead_ms

    def check_engine(self) -> None:
        """Raise `InstanceDied` naming the cause once the engine has failed (the instance must be
        replaced; the gateway does that)."""
        err = self.llm.error
        if err is not None:
            raise InstanceDied(f"instance {self.name}: engine failed: {type(err).__name__}: {err}")

    def load(self) -> dict:
        """The instance's load report. Raises `InstanceDied` when its engine has failed."""
        self.check_engine()
        e = self.engine
        return {"name": self.name, "role": self.role, "queued_prefill_tokens": sum(self.outstanding.values()),
                "queued_requests": len(self.outstanding), "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting), "imports": len(e._imports), "held": len(e.held),
                "kv_blocks_used": e.block_manager.num_used_blocks, "kv_blocks_total": e.num_blocks,
                "prefill_tok_s": round(self.prefill_tok_s, 1), "est_wait_ms": round(self.est_wait_ms(), 2),
                "pid": os.getpid(), **self.counters}

    def _admit(self, rid: str, n: int, ttft_budget_ms: float | None) -> Rejected | None:
        if ttft_budget_ms is not None:
            est = self.est_wait_ms(n)
            if est > ttft_budget_ms:
                self.counters["rejected"] += 1
                return Rejected(self.name, est, ttft_budget_ms)
        self.outstanding[rid] = n
        return None

    def _die(self, what: str):
        if self.in_process:
            raise InstanceDied(f"instance {self.name} died ({what}, injected fault)")
        os._exit(1)  # a crashed worker process: Ray sees the actor die and restarts it

    def set_fault(self, die_after_export: int = 0, die_after_tokens: int | None = None,
                  fail_engine: bool = False) -> None:
        """Injected faults (tests): see the module docstring. `fail_engine`: the engine's next step
        fails outside any request (`EngineFailed`), as a broken device would make it; the engine
        thread ends and the instance reports itself dead until it is replaced."""
        self.faults.die_after_export, self.faults.die_after_tokens = die_after_export, die_after_tokens
        if fail_engine:
            def broken():
                raise RuntimeError("injected engine fault")

            self.engine.scheduler.schedule = broken

    # --- prefill role -----------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      output_ids: list[int] = (), ttft_budget_ms: float | None = None) -> Handoff | Rejected | None:
        """Prefill and export (None if aborted meanwhile); `Rejected` at once when `ttft_budget_ms`
        is given and the local queue cannot start it in time."""
        n = len(prompt_ids) + len(output_ids)
        rej = self._admit(request_id, n, ttft_budget_ms)
        if rej is not None:
            return rej
        t0 = time.perf_counter()
        first: StepOutput | None = None
        try:
            async for o in self.llm.generate(request_id, prompt_ids, params, len(output_ids) + 1, hold_kv=True,
                                             output_ids=output_ids):
                first = o
        except RuntimeError:
            self.check_engine()  # the engine failed: InstanceDied (the gateway retries elsewhere)
            raise
        finally:
            self.outstanding.pop(request_id, None)
        if first is None:  # aborted before its first token (the engine freed everything)
            return None
        self.counters["prefills"] += 1
        seq = self.engine.held.get(request_id)
        try:
            stats = self.engine.request_stats(request_id)
            tokens = list(prompt_ids) + list(output_ids) + [first.token_id]
            kv = None
            if first.finish_reason == "budget" and seq is not None:  # it goes on: hand the KV over
                kv = await asyncio.to_thread(export_kv, self.engine.runner, list(seq.block_table), len(tokens) - 1,
                                             self.config.transfer)
                self.counters["kv_bytes_out"] += kv.nbytes
                self.counters["kv_objects_out"] += kv.num_objects
        finally:
            self.llm.release(request_id)
        if kv is not None and self.faults.die_after_export > 0:
            self.faults.die_after_export -= 1
            self._die("after the KV export, before the hand-off")
        return Handoff(request_id, tokens, len(prompt_ids), params, first.finish_reason, kv, self.name,
                       prefill_ms=(time.perf_counter() - t0) * 1e3,
                       queue_ms=(stats.queue_s or 0.0) * 1e3 if stats else 0.0,
                       prefix_hit_tokens=stats.prefix_hit_tokens if stats else 0, logprobs=first.logprobs)

    # --- decode role ------------------------------------------------------------------------------
    async def decode(self, handoff: Handoff, request_id: str | None = None,
                     cloud_budget: int | None = None) -> AsyncIterator[StepOutput]:
        """Admit `handoff` (its `kv` parts already arrays) and stream the tokens after it."""
        kv = handoff.kv
        self.counters["decodes"] += 1
        self.counters["kv_bytes_in"] += kv.nbytes
        self.counters["kv_objects_in"] += kv.num_objects
        die_after, self.faults.die_after_tokens = self.faults.die_after_tokens, None
        n = 0
        rid = request_id or handoff.request_id
        try:
            async for o in self.llm.generate_prefilled(rid, handoff.token_ids, handoff.num_prompt_tokens,
                                                       handoff.params, writer(kv), cloud_budget):
                if n == 0:
                    self.transfers = (self.transfers + [{"tokens": kv.num_tokens, "mode": kv.mode, "bytes": kv.nbytes,
                                                         "objects": kv.num_objects, "export_ms": kv.export_s * 1e3,
                                                         "fetch_ms": kv.fetch_s * 1e3,
                                                         "import_ms": kv.import_s * 1e3}])[-64:]
                if die_after is not None and n >= die_after:
                    self._die(f"after {n} decoded tokens")
                n += 1
                yield o
        except RuntimeError:
            self.check_engine()
            raise

    # --- whole requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       cloud_budget: int | None = None, output_ids: list[int] = (),
                       ttft_budget_ms: float | None = None) -> AsyncIterator[StepOutput | Rejected]:
        """The whole request here; a `Rejected` first (and nothing else) when the TTFT budget cannot be met."""
        rej = self._admit(request_id, len(prompt_ids) + len(output_ids), ttft_budget_ms)
        if rej is not None:
            yield rej
            return
        self.counters["generates"] += 1
        try:
            async for o in self.llm.generate(request_id, prompt_ids, params, cloud_budget, output_ids=output_ids):
                self.outstanding.pop(request_id, None)
                yield o
        except RuntimeError:
            self.check_engine()
            raise
        finally:
            self.outstanding.pop(request_id, None)

    def prefix_hits(self, request_id: str) -> int | None:
        """Tokens request `request_id` reused from this instance's prefix cache (None if unknown)."""
        stats = self.engine.request_stats(request_id)
        return None if stats is None else stats.prefix_hit_tokens

    def abort(self, request_id: str) -> None:
        self.outstanding.pop(request_id, None)
        self.llm.abort(request_id)

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        self.llm.set_budget(request_id, cloud_budget)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (waits at most `timeout_s` s)."""
        self.llm.shutdown(timeout_s)
