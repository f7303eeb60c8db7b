"""The batching engine: requests in, tokens out, one `step()` at a time; plus an asyncio wrapper.

`LLMEngine.step` is nano-vllm's: `Scheduler.schedule` picks the step's tokens, `ModelRunner`
computes them on the paged cache, `sampler.sample_batch` draws one token per sampling row (argmax
for greedy rows, else `protocol.model.decoding.sample`: numpy, seeded per answer position, so a seeded
request draws the same tokens here as on `TorchEngine` or the device), and
`Scheduler.postprocess` appends them, decides each answer's end and frees the blocks of the
finished. `add_request` and `abort` are thread-safe (they go through an inbox drained at the start
of each step), so `step()` can run on a background thread while an event loop adds and cancels
requests: that is `AsyncLLMEngine`, which also feeds each step's outputs and `StepStats` to the
Prometheus metrics (`metrics.EngineMetrics`); the engine itself holds none.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, NamedTuple, Sequence as Seq

import numpy as np

from relayinfer.cloud.models.llama import Llama
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.errors import PromptTooLongError
from relayinfer.protocol.model.grammar import Guide, new_guide, new_guide_async

from .torch_engine import tokenizer_of

from .block_manager import BlockManager
from .interface import EngineLimits, KVParts
from .metrics import EngineMetrics, Finished, StepStats
from .model_runner import ModelRunner, kv_bytes_per_token
from .sampler import sample_batch
from .scheduler import ScheduledSeq, Scheduler, SchedulerConfig, StepPlan, StepResult
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("relayinfer.engine")

MAX_FORWARD_FAILURES = 3  # consecutive failed batched forwards before the engine declares itself failed


class RequestFailed(RuntimeError):
    """One request failed while the engine served it (its sampling, logits processing, bookkeeping,
    K/V import or the batched forward it was in); the engine freed its KV blocks and goes on serving
    the others. `request_id` names it, `__cause__` is the exception raised."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id!r} failed in the engine: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.__cause__ = cause


class EngineFailed(RuntimeError):
    """The engine cannot go on (a failure outside any request, or `MAX_FORWARD_FAILURES` batched
    forwards failing in a row); every live request fails with it."""


def check_fits(n_prompt: int, max_new_tokens: int, context_length: int, kv_capacity: int,
               kv_what: str = "the KV cache capacity") -> None:
    """Admission of one request (tokens): prompt + max_new_tokens must fit min(context_length,
    kv_capacity). Raises PromptTooLongError naming both limits, ValueError for an empty prompt."""
    if n_prompt == 0:
        raise ValueError("empty prompt: at least one token is needed")
    limit = min(context_length, kv_capacity)
    if n_prompt + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt too long: {n_prompt} prompt tokens + {max_new_tokens} new tokens exceed this server's "
            f"limit of {limit} tokens per request (min of the context length, {context_length}, and "
            f"{kv_what}, {kv_capacity})")


class StepOutput(NamedTuple):
    """One generated token: `index` is its answer position (0 = first token); `finish_reason`
    is None, or 'eos' / 'stop' / 'length' / 'budget' on the request's last token. `logprobs`:
    None unless `params.logprobs` is set, then `decoding.token_logprobs` of the step's raw logits
    (the token's logprob, [(id, logprob)] of the top `params.logprobs`)."""

    request_id: str
    token_id: int
    index: int
    finish_reason: str | None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
    kv: np.ndarray | None = None  # token 0 of a request with `kv_export`: its exported float16 KV


@dataclass(frozen=True)
class RequestStats:
    """Per-request counters: prompt tokens, prompt tokens reused from the prefix cache (summed over
    admissions), preemptions, generated tokens, queue time / TTFT (s)."""

    num_prompt_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    finish_reason: str | None


_RELEASE = object()  # inbox marker: free a held sequence's KV blocks (P/D prefill after its export)


@dataclass
class _Import:
    """A sequence arriving with its KV computed elsewhere (P/D decode): `write(runner, slots, start)`
    writes the K/V of positions [start, seq.num_computed_tokens) into `slots` on the engine thread."""

    seq: Sequence
    num_computed: int
    write: Callable


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        model: a loaded `Llama`, or anything with a `.model` Llama (e.g. `TorchEngine`).
        kv_cache_bytes: memory for the KV cache (bytes); blocks = bytes // (block_size *
            kv_bytes_per_token). Default 256 MiB.
        block_size: tokens per KV block.
        max_num_batched_tokens: token budget per step (prefill chunk size bound).
        max_num_seqs: running sequences at most.
        enable_prefix_caching: share full blocks across requests with equal token prefixes.
        tokenizer: the model's `Tokenizer`, for structured output (`params.grammar`); None takes
            that of the model's file (`torch_engine.tokenizer_of`, for a model a TorchEngine loaded).

    Raises ValueError when `kv_cache_bytes` holds no block.

    Fault isolation: an exception raised while serving one request (its sampling, logits
    processing, stop check, per-sequence bookkeeping, K/V import) ends that request only: it is
    finished with reason 'error', its KV blocks are freed, and `take_failures()` returns
    (request_id, `RequestFailed`) for the caller to deliver. A failed batched forward fails the
    sequences of that step alone; `MAX_FORWARD_FAILURES` of them in a row, or a failure outside any
    request (scheduling, the inbox), raise `EngineFailed` from `step()`.

    Metrics: `last_stats` is the `StepStats` of the last step, for an observer outside the engine
    (`AsyncLLMEngine` feeds `metrics.EngineMetrics`).
    """

    def __init__(self, model, kv_cache_bytes: int = 256 << 20, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64, enable_prefix_caching: bool = True,
                 tokenizer=None):
        self.model: Llama = model if isinstance(model, Llama) else model.model
        path = getattr(self.model, "model_path", None)  # set by TorchEngine on the model it loads
        self._tokenizer = tokenizer if tokenizer is not None else None if path is None else (lambda: tokenizer_of(path))
        self.kv_bytes_per_token = kv_bytes_per_token(self.cfg, next(self.model.parameters()).dtype)
        num_blocks = kv_cache_bytes // (block_size * self.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no block of {block_size} tokens "
                             f"({self.kv_bytes_per_token} bytes per token)")
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs), self.block_manager,
                                   self.cfg.eos_id)
        self.runner = ModelRunner(self.model, num_blocks, block_size)
        self.seqs: dict[str, Sequence] = {}      # live requests
        self.stats: OrderedDict[str, RequestStats] = OrderedDict()  # finished requests, last 10000
        self.held: dict[str, Sequence] = {}      # finished with hold_kv: blocks kept until release()
        self.prefill_tok_s: float | None = None  # EWMA of prefill tokens per second of step time
        self.last_stats = StepStats()
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._imports: deque[_Import] = deque()  # prefilled elsewhere, waiting for blocks / a slot
        self._failures: list[tuple[str, RequestFailed]] = []  # failed in the last steps, not yet taken
        self._forward_failures = 0  # consecutive failed batched forwards

    @property
    def cfg(self):
        """The model's `ModelConfig`."""
        return self.model.cfg

    @property
    def eos_id(self) -> int:
        return self.cfg.eos_id

    @property
    def tokenizer(self):
        """The model's `Tokenizer` (the `tokenizer` argument, else its file's, loaded on first use);
        None for an engine on a `Llama` built in memory. Structured output needs it."""
        return self._tokenizer() if callable(self._tokenizer) else self._tokenizer

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + answer) one request can hold: min(context length, KV cache
        capacity). A request above it could never be scheduled, so it is refused at admission."""
        return min(self.context_length, self.num_blocks * self.block_size)

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise PromptTooLongError naming the effective limit if the request cannot fit
        (`max_model_len` tokens: min(context length, KV cache capacity)); ValueError if empty."""
        check_fits(n_prompt, max_new_tokens, self.context_length, self.num_blocks * self.block_size)

    # --- thread-safe request API ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                    cloud_budget: int | None = None, ignore_eos: bool = False, *, hold_kv: bool = False,
                    output_ids: Seq[int] = (), kv_from: int | None = None, guide: Guide | None = None) -> None:
        """Queue a request. `cloud_budget` caps the tokens generated here (finish reason 'budget'
        when it, not max_new_tokens, ends the request). `ignore_eos` generates past EOS (fixed
        output lengths for benchmarks, vLLM's `SamplingParams.ignore_eos`).

        P/D: `hold_kv` keeps the finished sequence's KV blocks (in `held`) until `release()`, so a
        prefill instance can export them; `output_ids` resumes a request whose first answer tokens
        were generated elsewhere (they are prefilled with the prompt and answer positions continue
        after them, so seeded sampling draws the same tokens).

        KV hand-off: `kv_from` copies the K/V of prompt positions [kv_from, n - 1) (all but the
        last prompt token, which the device prefills itself) out of the paged cache, float16, in
        the step that samples token 0; that token's `StepOutput.kv` carries it
        (`ModelRunner.export_kv`). The copy runs on the engine thread, between the step's forward
        and its postprocess (the blocks are still the sequence's).

        `guide`: the request's grammar `Guide` built already (off the event loop,
        `AsyncLLMEngine`); by default it is built here from `params.grammar`.

        Raises:
            PromptTooLongError: prompt + max_new_tokens exceed `max_model_len` (the context window
                or the whole KV cache, whichever is smaller; the message names the limit).
            ValueError: empty prompt or duplicate live request_id.
            GrammarError: `params.grammar` does not compile, or the engine has no tokenizer.
        """
        self.check_fits(len(prompt_ids), params.max_new_tokens)
        if kv_from is not None and not 0 <= kv_from < len(prompt_ids) - 1:
            raise ValueError(f"kv_from={kv_from}: the hand-off carries prompt positions [kv_from, "
                             f"{len(prompt_ids) - 1}), at least one")
        max_tokens = params.max_new_tokens if cloud_budget is None else max(0, min(params.max_new_tokens, cloud_budget))
        seq = Sequence(request_id, list(prompt_ids) + list(output_ids), params, max_tokens, ignore_eos=ignore_eos,
                       num_prompt_tokens=len(prompt_ids), hold_kv=hold_kv,
                       kv_export=None if kv_from is None else (kv_from, len(prompt_ids) - 1),
                       guide=guide if guide is not None else new_guide(params, lambda: self.tokenizer, self.cfg.vocab_size))
        self._enqueue(request_id, seq)

    def _enqueue(self, request_id: str, item) -> None:
        with self._lock:
            # a pending abort, release or budget entry of the same id is no second request (an id
            # may be stopped before its task added it, or reused right after it ended)
            if request_id in self.seqs or request_id in self.held or any(
                    r == request_id and isinstance(it, (Sequence, _Import)) for r, it in self._inbox):
                raise ValueError(f"request {request_id!r} is already running")
            self._inbox.append((request_id, item))

    def add_prefilled(self, request_id: str, token_ids: Seq[int], num_prompt_tokens: int, params: SamplingParams,
                      write_kv: Callable, cloud_budget: int | None = None, ignore_eos: bool = False,
                      guide: Guide | None = None) -> None:
        """P/D decode: admit a request whose tokens `token_ids` (prompt, then the answer so far:
        at least the first token) have their K/V computed elsewhere for all but the last token.
        At admission it takes the cached prefix blocks it can share, allocates fresh blocks for the
        rest, and `write_kv(runner, slots, start)` scatters the K/V of positions [start, n - 1) into
        them (on the engine thread); it then decodes in the batch like any running sequence. It
        waits (FIFO, ahead of nothing else) while the cache or the sequence cap is full."""
        if len(token_ids) <= num_prompt_tokens:
            raise ValueError("a prefilled request carries its first answer token")
        self.check_fits(num_prompt_tokens, params.max_new_tokens)
        max_tokens = params.max_new_tokens if cloud_budget is None else max(0, min(params.max_new_tokens, cloud_budget))
        seq = Sequence(request_id, list(token_ids), params, max_tokens, num_prompt_tokens=num_prompt_tokens,
                       ignore_eos=ignore_eos, guide=guide if guide is not None else new_guide(params, lambda: self.tokenizer, self.cfg.vocab_size))
        self._enqueue(request_id, _Import(seq, len(token_ids) - 1, write_kv))

    def release(self, request_id: str) -> None:
        """Free the KV blocks of a sequence finished with `hold_kv` (at the next step; no-op if unknown)."""
        with self._lock:
            self._inbox.append((request_id, _RELEASE))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the start of the next step. No-op if unknown."""
        with self._lock:
            self._inbox.append((request_id, None))

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        """Extend/shrink a live request's cloud budget (applied at the next step), capped at the
        request's max_new_tokens (which admission checked against `max_model_len`), so a budget
        can never grow a request past what fits the KV cache."""
        with self._lock:
            self._inbox.append((request_id, int(cloud_budget)))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or bool(self._imports) or self.scheduler.has_unfinished()

    def request_stats(self, request_id: str) -> RequestStats | None:
        """Counters of a live or finished request (finished ones kept for the last 10000)."""
        seq = self.seqs.get(request_id)
        return self._stats_of(seq) if seq is not None else self.stats.get(request_id)

    @staticmethod
    def _stats_of(s: Sequence) -> RequestStats:
        t = s.times
        return RequestStats(s.num_prompt_tokens, s.prefix_hit_tokens, s.num_preemptions, s.num_output_tokens,
                            None if t.first_scheduled is None else t.first_scheduled - t.arrival,
                            None if t.first_token is None else t.first_token - t.arrival, s.finish_reason)

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one step: schedule, run the model, postprocess; return the tokens generated in it
        (at most one per running sequence). Finished, aborted and failed requests have freed their
        KV blocks on return; the failed ones are in `take_failures()`, the step's counters in
        `last_stats`.

        Raises:
            EngineFailed: the engine cannot go on (scheduling or the inbox failed, or the batched
                forward failed `MAX_FORWARD_FAILURES` times in a row).
        """
        t0, self.last_stats = time.perf_counter(), StepStats()
        try:
            self._drain_inbox()
            self._admit_imports()
            plan = self.scheduler.schedule()
            ran = self._run(plan.batch, t0)  # (tokens, logits); None: the forward failed
            done = self.scheduler.postprocess(plan.batch, *ran) if ran else StepResult()
            return self._collect(plan, done)
        except EngineFailed:
            raise
        except Exception as e:
            raise EngineFailed(f"the engine failed outside any request: {type(e).__name__}: {e}") from e

    def _run(self, batch: list[ScheduledSeq], t0: float) -> tuple[list, np.ndarray | None] | None:
        """Run `batch` through the model and sample its sampling rows. Returns (tokens: per
        sampling sequence its token id or the exception its sampling raised, logits float32
        [len(tokens), vocab]), ([], None) for an empty batch, or None when the forward failed (the
        batch's requests then fail). Updates `prefill_tok_s` from a step that prefilled (`t0`:
        its start, perf_counter s).

        Raises:
            EngineFailed: the forward failed `MAX_FORWARD_FAILURES` times in a row.
        """
        if not batch:
            return [], None
        try:
            logits_t = self.runner.run(batch)
            logits = logits_t.cpu().numpy()  # for logprobs
        except Exception as e:  # the step's sequences fail; the engine goes on unless it keeps failing
            self._forward_failures += 1
            if self._forward_failures >= MAX_FORWARD_FAILURES:
                raise EngineFailed(f"{self._forward_failures} batched forwards failed in a row, the last: "
                                   f"{type(e).__name__}: {e}") from e
            for s in batch:
                self._fail(s.seq, e)
            return None
        self._forward_failures = 0
        self._export_kv(batch)
        tokens = self._sample(logits_t, [s.seq for s in batch if s.sample])
        n_pre = sum(s.n for s in batch if s.n > 1 or s.start < s.seq.num_prompt_tokens)
        if n_pre >= 16:  # a step that prefilled: its tokens/s (EWMA) estimates prefill speed
            rate = n_pre / max(time.perf_counter() - t0, 1e-6)
            self.prefill_tok_s = rate if self.prefill_tok_s is None else 0.8 * self.prefill_tok_s + 0.2 * rate
        return tokens, logits

    def _export_kv(self, batch: list[ScheduledSeq]) -> None:
        """The KV hand-off of the sequences that sample their token 0 in this step: their prompt
        K/V is complete in the cache now, before postprocess may free their blocks. A failed copy
        fails that request alone."""
        for s in batch:
            seq = s.seq
            if s.sample and seq.kv_export is not None and seq.num_output_tokens == 0:
                try:
                    seq.exported_kv = self.runner.export_kv(seq.block_table, *seq.kv_export)
                except Exception as e:
                    self._fail(seq, e)

    def _sample(self, logits_t, seqs: list[Sequence]) -> list:
        """`sample_batch` of the step; when it raises, each row alone, so that the row (request)
        that raised gets its exception in place of a token and the others their tokens."""
        try:
            return sample_batch(logits_t, seqs, self.eos_id)
        except Exception:
            out: list = []
            for i, s in enumerate(seqs):
                try:
                    out.append(sample_batch(logits_t[i:i + 1], [s], self.eos_id)[0])
                except Exception as e:
                    out.append(e)
            return out

    def _collect(self, plan: StepPlan, done: StepResult) -> list[StepOutput]:
        """The step's end: fail the requests `done.failed` names, retire the finished ones, fill
        `last_stats`, and return a `StepOutput` per sampled token (batch order)."""
        for seq, e in done.failed:
            self._fail(seq, e)
        outputs = []
        for seq, lp in done.sampled:
            kv, seq.exported_kv = seq.exported_kv, None
            outputs.append(StepOutput(seq.request_id, seq.token_ids[-1], seq.num_output_tokens - 1,
                                      seq.finish_reason, lp, kv))
            if seq.finish_reason is not None:
                self._retire(seq)
        st, bm, sch = self.last_stats, self.block_manager, self.scheduler
        st.batch_seqs, st.batch_tokens = len(plan.batch), sum(s.n for s in plan.batch)
        st.prefill_tokens, st.ttft_s, st.tpot_s = done.prefill_tokens, done.ttft_s, done.tpot_s
        st.queue_s, st.preemptions = plan.queue_s, plan.preempted
        st.prefix_query_tokens, st.prefix_hit_tokens = plan.prefix_query_tokens, plan.prefix_hit_tokens
        st.blocks_used, st.blocks_cached = bm.num_used_blocks, bm.num_cached_free_blocks
        st.running, st.waiting = len(sch.running), len(sch.waiting)
        return outputs

    def apply_inbox(self) -> StepStats:
        """Apply what is queued (requests, aborts, releases, budgets) now, outside a step; only
        while no thread runs `step()`. Returns the `StepStats` of it (the requests it ended)."""
        self.last_stats = StepStats()
        self._drain_inbox()
        return self.last_stats

    def _drain_inbox(self) -> None:
        """Apply what the other threads queued: new requests and imports, aborts, releases of held
        blocks, budget changes (a budget below what a request already generated ends it)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for rid, item in inbox:
            if isinstance(item, Sequence):
                self.seqs[rid] = item
                self.scheduler.add(item)
            elif isinstance(item, _Import):
                self.seqs[rid] = item.seq
                self._imports.append(item)
            elif item is None or item is _RELEASE:
                seq = self.seqs.get(rid)
                if seq is not None and item is None:
                    self._finish(seq, "abort")
                held = self.held.pop(rid, None)
                if held is not None:
                    self.block_manager.free_sequence(held)
            else:
                seq = self.seqs.get(rid)
                if seq is not None:
                    seq.max_tokens = max(0, min(seq.params.max_new_tokens, item))
        for seq in list(self.seqs.values()):  # a budget cut below what was already generated
            if seq.num_output_tokens and seq.num_output_tokens >= seq.max_tokens:
                self._finish(seq, "budget")

    def _admit_imports(self) -> None:
        """Admit prefilled sequences (P/D decode) in FIFO order while blocks and slots allow."""
        bm, sch = self.block_manager, self.scheduler
        while self._imports and len(sch.running) < sch.config.max_num_seqs:
            imp = self._imports[0]
            seq = imp.seq
            hit = bm.match_prefix(seq)  # shares cached full prompt blocks (the last token is never matched)
            if not bm.allocate(seq, imp.num_computed - hit):
                bm.free_sequence(seq)
                break
            self._imports.popleft()
            try:
                imp.write(self.runner, self.runner.slots(seq.block_table, hit, imp.num_computed), hit)
            except Exception as e:  # this request's K/V did not import: it fails, its blocks are freed
                self._fail(seq, e)
                continue
            seq.num_computed_tokens = imp.num_computed
            bm.commit(seq, hit)
            seq.prefix_hit_tokens += hit
            seq.status = SequenceStatus.RUNNING
            seq.times.first_scheduled = seq.times.first_token = time.perf_counter()
            sch.running.append(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a live request outside `postprocess` ('abort', 'budget', 'error'): the scheduler
        finishes it (queues, blocks), then the engine retires it."""
        self.scheduler.finish(seq, reason)
        for imp in self._imports:
            if imp.seq is seq:
                self._imports.remove(imp)
                break
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """A finished sequence leaves `seqs` (for `held` when it keeps its blocks); its
        `RequestStats` are kept (the last 10000) and it joins `last_stats.finished`."""
        rid = seq.request_id
        del self.seqs[rid]
        if seq.keeps_blocks:
            self.held[rid] = seq
        self.stats[rid] = self._stats_of(seq)
        if len(self.stats) > 10000:
            self.stats.popitem(last=False)
        self.last_stats.finished.append(Finished(seq.finish_reason, time.perf_counter() - seq.times.arrival,
                                                 seq.num_prompt_tokens, seq.num_output_tokens))

    def _fail(self, seq: Sequence, e: BaseException) -> None:
        """End one request after an exception raised while serving it: finish it ('error', its KV
        blocks freed) and queue a `RequestFailed` for `take_failures()`."""
        if seq.request_id not in self.seqs or self.seqs[seq.request_id] is not seq:
            return  # already finished (failed twice in one step)
        log.error("request %s failed in the engine: %s: %s", seq.request_id, type(e).__name__, e,
                  exc_info=(type(e), e, e.__traceback__))
        try:
            self._finish(seq, "error")
        finally:
            self.seqs.pop(seq.request_id, None)
            self._failures.append((seq.request_id, RequestFailed(seq.request_id, e)))

    def take_failures(self) -> list[tuple[str, RequestFailed]]:
        """The requests that failed in the steps since the last call, as (request_id, error); each
        is finished and its KV blocks are free."""
        out, self._failures = self._failures, []
        return out

    def generate(self, prompts: list[Seq[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline helper: run all `prompts` to completion as one batch; generated ids per prompt.
        Raises the first request's `RequestFailed` (the others are aborted)."""
        ps = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, ps):
            self.add_request(rid, p, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].append(o.token_id)
            failed = self.take_failures()
            if failed:
                for rid in ids:
                    self.abort(rid)
                self.apply_inbox()
                raise failed[0][1]
        return [out[r] for r in ids]


class AsyncLLMEngine:
    """Runs `LLMEngine.step()` on a background thread and delivers tokens to per-request asyncio
    queues. Create it inside the event loop that will consume it (or call `start()` there).

        async for out in engine.generate(request_id, prompt_ids, params):  # StepOutput
            ...

    Leaving the `async for` early (break, task cancelled) aborts the request; `abort(request_id)`
    ends it from elsewhere (the generator then stops without a final reason). A request that fails
    in the engine (`LLMEngine.take_failures`) raises `RequestFailed` from its `async for`; the others
    go on. When the engine itself fails (`EngineFailed`), the thread ends, `error` holds the cause,
    every live request raises RuntimeError('the engine thread failed') and new ones are refused.
    After `shutdown()` every request still streaming or still compiling its grammar raises
    RuntimeError('the engine is shut down') (at once: nothing waits for a step or a compile that
    will not come), nothing more reaches the engine, and new requests are refused the same way.
    """

    _SHUT = object()  # queue marker: the engine was shut down

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.metrics = EngineMetrics(engine)  # fed after each step with its outputs and `last_stats`
        self._queues: dict[str, asyncio.Queue] = {}
        self._compiling: dict[str, dict] = {}  # request id -> the abort / budget that came while its grammar compiled
        self._wake = threading.Event()
        self._stop = False
        # `_stop` turns True under `_lock`, and every add (and every compile's registration) checks
        # it under `_lock`: after `shutdown()` set it, nothing reaches the engine
        self._lock = threading.Lock()
        self._steps = threading.Lock()  # held by whoever runs steps: the engine thread, a warmup
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    # --- EngineClient (cloud.engine.interface) ------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        """The model's context and vocabulary, the paged cache's capacity (tokens) and size (bytes)."""
        e = self.engine
        cap = e.num_blocks * e.block_size
        return EngineLimits(e.context_length, e.cfg.vocab_size, cap, kv_pool_bytes=cap * e.cfg.kv_bytes_per_token)

    @property
    def prefill_tok_s(self) -> float | None:
        return self.engine.prefill_tok_s

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def request_stats(self, request_id: str) -> RequestStats | None:
        return self.engine.request_stats(request_id)

    def health(self) -> str | None:
        """None while the engine thread serves; else why not (it died)."""
        return None if self.error is None else f"engine failed: {type(self.error).__name__}: {self.error}"

    def state(self) -> dict:
        e = self.engine
        return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "kv_blocks_used": e.block_manager.num_used_blocks, "kv_blocks_total": e.num_blocks}

    @staticmethod
    def _shut_error() -> RuntimeError:
        return RuntimeError("the engine is shut down")

    def _check_open(self) -> None:
        """Raise RuntimeError('the engine is shut down') after `shutdown()`."""
        if self._stop:
            raise self._shut_error()

    async def warmup(self) -> None:
        """A short batch on a worker thread before the engine thread starts (the runner allocates on
        its first steps). Raises RuntimeError('the engine is shut down') after `shutdown()`."""
        self._check_open()
        if self._thread is None:
            await asyncio.to_thread(self._warm)

    def _warm(self) -> None:
        if not self._steps.acquire(blocking=False):  # the engine thread started meanwhile: no warmup
            return
        try:  # no engine thread steps meanwhile, and `shutdown` waits for the end
            self._check_open()
            self.engine.generate([list(range(16, 48))], SamplingParams(max_new_tokens=2))
        finally:
            self._steps.release()

    def start(self) -> None:
        """Start the engine thread (no-op if it runs). Raises RuntimeError('the engine is shut
        down') after `shutdown()`: a stopped engine is not started again."""
        self._check_open()
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (after its current step; waits at most `timeout_s` s, then leaves
        the daemon thread behind) and end every request: the ones streaming and the ones whose
        grammar is still compiling raise RuntimeError('the engine is shut down') from their
        iteration at once (queued on their event loop after the tokens already delivered), and
        their KV blocks are freed (the pending aborts are applied too). Later requests are refused
        with the same error. Idempotent; callable from any thread (it blocks: off the event loop
        when the engine thread may be in a long step)."""
        with self._lock:
            self._stop = True
            compiling = list(self._compiling.values())
        self._wake.set()
        for came in compiling:  # their waits end now; `_guide` raises
            self._call_soon(came["loop"], self._set_done, came["wake"])
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.0f s; left behind", timeout_s)
                self._end_streams()
                return
            self._thread = None
        if not self._steps.acquire(timeout=timeout_s):  # a warmup still running
            log.warning("the engine's warmup did not end within %.0f s; its requests are left", timeout_s)
            self._end_streams()
            return
        try:
            if self.error is None:
                eng = self.engine
                self.metrics.observe([], eng.apply_inbox())  # the requests added before the stop join `seqs`
                for rid in list(eng.seqs):
                    eng.abort(rid)
                    eng.release(rid)  # one that holds its blocks (hold_kv) frees them too
                for rid in list(eng.held):
                    eng.release(rid)
                self.metrics.observe([], eng.apply_inbox())
        finally:
            self._steps.release()
        self._end_streams()

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop | None, fn, *args) -> bool:
        """`fn(*args)` on `loop` (from any thread, after the callbacks already queued there); False
        when the loop is closed (then no one awaits anything on it)."""
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed
            return False

    @staticmethod
    def _set_done(fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_result(None)

    def _end_streams(self) -> None:
        """Every request streaming ends with RuntimeError('the engine is shut down')."""
        self._call_soon(self._loop, self._shut_all)

    def _shut_all(self) -> None:
        for q in list(self._queues.values()):
            q.put_nowait(self._SHUT)

    def _run(self) -> None:
        eng = self.engine
        with self._steps:
            while not self._stop:
                if not eng.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    outs = eng.step()
                    failed = eng.take_failures()
                    self.metrics.observe(outs, eng.last_stats)
                except BaseException as e:  # the engine cannot go on: every waiting request gets the failure
                    self.error = e
                    log.critical("the engine thread failed: %s: %s", type(e).__name__, e, exc_info=e)
                    self._call_soon(self._loop, self._fail_all, e)
                    return
                if outs or failed:
                    self._call_soon(self._loop, self._deliver, outs, failed)

    def _deliver(self, outs: list[StepOutput], failed: list = ()) -> None:
        for o in outs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
        for rid, e in failed:  # after its tokens of the same step
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(e)

    def _fail_all(self, e: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(e)

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                    cloud_budget: int | None = None, **kw) -> asyncio.Queue:
        """Queue a request; returns its queue of `StepOutput` (then `None` if aborted). `kw`:
        `LLMEngine.add_request`'s keywords (`hold_kv`, `output_ids`).

        Raises: what `LLMEngine.add_request` raises; RuntimeError when the engine thread failed or
        the engine is shut down."""
        return self._add(request_id, self.engine.add_request, request_id, prompt_ids, params, cloud_budget, **kw)

    def _add(self, request_id: str, add, *args, **kw) -> asyncio.Queue:
        with self._lock:  # no `shutdown` between the check and the add
            self.start()  # raises RuntimeError('the engine is shut down') after `shutdown`
            if self.error is not None:
                e = self.error
                raise RuntimeError(f"the engine thread failed: {type(e).__name__}: {e}") from e
            q: asyncio.Queue = asyncio.Queue()
            add(*args, **kw)
            self._queues[request_id] = q
        self._wake.set()
        return q

    def _to_engine(self, fn, *args) -> None:
        """`fn(*args)` (an abort, release or budget) into the engine's inbox, unless it is shut
        down (`shutdown` ended every request: an entry now would never be applied)."""
        with self._lock:
            if self._stop:
                return
            fn(*args)
        self._wake.set()

    def release(self, request_id: str) -> None:
        """Free a held sequence's KV blocks (P/D prefill, after its export)."""
        self._to_engine(self.engine.release, request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self._compiling:  # not in the engine yet: it will not be added
            self._compiling[request_id]["aborted"] = True
        q = self._queues.pop(request_id, None)
        self._to_engine(self.engine.abort, request_id)
        if q is not None:
            q.put_nowait(None)

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        if request_id in self._compiling:  # applied when it is added
            self._compiling[request_id]["budget"] = cloud_budget
        self._to_engine(self.engine.set_budget, request_id, cloud_budget)

    exports_kv = True  # `generate(..., kv_from=k)`: the KV hand-off from the batch (`cloud.engine.interface`)

    async def generate(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                       cloud_budget: int | None = None, **kw) -> AsyncIterator[StepOutput]:
        """The request's `StepOutput`s (see the class docstring); `kw`: `LLMEngine.add_request`'s
        keywords. With `kv_from` a `KVParts` (float16 KV of prompt positions [kv_from, n - 1),
        copied out of the paged cache in the step of token 0) follows token 0, as on the
        per-request engine; the request stays in the batch.

        Raises: what `add_request` raises (ValueError, PromptTooLongError, GrammarError);
        `RequestFailed` when this request failed in the engine; RuntimeError when the engine thread
        failed or the engine is shut down (also while the grammar compiles)."""
        ready = await self._prepare(request_id, params, cloud_budget)
        if ready is None:  # aborted while its grammar compiled
            return
        guide, cloud_budget = ready
        if guide is not None:
            kw["guide"] = guide
        q = self.add_request(request_id, prompt_ids, params, cloud_budget, **kw)  # raises before the try:
        gen = self._stream(request_id, q)                                       # a rejected id owns nothing
        try:
            async for o in gen:
                if o.kv is not None:
                    yield o._replace(kv=None)
                    yield KVParts(request_id, o.kv, kw["kv_from"])
                    continue
                yield o
        finally:  # an early exit aborts the request now (closing gen), not when it is collected
            await gen.aclose()

    async def generate_prefilled(self, request_id: str, token_ids: Seq[int], num_prompt_tokens: int,
                                 params: SamplingParams, write_kv, cloud_budget: int | None = None
                                 ) -> AsyncIterator[StepOutput]:
        """P/D decode: `LLMEngine.add_prefilled`, then the request's tokens after the ones it came with.
        Raises as `generate`."""
        ready = await self._prepare(request_id, params, cloud_budget)
        if ready is None:  # aborted while its grammar compiled
            return
        guide, cloud_budget = ready
        q = self._add(request_id, self.engine.add_prefilled, request_id, token_ids, num_prompt_tokens, params,
                      write_kv, cloud_budget, guide=guide)
        gen = self._stream(request_id, q)
        try:
            async for o in gen:
                yield o
        finally:
            await gen.aclose()

    async def _prepare(self, request_id: str, params: SamplingParams, cloud_budget: int | None
                       ) -> tuple[Guide | None, int | None] | None:
        """What a request needs before it is added: (its grammar `Guide`, compiled off the event
        loop so the other requests keep streaming, None without a grammar; its cloud budget, the
        last `set_budget` of the meantime if any), or None when `abort` came while it compiled.

        Raises: as `_guide`."""
        if params.grammar is None:
            return None, cloud_budget
        guide, cloud_budget = await self._guide(request_id, params, cloud_budget)
        return None if guide is None else (guide, cloud_budget)

    async def _guide(self, request_id: str, params: SamplingParams, cloud_budget: int | None
                     ) -> tuple[Guide | None, int | None]:
        """(the request's grammar `Guide`, compiled on a worker thread, or None when `abort` came
        meanwhile; the cloud budget, the last `set_budget` of the meantime if any). The wait ends
        at `shutdown()` (the compile's result is then dropped).

        Raises:
            ValueError: the id is running or compiling already. GrammarError: see `new_guide`.
            RuntimeError: the engine is shut down (before or while it compiles).
        """
        if request_id in self._queues or request_id in self._compiling:
            raise ValueError(f"request {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        came = {"budget": cloud_budget, "loop": loop, "wake": loop.create_future()}
        with self._lock:  # registered before `shutdown` looks, or refused after it
            self._check_open()
            self._compiling[request_id] = came
        compile_ = asyncio.ensure_future(
            new_guide_async(params, lambda: self.engine.tokenizer, self.engine.cfg.vocab_size))
        try:
            await asyncio.wait((compile_, came["wake"]), return_when=asyncio.FIRST_COMPLETED)
            self._check_open()  # shut down meanwhile: the compile's result is not used
            guide = compile_.result()  # raises GrammarError
        finally:
            with self._lock:
                del self._compiling[request_id]
            if not compile_.done():  # shut down or cancelled: nobody waits for this compile
                compile_.cancel()
            compile_.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error is not left unseen
        return (None if came.get("aborted") else guide), came["budget"]

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while True:
                o = await q.get()
                if o is None:
                    finished = True
                    return
                if o is self._SHUT:  # `shutdown` ended it (and freed its blocks)
                    finished = True
                    raise self._shut_error()
                if isinstance(o, RequestFailed):  # this request alone failed; the engine freed it
                    finished = True
                    raise o
                if isinstance(o, BaseException):
                    finished = True
                    raise RuntimeError(f"the engine thread failed: {type(o).__name__}: {o}") from o
                yield o
                if o.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._to_engine(self.engine.abort, request_id)
