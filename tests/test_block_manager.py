"""The paged-KV block manager on its own (no model): chain hashes of full blocks, registration in
the prefix cache, and prefix hits, with sequences driven the way the scheduler and engine drive
them (match_prefix, allocate, compute, commit)."""
from __future__ import annotations

from relayinfer.cloud.engine.block_manager import BlockManager, block_hash
from relayinfer.cloud.engine.sequence import Sequence
from relayinfer.protocol.model.decoding import SamplingParams

BS = 4
P = SamplingParams(max_new_tokens=32)


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Allocate and 'compute' the next `n` tokens of `seq`, then commit them (one engine step)."""
    assert bm.allocate(seq, n)
    old = seq.num_computed_tokens
    seq.num_computed_tokens += n
    bm.commit(seq, old)


def decode(bm: BlockManager, seq: Sequence, tokens: list[int]) -> None:
    """Append sampled tokens one step at a time, each computed in the next step."""
    for t in tokens:
        seq.token_ids.append(t)
        compute(bm, seq, 1)


def test_block_returns_the_tokens_of_block_i():
    s = Sequence("s", list(range(10)), P, 4)
    assert s.block(0, BS) == (0, 1, 2, 3) and s.block(2, BS) == (8, 9) and s.block(3, BS) == ()


def test_identical_prompts_prefilled_in_one_step_chain_every_block_and_decode_blocks_hit():
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a, b = Sequence("a", prompt, P, 16), Sequence("b", prompt, P, 16)
    # one scheduler step admits both before either has committed: neither finds a cached block
    assert bm.match_prefix(a) == 0 and bm.match_prefix(b) == 0
    assert bm.allocate(a, 10) and bm.allocate(b, 10)
    for s in (a, b):
        s.num_computed_tokens = 10
        bm.commit(s, 0)
    # the answers diverge: each fills two more blocks by decode (tokens 10..17)
    decode(bm, a, [1, 2, 3, 4, 5, 6, 7, 8])
    decode(bm, b, [9, 8, 7, 6, 5, 4, 3, 2])
    for s in (a, b):
        assert s.num_computed_tokens == 18
        # every full block has its chain hash, chained from position 0
        want, prev = [], None
        for i in range(18 // BS):
            prev = block_hash(prev, s.block(i, BS))
            want.append(prev)
        assert s.block_hashes[:4] == want
        # and every full block is findable in the cache under it (the prompt blocks via a's copy)
        for i, h in enumerate(want):
            bid = bm.cached[h]
            assert bm.blocks[bid].token_ids == s.block(i, BS)
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    # b's own decode blocks are registered (not only a's copy of the shared prompt blocks)
    assert [bm.blocks[i].hash for i in b.block_table[2:4]] == b.block_hashes[2:4]
    # a third request with b's prompt + answer so far hits every full block, decode-filled included
    a_prompt_blocks, b_decode_blocks = a.block_table[:2], b.block_table[2:4]
    for s in (a, b):
        bm.free_sequence(s)
    c = Sequence("c", list(b.token_ids) + [42], P, 4)
    assert bm.match_prefix(c) == 16
    assert c.block_table == a_prompt_blocks + b_decode_blocks
    assert [bm.blocks[i].hash for i in c.block_table] == b.block_hashes[:4]
    assert bm.num_cached_free_blocks == bm.scan_cached_free_blocks()


def test_duplicate_blocks_are_not_registered_and_free_first():
    """The second copy of a prefix computed in the same step stays unregistered (the cache maps
    each hash to one block), so freeing puts it at the front of the free list, before cached ones."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = Sequence("a", list(range(9)), P, 1), Sequence("b", list(range(9)), P, 1)
    for s in (a, b):
        bm.match_prefix(s)
    for s in (a, b):
        compute(bm, s, 9)
    assert all(bm.blocks[i].hash is not None for i in a.block_table[:2])
    assert all(bm.blocks[i].hash is None for i in b.block_table)
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_cached_free_blocks == 2 == bm.scan_cached_free_blocks()
    first = next(iter(bm.free))
    assert bm.blocks[first].hash is None
