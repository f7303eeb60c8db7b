"""One request inside the batching engine: its tokens, its progress and its KV block table.

Plain dataclass in the style of nano-vllm's `engine/sequence.py`. A sequence's `token_ids` hold the
prompt followed by the generated tokens; `num_computed_tokens` of them have their K/V in the paged
cache. The scheduler hands the model runner `token_ids[num_computed_tokens:...]` (a prefill chunk,
or the one token sampled last step when decoding), so prefill, chunked prefill, decode and
recompute after preemption are the same operation: "compute the next n uncomputed tokens".
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from relayinfer.protocol.model.decoding import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued: not admitted yet, or preempted (no KV blocks held)
    RUNNING = "running"    # holds KV blocks; scheduled at every step until finished
    FINISHED = "finished"


@dataclass
class SeqTimes:
    """A sequence's timeline, time.perf_counter() seconds: arrival (queued), first scheduled (its
    prefill starts), first token, last token; None until it happens."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(eq=False)  # identity equality: queues remove by identity, not by comparing tokens
class Sequence:
    """State of one request.

    Attributes:
        request_id: caller's id (unique among live requests).
        token_ids: prompt ids then generated ids (int).
        params: sampling settings; `max_tokens` is min(params.max_new_tokens, cloud_budget), the
            answer tokens generated here at most.
        num_prompt_tokens: length of the prompt part of `token_ids`.
        status: where the scheduler holds it (waiting, running, finished).
        block_table: KV block ids (ints into the cache's first axis), block i holds token positions
            [i * block_size, (i + 1) * block_size) (`block(i, block_size)` are its tokens).
        block_hashes: chain hashes of the leading full blocks of `token_ids`, always chained from
            the previous block's (filled on demand by `BlockManager.chain_hash`; they depend on the
            tokens only, so they outlive preemption).
        num_computed_tokens: leading tokens whose K/V are in the cache.
        prefix_hit_tokens: prompt tokens taken from the prefix cache, summed over admissions
            (recompute after preemption admits it again).
        num_preemptions: times the sequence lost its blocks and went back to the queue.
        finish_reason: None while live; 'eos' / 'stop' / 'length' / 'budget' / 'abort' / 'error'.
        ignore_eos: keep generating past EOS (benchmarks with fixed output lengths, as vLLM's).
        hold_kv: P/D prefill: keep the KV blocks after the answer ends until `LLMEngine.release`.
        kv_export: the KV hand-off: (start, end) prompt positions whose K/V are copied out of the
            cache (float16) in the step that samples token 0; `exported_kv` holds the copy until
            that token's `StepOutput` takes it.
        times: its `SeqTimes`.
        guide: its grammar state (`protocol.model.grammar.Guide`), None without `params.grammar`.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    ignore_eos: bool = False
    hold_kv: bool = False
    kv_export: tuple[int, int] | None = None
    exported_kv: object = None
    times: SeqTimes = field(default_factory=SeqTimes)
    guide: object = None  # the grammar's state (protocol.model.grammar.Guide) when params.grammar is set

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def block(self, i: int, block_size: int) -> tuple[int, ...]:
        """Token ids of block `i` (positions [i * block_size, (i + 1) * block_size)); shorter
        than `block_size` for a block not yet full."""
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def keeps_blocks(self) -> bool:
        """Finished with `hold_kv` at the end of its answer (not aborted, not failed): its KV blocks
        stay allocated for the P/D export until released."""
        return self.hold_kv and self.finish_reason not in (None, "abort", "error")
