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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config, self.bm = config, block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admitted: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preemptions_before = self.num_preemptions
        self.admitted: list[Sequence] = []  # sequences admitted (prefix-matched) in this step
        # 1. running sequences, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing after it remains
        # 2. admit waiting sequences while tokens, slots and free blocks allow (no admission after
        #    a preemption this step: memory is short)
        preempted_now = self.num_preemptions != preemptions_before
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not preempted_now:
            seq = self.waiting[0]
            self.bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free_sequence(seq)  # undo the prefix match; retry next step
                break
            self.waiting.popleft()
            seq.prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.admitted.append(seq)
            out.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return out
