"""KV hand-off between a prefill and a decode instance, in the two modes P/D-Serve compares.

* **contiguous** (P/D-Serve, arXiv 2408.08147, sec. 3.4): the request's K/V, spread over its
  paged blocks, is gathered once (one `index_select` per layer and K/V straight into one buffer,
  [layers, 2, kv_heads, tokens, head_dim]) and moved as **one** object; the decode side scatters it
  once (`index_copy_`) into freshly allocated blocks.
* **block-fixed** (the baseline): one object per 16-token block ([layers, 2, kv_heads, <=16,
  head_dim]), each copied out of and into the cache on its own, so a 4k-token request moves 256
  objects and pays the per-transfer overhead 256 times.

Both move the same bytes. Buffers are numpy arrays (Ray's object store maps them zero-copy on one
node). `to_messages` / `from_messages` carry a payload as `protocol.messages.KVTransfer` frames.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from relayinfer.protocol.kvhandoff import kv_part_messages, kv_parts
from relayinfer.protocol.messages import KVTransfer

MODES = ("contiguous", "block-fixed")


@dataclass
class KVPayload:
    """K/V of a request's first `num_tokens` positions.

    parts: contiguous: one array [L, 2, kvh, num_tokens, hd]; block-fixed: one array per block
        [L, 2, kvh, n_i, hd] (n_i = block_size but for the last). While moving through Ray they are
        ObjectRefs (`ray_pool`).
    """

    mode: str
    num_tokens: int
    block_size: int
    parts: list
    nbytes: int
    export_s: float = 0.0
    import_s: float = 0.0
    fetch_s: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def num_objects(self) -> int:
        return len(self.parts)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A torch view of a payload array; an `ml_dtypes.bfloat16` array comes back as torch.bfloat16
    (`from_messages` gives a frame's bfloat16 that dtype; any other array keeps its own)."""
    with warnings.catch_warnings():  # Ray hands read-only zero-copy arrays; we only read them
        warnings.simplefilter("ignore", UserWarning)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy array of `t` (its memory when already on the CPU); bfloat16 as
    `ml_dtypes.bfloat16` (the inverse of `_tensor`)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _buffer(shape: tuple, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
    """A host buffer of the cache's dtype as (numpy array, torch view of the same memory);
    bfloat16, which numpy lacks, is an `ml_dtypes.bfloat16` array (sent as "bfloat16" frames)."""
    if dtype == torch.bfloat16:
        import ml_dtypes

        a = np.empty(shape, dtype=ml_dtypes.bfloat16)
        return a, _tensor(a)
    a = np.empty(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype)
    return a, torch.from_numpy(a)


@torch.inference_mode()
def export_kv(runner, block_table: list[int], num_tokens: int, mode: str = "contiguous") -> KVPayload:
    """Copy the K/V of positions [0, num_tokens) of a sequence with `block_table` out of the cache."""
    if mode not in MODES:
        raise ValueError(f"unknown KV transfer mode {mode!r}; choose from {', '.join(MODES)}")
    t0 = time.perf_counter()
    cfg, bs = runner.cfg, runner.block_size
    L, kvh, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    if mode == "contiguous":
        buf, view = _buffer((L, 2, kvh, num_tokens, hd), runner.dtype)
        runner.gather_kv(runner.slots(block_table, 0, num_tokens), view)
        parts = [buf]
    else:
        parts = []
        for i in range(-(-num_tokens // bs)):
            n, s0 = min(bs, num_tokens - i * bs), block_table[i] * bs
            blk, t = _buffer((L, 2, kvh, n, hd), runner.dtype)
            for li in range(L):
                t[li, 0].copy_(runner.k[li][:, s0:s0 + n])
                t[li, 1].copy_(runner.v[li][:, s0:s0 + n])
            parts.append(blk)
    return KVPayload(mode, num_tokens, bs, parts, sum(p.nbytes for p in parts), export_s=time.perf_counter() - t0)


def writer(payload: KVPayload):
    """The `write_kv(runner, slots, start)` callback of `LLMEngine.add_prefilled` for `payload`
    (its parts already fetched as arrays): scatters positions [start, num_tokens) into `slots`."""

    @torch.inference_mode()
    def write(runner, slots: torch.Tensor, start: int) -> None:
        t0 = time.perf_counter()
        if payload.mode == "contiguous":
            runner.scatter_kv(slots, _tensor(payload.parts[0])[:, :, :, start:])
        else:
            bs, L = payload.block_size, runner.cfg.n_layers
            for i in range(start // bs, len(payload.parts)):  # blocks before start: shared from the prefix cache
                t = _tensor(payload.parts[i])
                n, s0 = t.shape[3], int(slots[i * bs - start])  # a block's slots are consecutive
                for li in range(L):  # copy_ converts device and dtype
                    runner.k[li][:, s0:s0 + n].copy_(t[li, 0])
                    runner.v[li][:, s0:s0 + n].copy_(t[li, 1])
        payload.import_s = time.perf_counter() - t0

    return write


def to_messages(payload: KVPayload, request_id: str) -> list[KVTransfer]:
    """The payload as `KVTransfer` protocol messages (`protocol.kvhandoff.kv_part_messages`):
    contiguous: one message (block_index -1); block-fixed: one per block, each with its own
    tokens (`num_tokens`, `token_start`)."""
    return kv_part_messages(request_id, payload.parts, 0, whole=payload.mode == "contiguous")


def from_messages(msgs: list[KVTransfer], block_size: int = 16) -> KVPayload:
    """Inverse of `to_messages` (block-fixed messages in any order; `protocol.kvhandoff.kv_parts`).

    Raises:
        ValueError: blocks missing, repeated or not contiguous, or not starting at position 0.
    """
    start, parts = kv_parts(msgs)
    if msgs[0].kv.dtype == "bfloat16":  # the frame's raw uint16 patterns, typed again
        import ml_dtypes

        parts = [p.view(ml_dtypes.bfloat16) for p in parts]
    if start != 0:
        raise ValueError(f"a P/D KV payload starts at position 0, these messages at {start}")
    mode = "contiguous" if msgs[0].block_index < 0 else "block-fixed"
    return KVPayload(mode, sum(p.shape[3] for p in parts), block_size, parts, sum(p.nbytes for p in parts))
