"""GGUF block-quantized rows as MatMulNBits blocks: one decomposition for every type the device keeps quantized.

Every supported type is written, per block of `block` consecutive elements along K, as

    w = scale * (q - 2 ** (bits - 1)) + offset        q: unsigned `bits`-bit integers

with `bits` 4 or 8, MatMulNBits' default zero point 2 ** (bits - 1) (8 or 128), and `offset` a
per-block float (None where it is 0). ORT's MatMulNBits runs the `scale * (q - zp)` part on its fast
kernels (a float zero point would be exact too but takes its slow dequantize-per-call path); the
graph adds the offsets through the per-block input sums (`cloud.onnx_graph._Linear`), as llama.cpp
does for Q4_1 / Q4_K. The decomposition is exact in the algebra (the same q, the file's scales
and minimums); in float32 it rounds as the file's own formula may, within one ulp.

| GGUF type | block | bits | q | scale | offset |
|---|---|---|---|---|---|
| Q4_0 | 32 | 4 | the nibble | d | none |
| Q4_1 | 32 | 4 | the nibble | d | m + 8d |
| Q5_0 | 32 | 8 | 5-bit q + 112 | d | none |
| Q8_0 | 32 | 8 | int8 q + 128 | d | none |
| Q4_K | 32 (sub-block) | 4 | the nibble | d * sc_j | 8 d sc_j - dmin m_j |
| Q5_K | 32 (sub-block) | 8 | 5-bit q + 112 | d * sc_j | 16 d sc_j - dmin m_j |
| Q6_K | 16 (sub-block) | 8 | 6-bit q + 96 | d * sc_j | none |

Block layouts: ggml-common.h (`block_q4_0` ... `block_q6_K`); the bit unpacking follows gguf-py's
`gguf.quants` (`Q4_K.get_scale_min`, the `dequantize_blocks` of each type), which the tests use as
the reference. Other types (F16, BF16, Q2_K, Q3_K, IQ*) are not kept as blocks: the graph stores
them dequantized (dense fp32), and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
               "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}
"""Elements and bytes of one GGUF block per type kept as MatMulNBits blocks."""
FOUR_BIT = frozenset({"Q4_0", "Q4_1", "Q4_K"})
"""The types `decompose` returns as 4-bit blocks of 32 (the others of `BLOCK_BYTES` as 8-bit)."""


@dataclass
class Blocks:
    """A matrix [N, K] as MatMulNBits blocks: q uint8 [N, K / block, block] (element order), scale
    float32 [N, K / block], offset float32 [N, K / block] or None; w = scale * (q - 2**(bits-1)) + offset."""

    bits: int
    block: int
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

    def dense(self) -> np.ndarray:
        """float32 [N, K]: the weights the blocks stand for (tests; the graph never builds this)."""
        w = self.scale[..., None] * (self.q.astype(np.float32) - np.float32(2 ** (self.bits - 1)))
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(w.shape[0], -1)

    def packed(self) -> np.ndarray:
        """MatMulNBits' B input uint8 [N, K / block, block * bits / 8]: 8-bit q as is; 4-bit q with
        element 2i in the low nibble of byte i and 2i + 1 in the high one."""
        if self.bits == 8:
            return np.ascontiguousarray(self.q)
        return (self.q[..., 0::2] | (self.q[..., 1::2] << 4)).astype(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., w] -> [..., 2 * w]: the low nibbles (elements 0..w-1), then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed 6-bit scales and minimums [n, 12] -> (sc, m) uint8 [n, 8]
    (ggml `get_scale_min_k4`, as `gguf.quants.Q4_K.get_scale_min`)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decompose(raw: np.ndarray, kind: str, k: int) -> Blocks | None:
    """GGUF rows `raw` (uint8 [N, K / elements-per-block * bytes-per-block]) of type `kind` as
    `Blocks`, or None for a type not in `BLOCK_BYTES`.

    Raises:
        ValueError: K not a multiple of the type's block, or `raw` not of the row size it implies.
    """
    if kind not in BLOCK_BYTES:
        return None
    per, nbytes = BLOCK_BYTES[kind]
    if k % per:
        raise ValueError(f"{kind} rows need K a multiple of {per}, got {k}")
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] != k // per * nbytes:
        raise ValueError(f"{kind} rows of {raw.shape[1:]} bytes do not hold K = {k} ({k // per * nbytes} bytes)")
    blk = np.ascontiguousarray(raw).reshape(n, k // per, nbytes)
    nb = k // per
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(blk[..., 0:2])
        head = 2 if kind == "Q4_0" else 4
        q = _nibbles(blk[..., head:])
        off = None if kind == "Q4_0" else (_f16(blk[..., 2:4]) + 8 * d).astype(np.float32)
        return Blocks(4, 32, q.astype(np.uint8), d, off)
    if kind == "Q8_0":
        return Blocks(8, 32, (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(blk[..., 0:2]), None)
    if kind == "Q5_0":
        d = _f16(blk[..., 0:2])
        qh = np.ascontiguousarray(blk[..., 2:6]).view(np.uint32)[..., 0]
        hi = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q5 = _nibbles(blk[..., 6:]) | (hi << 4)
        return Blocks(8, 32, (q5 + 112).astype(np.uint8), d, None)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None]   # [n, nb, 1]
        sc, mn = _scale_min_k4(blk[..., 4:16].reshape(-1, 12))
        s = (d * sc.reshape(n, nb, 8).astype(np.float32))                        # [n, nb, 8]
        dm = dmin * mn.reshape(n, nb, 8).astype(np.float32)
        qs = blk[..., 16:] if kind == "Q4_K" else blk[..., 48:]
        # 4 chunks of 32 bytes: low nibbles = sub-block 2c, high nibbles = sub-block 2c + 1
        q = np.stack([qs.reshape(n, nb, 4, 32) & 0x0F, qs.reshape(n, nb, 4, 32) >> 4], axis=3).reshape(n, nb, 8, 32)
        if kind == "Q4_K":
            return Blocks(4, 32, q.reshape(n, nb * 8, 32).astype(np.uint8), s.reshape(n, -1),
                          (8 * s - dm).reshape(n, -1).astype(np.float32))
        qh = blk[..., 16:48]                                                        # [n, nb, 32]
        hi = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)    # [n, nb, 8, 32]
        q5 = q | (hi << 4)
        return Blocks(8, 32, (q5 + 112).reshape(n, nb * 8, 32).astype(np.uint8), s.reshape(n, -1),
                      (16 * s - dm).reshape(n, -1).astype(np.float32))
    # Q6_K: ql [128], qh [64], int8 scales [16], fp16 d
    ql, qh = blk[..., 0:128], blk[..., 128:192]
    scales = np.ascontiguousarray(blk[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blk[..., 208:210])[..., None]
    # per 128-element half: elements 0..63 the low nibbles of its 64 ql bytes, 64..127 the high ones;
    # the top 2 bits of element 32 s + j in bits 2 s of its qh byte j
    lo = np.stack([ql.reshape(n, nb, 2, 64) & 0x0F, ql.reshape(n, nb, 2, 64) >> 4], axis=3).reshape(n, nb, 8, 32)
    hi = (qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q6 = lo | (hi.reshape(n, nb, 8, 32) << 4)
    return Blocks(8, 16, (q6 + 96).reshape(n, nb * 16, 16).astype(np.uint8), (d * scales).reshape(n, -1), None)


def split_nibbles(b: Blocks) -> tuple[Blocks, Blocks]:
    """An 8-bit `Blocks` as the sum of two 4-bit ones over its high and low nibbles, exact in the
    algebra: with u = 16 h + l (u the unsigned 8-bit q, h = u >> 4, l = u & 15),
    s (u - 128) + o = 16 s (h - 8) + s (l - 8) + (8 s + o), so (h, scale 16 s, offset 8 s + o) and
    (l, scale s, no offset). In float32 16 s and 8 s are exact (powers of two); 8 s + o rounds once
    where o is not None. Lets an 8-bit matrix (the tied Q8_0 output head) run on MatMulNBits' 4-bit
    kernel with float32 activations, which ORT 1.32 has and its 8-bit one at level 0 has not.

    Raises:
        ValueError: `b` is not 8-bit.
    """
    if b.bits != 8:
        raise ValueError(f"split_nibbles takes 8-bit blocks, got {b.bits}-bit")
    off = 8 * b.scale if b.offset is None else (8 * b.scale + b.offset).astype(np.float32)
    return (Blocks(4, b.block, b.q >> 4, (16 * b.scale).astype(np.float32), off.astype(np.float32)),
            Blocks(4, b.block, b.q & 15, b.scale, None))

