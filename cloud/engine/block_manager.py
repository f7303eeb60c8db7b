"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, prefix reuse by hash, ref counts
and LRU eviction of free cached blocks.

PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023) stores each sequence's K/V in fixed-size blocks listed by a block
table, so memory is allocated on demand and no sequence needs a contiguous reservation. Automatic
prefix caching (vLLM; nano-vllm's `block_manager.py`): a *full* block is identified by a hash of all
tokens up to and including it (chained: hash(previous block's hash, this block's tokens)); a new
sequence whose prompt starts with the same tokens shares those blocks (ref count + 1) instead of
recomputing them. A block whose ref count drops to 0 keeps its contents and hash and goes to the
free list in LRU order; it is reused by a later prefix hit or evicted (hash dropped) when the
free list hands it out for new tokens.

Two notions are kept apart: a sequence's *chain hashes* (`Sequence.block_hashes`, one per full
block, a pure function of its tokens, always chained from the previous block's) and a block's
*registration* (`Block.hash`: set only on the block that `cached` maps that hash to). When two
sequences compute the same prefix in the same step, the first one's blocks are registered and
the second one's are not, but the second's chain goes on, so its later blocks (the ones decode
fills) are registered under the right hashes.

This class only does bookkeeping (ints); the tensors live in `model_runner.ModelRunner`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of a full block: depends on every token from position 0 to the block's end."""
    return hash((prev, tokens))


@dataclass
class Block:
    """One KV block's bookkeeping. `hash` is not None only while the block is registered in
    `BlockManager.cached` under it (full, computed, and the first copy of its prefix);
    `token_ids` are then its tokens, checked on a hash hit (collision guard)."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates `num_blocks` blocks of `block_size` token slots.

    Free blocks (ref count 0) sit in `free` (an OrderedDict used as an LRU list: the front is
    evicted first). Blocks that carry a hash are cached: `cached[hash] -> block_id`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.evictions = 0
        self._cached_free = 0  # free blocks that carry a hash; kept up to date by every move

    # --- counts -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (empty or cached-and-evictable)."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a reusable prefix: a counter maintained as blocks enter and
        leave the free list (O(1); `scan_cached_free_blocks` is the O(num_blocks) definition)."""
        return self._cached_free

    def scan_cached_free_blocks(self) -> int:
        """`num_cached_free_blocks` recounted over the free list (tests, debugging)."""
        return sum(1 for b in self.free if self.blocks[b].hash is not None)

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        """Extra blocks `seq` needs to hold `n_new` more computed tokens."""
        need = -(-(seq.num_computed_tokens + n_new) // self.block_size)
        return max(0, need - len(seq.block_table))

    # --- allocation ---------------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None:  # evict the cached prefix held by this block
            self._cached_free -= 1
            if self.cached.get(b.hash) == bid:
                del self.cached[b.hash]
            b.hash, b.token_ids = None, ()
            self.evictions += 1
        b.ref_count = 1
        return bid

    def match_prefix(self, seq: Sequence) -> int:
        """On admission: share the cached full blocks that start `seq`'s tokens. The last token is
        never taken from the cache (its logits are needed to sample), so at most
        (len - 1) // block_size blocks match. Sets `block_table` and `num_computed_tokens`;
        returns the number of tokens reused (a multiple of `block_size`)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits, bs = 0, self.block_size
        if self.enable_prefix_caching:
            for i in range((len(seq.token_ids) - 1) // bs):
                h = self.chain_hash(seq, i)
                bid = self.cached.get(h)
                if bid is None or self.blocks[bid].token_ids != seq.block(i, bs):
                    break
                b = self.blocks[bid]
                if b.ref_count == 0:
                    del self.free[bid]
                    self._cached_free -= 1  # a cache hit is a registered block
                b.ref_count += 1
                seq.block_table.append(bid)
                hits += 1
        seq.num_computed_tokens = hits * bs
        return hits * bs

    def chain_hash(self, seq: Sequence, i: int) -> int:
        """Chain hash of `seq`'s full block `i` (its tokens must be in `seq.token_ids`), computed
        once and kept in `seq.block_hashes` (tokens are only ever appended, so it stays valid)."""
        hs = seq.block_hashes
        while len(hs) <= i:
            hs.append(block_hash(hs[-1] if hs else None, seq.block(len(hs), self.block_size)))
        return hs[i]

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free)

    def allocate(self, seq: Sequence, n_new: int) -> bool:
        """Grow `seq`'s block table to hold `n_new` more tokens; False (nothing changed) if the
        free list is too short."""
        need = self.blocks_needed(seq, n_new)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def commit(self, seq: Sequence, old_computed: int) -> None:
        """After the runner wrote K/V for tokens [old_computed, seq.num_computed_tokens): register
        the blocks that became full under their chain hash so later sequences can share them. A
        block whose hash another block already holds (the same prefix computed twice at once)
        stays unregistered; the chain still goes through it to the blocks after it."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = old_computed // bs, seq.num_computed_tokens // bs  # full blocks: [first, last)
        for i in range(first, last):
            h = self.chain_hash(seq, i)
            b = self.blocks[seq.block_table[i]]
            if b.hash is None and h not in self.cached:
                b.hash, b.token_ids = h, seq.block(i, bs)
                self.cached[h] = b.block_id

    def free_sequence(self, seq: Sequence) -> None:
        """Drop `seq`'s references (last block first, so a prefix's tail is evicted before its
        head); blocks reaching ref count 0 join the free list, uncached ones at the front."""
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0
            if b.ref_count == 0:
                self.free[bid] = None
                if b.hash is None:
                    self.free.move_to_end(bid, last=False)
                else:
                    self._cached_free += 1
        seq.block_table = []
        seq.num_computed_tokens = 0
