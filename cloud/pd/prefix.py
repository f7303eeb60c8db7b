"""Prefix-aware routing: the gateway's table of which instance holds which prompt prefix.

Like Dynamo's KV router, SGLang's cache-aware router and Ray Serve LLM's prefix-aware router, the
gateway keeps its own approximate view of the instances' prefix caches: every full block of a
request's tokens is hashed, chained with the previous block's hash (the engine's own rule,
`cloud.engine.block_manager.block_hash`, with the same block size), and the chain is recorded
under the instance that served it. A new request's chain is matched block by block; the instance
with the longest overlap gets it as long as its load is within `slack` requests of the least loaded
candidate's, else the least loaded one does (`PrefixRouter.order`).

The table is a hint, never a correctness matter: an instance that evicted a block just reuses less
than the table promised. It holds at most `max_blocks` block hashes (LRU: the least recently
matched or recorded go first), each with the few instances that hold it, so its memory is bounded
whatever the traffic.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from relayinfer.cloud.engine.block_manager import block_hash


def block_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids` (block i's hash depends on tokens
    0 .. (i + 1) * block_size - 1), as the engine's prefix cache computes them. Raises ValueError
    for a `block_size` below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out, prev = [], None
    for i in range(len(token_ids) // block_size):
        prev = block_hash(prev, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(prev)
    return out


class PrefixRouter:
    """The routing table and the pick.

    Args:
        block_size: tokens per block (the instances' `InstanceConfig.block_size`).
        max_blocks: most block hashes kept (LRU); each maps to the instances that served it.
        slack: an instance with a longer overlap is preferred only while its in-flight requests
            are at most the least loaded candidate's + `slack`.
        enabled: False turns the table off (`order` keeps the caller's load order; the benchmark's
            baseline).

    Raises:
        ValueError: `block_size` or `max_blocks` below 1, or a negative `slack`.
    """

    def __init__(self, block_size: int = 16, max_blocks: int = 1 << 16, slack: int = 2, enabled: bool = True):
        if block_size < 1 or max_blocks < 1 or slack < 0:
            raise ValueError(f"prefix routing needs block_size >= 1, max_blocks >= 1 and slack >= 0, got "
                             f"{block_size}, {max_blocks}, {slack}")
        self.block_size, self.max_blocks, self.slack, self.enabled = block_size, max_blocks, slack, enabled
        self._table: OrderedDict[int, set[str]] = OrderedDict()
        self.lookups = 0        # requests matched
        self.query_blocks = 0   # full blocks they asked about
        self.hit_blocks = 0     # of those, on the instance picked (as the table saw it)

    def __len__(self) -> int:
        return len(self._table)

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        return block_chain(token_ids, self.block_size)

    def overlap(self, chain: Sequence[int], name: str) -> int:
        """Leading blocks of `chain` that the table says `name` holds."""
        n = 0
        for h in chain:
            holders = self._table.get(h)
            if holders is None or name not in holders:
                break
            n += 1
        return n

    def record(self, chain: Sequence[int], name: str) -> None:
        """`name` now holds every block of `chain` (it prefilled or decoded those tokens)."""
        if not self.enabled:
            return
        for h in chain:
            holders = self._table.get(h)
            if holders is None:
                self._table[h] = {name}
            else:
                holders.add(name)
                self._table.move_to_end(h)
        while len(self._table) > self.max_blocks:
            self._table.popitem(last=False)

    def forget(self, name: str) -> None:
        """`name`'s cache is gone (replaced or restarted): drop it from every block."""
        for h in [h for h, holders in self._table.items() if name in holders]:
            holders = self._table[h]
            holders.discard(name)
            if not holders:
                del self._table[h]

    def order(self, chain: Sequence[int], candidates: Sequence, load: dict[str, float]) -> list:
        """`candidates` (handles with a `.name`, in the caller's fallback order) reordered: first
        the one with the longest overlap among those whose `load` (in-flight requests) is within
        `slack` of the least loaded, ties to the less loaded then the caller's order; the rest after
        it in the caller's order. Without an overlap (or disabled) the caller's order stands."""
        if not candidates:
            return []
        self.lookups += 1
        self.query_blocks += len(chain)
        if not self.enabled or not chain:
            return list(candidates)
        low = min(load.get(h.name, 0) for h in candidates)
        best, best_key = None, None
        for i, h in enumerate(candidates):
            if load.get(h.name, 0) > low + self.slack:
                continue
            n = self.overlap(chain, h.name)
            key = (-n, load.get(h.name, 0), i)
            if n and (best_key is None or key < best_key):
                best, best_key = h, key
        if best is None:
            return list(candidates)
        n = -best_key[0]
        self.hit_blocks += n
        for h in chain[:n]:  # matched: keep them fresh in the LRU
            self._table.move_to_end(h)
        return [best] + [h for h in candidates if h is not best]

    def stats(self) -> dict:
        """Lookups, blocks asked about, blocks matched on the picked instance, table size."""
        return {"enabled": self.enabled, "lookups": self.lookups, "query_blocks": self.query_blocks,
                "hit_blocks": self.hit_blocks, "table_blocks": len(self._table), "max_blocks": self.max_blocks}
