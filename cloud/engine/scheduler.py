"""Continuous batching with chunked prefill, admission by free KV memory, and preemption by
recompute.

Every `schedule()` call builds one step: running sequences first (a decoding sequence needs one
token, a sequence still in prefill gets the next chunk), then waiting ones are admitted in FIFO
order while the per-step token budget, the sequence cap and the free KV blocks allow. Prefill
chunks share the step with decodes (Sarathi-Serve: Agrawal et al., "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024), so a long prompt never stalls the
decode of the others for more than a bounded number of tokens. When a running sequence cannot
get a block, the most recently admitted running sequence is preempted: its blocks are freed and
it goes back to the front of the queue to be recomputed later (vLLM's RECOMPUTE preemption; its
prompt + generated tokens are prefilled again, partly from the prefix cache).

After the model ran the step, `postprocess` does each sequence's bookkeeping (nano-vllm's
`Scheduler.postprocess`): commit the computed tokens and their full blocks to the prefix cache,
append the sampled token, decide the end with `protocol.model.decoding.finish_reason`, and finish the
sequence (out of the queues, its blocks freed). A sequence whose bookkeeping raises is reported,
not finished, so the engine can fail that request alone.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from relayinfer.protocol.model.decoding import finish_reason, token_logprobs

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

Logprobs = tuple[float, list[tuple[int, float]]]  # decoding.token_logprobs: (token's, [(id, logprob)] top)


@dataclass
class SchedulerConfig:
    """max_num_batched_tokens: token budget of one step (prefill chunks + decodes);
    max_num_seqs: running sequences at most."""

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64


@dataclass
class ScheduledSeq:
    """`seq` computes tokens [start, start + n); `sample` when that reaches the sequence's end."""

    seq: Sequence
    start: int
    n: int

    @property
    def sample(self) -> bool:
        return self.start + self.n == len(self.seq.token_ids)


class StepPlan(NamedTuple):
    """One step as `Scheduler.schedule` built it.

    Attributes:
        batch: what the model computes: running sequences first, then the ones admitted now.
        preempted: sequences preempted in this step (they went back to the queue).
        queue_s: arrival -> first scheduling (s) of the sequences scheduled for the first time.
        prefix_query_tokens: tokens of the sequences admitted in this step (looked up in the
            prefix cache); prefix_hit_tokens: those of them found there.
    """

    batch: list[ScheduledSeq]
    preempted: int = 0
    queue_s: tuple[float, ...] = ()
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass
class StepResult:
    """What `Scheduler.postprocess` did to one step's batch.

    Attributes:
        sampled: (sequence, logprobs or None) of each sequence that appended a token, batch order.
            A sequence whose answer that token ends is finished: `finish_reason` set, out of the
            queues, its blocks freed unless `keeps_blocks`.
        failed: (sequence, exception) of each sequence whose sampling, bookkeeping or finish check
            raised; it is left in the queues for the engine to fail.
        prefill_tokens: prompt tokens computed in the step.
        ttft_s: arrival -> first token (s) of the sequences that got their first token.
        tpot_s: time since the previous token (s) of the other sampled sequences.
    """

    sampled: list[tuple[Sequence, Logprobs | None]] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    prefill_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


class Scheduler:
    """The queues of one engine over its `BlockManager`: `waiting` (FIFO; preempted sequences go
    back to its front) and `running` (admission order). `eos_id` is the model's EOS token id, the
    end of an answer unless the sequence ignores EOS. Not thread-safe: the engine thread alone
    calls it."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_id: int = -1):
        self.config, self.bm, self.eos_id = config, block_manager, eos_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` with `reason` ('eos', 'stop', 'length', 'budget', 'abort', 'error'): take it
        out of the queues and free its blocks, unless it `keeps_blocks` (P/D prefill: they stay
        allocated until `BlockManager.free_sequence`)."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.keeps_blocks:
            self.bm.free_sequence(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for `n` more tokens of the running `seq`, preempting running sequences from the
        newest end until it fits; False if `seq` itself was preempted."""
        while not self.bm.allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def schedule(self) -> StepPlan:
        """Build one step: running sequences oldest first (preempting from the newest end when
        blocks run out), then waiting ones in FIFO order while the token budget, the sequence cap
        and the free blocks allow (none after a preemption in this step: memory is short)."""
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted_before = self.num_preemptions
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                break  # out of tokens, or preempted by an older sequence: so is every one after it
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n):
                break
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        preempted = self.num_preemptions - preempted_before
        if preempted:
            return StepPlan(batch, preempted)
        return self._admit(budget, batch)

    def _admit(self, budget: int, batch: list[ScheduledSeq]) -> StepPlan:
        """Move waiting sequences to running (FIFO) while `budget` tokens, the sequence cap and the
        free blocks allow; their first chunks join `batch`. Returns the step's plan."""
        queue_s: list[float] = []
        queries = hits = 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free_sequence(seq)  # undo the prefix match; retry next step
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.prefix_hit_tokens += hit
            queries, hits = queries + len(seq.token_ids), hits + hit
            t = seq.times
            if t.first_scheduled is None:
                t.first_scheduled = time.perf_counter()
                queue_s.append(t.first_scheduled - t.arrival)
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return StepPlan(batch, 0, tuple(queue_s), queries, hits)

    def postprocess(self, batch: list[ScheduledSeq], tokens: list, logits: np.ndarray | None) -> StepResult:
        """Each scheduled sequence after the model ran `batch`: commit its computed tokens; when it
        sampled, append its token, decide the end (`decoding.finish_reason`) and finish it then.

        Args:
            batch: the step's `StepPlan.batch`, computed by the model.
            tokens: one entry per sampling sequence (`ScheduledSeq.sample`), batch order: the token
                id (int) it sampled, or the exception its sampling raised.
            logits: float32 [len(tokens), vocab], rows as `tokens` (read for `params.logprobs`);
                None when nothing sampled.

        Returns a `StepResult`; an exception raised for one sequence goes to its `failed` entry.
        """
        res = StepResult()
        now = time.perf_counter()
        row = 0
        for s in batch:
            tok, lrow = (tokens[row], logits[row]) if s.sample else (None, None)
            row += s.sample
            try:
                self._advance(s, tok, lrow, now, res)
            except Exception as e:  # this request's own sampling, bookkeeping or stop check
                res.failed.append((s.seq, e))
        return res

    def _advance(self, s: ScheduledSeq, tok, logits_row, now: float, res: StepResult) -> None:
        """`postprocess` of one sequence; raises what its sampling (`tok`) or its checks raised."""
        seq = s.seq
        old = seq.num_computed_tokens
        seq.num_computed_tokens += s.n
        self.bm.commit(seq, old)
        res.prefill_tokens += max(0, min(s.start + s.n, seq.num_prompt_tokens) - s.start)
        if not s.sample:
            return
        if isinstance(tok, BaseException):
            raise tok
        lp = None if seq.params.logprobs is None else token_logprobs(logits_row, tok, seq.params.logprobs)
        seq.token_ids.append(tok)
        t = seq.times
        if t.first_token is None:
            t.first_token = now
            res.ttft_s.append(now - t.arrival)
        elif t.last_token is not None:
            res.tpot_s.append(now - t.last_token)
        t.last_token = now
        reason = finish_reason(tok, seq.num_output_tokens, seq.params, -1 if seq.ignore_eos else self.eos_id,
                               seq.max_tokens if seq.max_tokens < seq.params.max_new_tokens else None, seq.guide)
        if reason:
            self.finish(seq, reason)
        res.sampled.append((seq, lp))
