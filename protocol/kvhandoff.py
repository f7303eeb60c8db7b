"""KV reuse between turns and the cloud -> device KV hand-off: the pieces both sides share.

* `common_prefix`: how many leading tokens of a cached sequence a new prompt shares (multi-turn
  reuse checks the cached ids are a prefix of the new prompt; else it keeps the common part).
* `kv_bytes_per_token` / `kv_handoff_ms` / `kv_handoff_pays`: the per-request choice between the
  device prefilling the prompt itself and importing the prompt's KV from the cloud.
* `kv_part_messages` / `kv_parts`: the one `KVTransfer` codec: KV [layers, 2, kv_heads, tokens,
  head_dim] cut by tokens into consecutive parts, one message each, and back (checked complete and
  contiguous). The P/D hand-off (`cloud.pd.kv`) sends its payload with it, one part per block.
* `KVPacer` / `paced_piece_bytes`: a hand-off sent at the rate the device asked for
  (`Generate.kv_rate`, a share `KV_RATE_SHARE` of its measured link), in pieces of about
  `PACED_PIECE_MS` of that rate, so the link's queue stays short and the request's tokens pass
  between two pieces instead of waiting behind the whole transfer (a shaped link is a FIFO queue:
  without pacing a 15 MB hand-off at 3.6 MB/s holds every token behind it for 4 s).
* `kv_messages` / `kv_pieces` / `kv_layers`: the prompt's KV as `KVTransfer` messages (float16,
  or int8 with per-token scales, `KV_WIRES` / `quantize_int8`; split by tokens into frames of at most `max_bytes`; `kv_pieces` builds them one at a time, as a
  sender interleaving them with other frames wants them) and back into per-layer (key, value) arrays [1, kv_heads,
  tokens, head_dim], the device engine's past-KV layout.

The hand-off follows the prefill -> decode KV transfer of disaggregated serving (DistServe,
Zhong et al. 2024, sec. 4; P/D-Serve, arXiv 2408.08147), with the device as the decode instance.
No numpy-free path is needed: the device side already runs on numpy.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .messages import MAX_FRAME_BYTES, KVTransfer, Tensor

WIRE_DTYPE = np.float16
FRAME_MARGIN = 4096  # bytes left in a frame for the message's other fields

KV_WIRES = ("float16", "int8")
"""The cloud -> device hand-off's wire formats (`Generate.kv_wire`): float16, or int8 with one
float16 scale per (layer, K/V, head, token) over head_dim (`quantize_int8`: symmetric absmax / 127,
the per-token granularity of 8-bit KV caches, e.g. vLLM's int8 / fp8 KV cache; KIVI, Liu et al.
2024, quantizes values per token too). For SmolLM2-135M a token is 23,040 bytes in float16 and
11,880 in int8 (`wire_bytes_per_token`)."""


KV_RATE_SHARE = 0.75
"""Share of its measured link bandwidth a device asks a KV hand-off to use (`Generate.kv_rate`);
the rest is headroom for the request's tokens and control frames and for the estimate's error."""
PACED_PIECE_MS = 20.0
"""A paced hand-off's piece holds about this many ms of its rate (a token waits at most that long)."""


def paced_piece_bytes(rate_bytes_s: float, max_bytes: int, min_bytes: int) -> int:
    """Largest frame (bytes) of a hand-off paced at `rate_bytes_s`: `PACED_PIECE_MS` of the rate,
    at least `min_bytes` (one token and the frame margin) and at most `max_bytes`."""
    return int(min(max_bytes, max(min_bytes, rate_bytes_s * PACED_PIECE_MS / 1e3)))


class KVPacer:
    """Sends at most `rate_bytes_s` on average: `delay_s(now_s, nbytes)` is how long to wait before
    writing the next `nbytes` (seconds; 0 when it may go now), a token bucket of depth one piece.

    Raises:
        ValueError: a rate <= 0.
    """

    def __init__(self, rate_bytes_s: float):
        if not rate_bytes_s > 0:
            raise ValueError(f"kv_rate must be > 0 bytes/s, got {rate_bytes_s}")
        self.rate, self.next_s = float(rate_bytes_s), None

    def delay_s(self, now_s: float, nbytes: int) -> float:
        start = now_s if self.next_s is None else max(now_s, self.next_s)
        self.next_s = start + nbytes / self.rate
        return start - now_s


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, bytes_per_value: int = 2) -> int:
    """Bytes of K and V of one token over all layers: n_layers x 2 (K, V) x n_kv_heads x head_dim x
    `bytes_per_value` (default 2: fp16 on the wire; 4 for an fp32 cache). SmolLM2-135M: 30 x 2 x
    3 x 64 x 2 = 23,040 bytes (22.5 KiB) in fp16. `ModelConfig.kv_bytes_per_token` and the
    engine's cache sizing call this."""
    return n_layers * 2 * n_kv_heads * head_dim * bytes_per_value


def wire_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, wire: str = "float16") -> int:
    """Bytes of one token's K and V on the wire in format `wire` (`KV_WIRES`): float16
    `kv_bytes_per_token`; int8 n_layers x 2 x n_kv_heads x (head_dim + 2), the values and one
    float16 scale per head.

    Raises:
        ValueError: `wire` is not one of `KV_WIRES`.
    """
    if wire == "float16":
        return kv_bytes_per_token(n_layers, n_kv_heads, head_dim)
    if wire == "int8":
        return n_layers * 2 * n_kv_heads * (head_dim + 2)
    raise ValueError(f"kv_wire must be one of {', '.join(KV_WIRES)}, got {wire!r}")


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`x` (float, [..., head_dim]) -> (int8 [..., head_dim], float16 scale [..., 1]) with x ~=
    q * scale: per row scale = absmax / 127 (rounded to float16; 1 for an all-zero row), q =
    round(x / scale) clipped to [-127, 127], so each value is off by at most about scale / 2."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / 127.0).astype(np.float16)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(x / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`quantize_int8`'s inverse: float32 q * scale, shape of `q`."""
    return q.astype(np.float32) * scale.astype(np.float32)


def kv_handoff_ms(tokens: int, bytes_per_token: int, bandwidth_bytes_s: float, cloud_ttft_ms: float,
                  prefill_ms_base: float, prefill_ms_per_token: float, overhead_ms: float = 0.0) -> float:
    """When the device holds the prompt's logits with the KV hand-off (ms from the Generate): the
    cloud's first token (its TTFT, round trip included), then `tokens` x `bytes_per_token` at
    `bandwidth_bytes_s`, `overhead_ms` (encode, decode, import), and a prefill of the last prompt
    token on the device."""
    return (cloud_ttft_ms + tokens * bytes_per_token / bandwidth_bytes_s * 1e3 + overhead_ms
            + prefill_ms_base + prefill_ms_per_token)


def kv_handoff_pays(tokens: int, bytes_per_token: int, bandwidth_bytes_s: float | None, cloud_ttft_ms: float,
                    prefill_ms_base: float, prefill_ms_per_token: float, overhead_ms: float = 0.0) -> bool:
    """Send the KV iff the hand-off (`kv_handoff_ms`) ends before the device's own prefill of the
    `tokens` + 1 uncached prompt tokens (prefill_ms_base + prefill_ms_per_token x (tokens + 1)).
    False without a measured bandwidth (None or <= 0) or with nothing to send."""
    if not bandwidth_bytes_s or bandwidth_bytes_s <= 0 or tokens <= 0:
        return False
    own = prefill_ms_base + prefill_ms_per_token * (tokens + 1)
    return kv_handoff_ms(tokens, bytes_per_token, bandwidth_bytes_s, cloud_ttft_ms, prefill_ms_base,
                         prefill_ms_per_token, overhead_ms) < own


def crossover_bandwidth(tokens: int, bytes_per_token: int, cloud_ttft_ms: float, prefill_ms_per_token: float,
                        overhead_ms: float = 0.0) -> float:
    """The bandwidth (bytes/s) above which `kv_handoff_pays` says yes for `tokens` tokens:
    tokens x bytes_per_token / (prefill_ms_per_token x tokens - cloud_ttft_ms - overhead_ms);
    inf where no bandwidth is enough (the device prefills them before the cloud's first token).
    As tokens grows it tends to bytes_per_token / prefill_ms_per_token (x 1e3)."""
    slack_ms = prefill_ms_per_token * tokens - cloud_ttft_ms - overhead_ms
    return math.inf if slack_ms <= 0 else tokens * bytes_per_token / slack_ms * 1e3


def kv_part_messages(request_id: str, parts: Sequence[np.ndarray], token_start: int = 0,
                     whole: bool | None = None) -> list[KVTransfer]:
    """`parts` (arrays [layers, 2, kv_heads, n_i, head_dim], consecutive token ranges from
    `token_start`, sent in their own dtype) as `KVTransfer` messages: message i holds part i's
    `num_tokens` n_i tokens from its absolute `token_start`, `block_index` i of `num_blocks`
    len(parts). `whole` (default: one part) sends the single part as one message with
    `block_index` -1.

    Raises:
        ValueError: no parts, `whole` with several parts, or a part that is not [layers, 2, ...].
    """
    if not parts:
        raise ValueError("no KV parts to send")
    whole = len(parts) == 1 if whole is None else whole
    if whole and len(parts) != 1:
        raise ValueError(f"whole: one part expected, got {len(parts)}")
    for p in parts:
        if p.ndim != 5 or p.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got shape {p.shape}")
    if whole:
        return [_kv_message(request_id, parts[0], -1, 1, token_start)]
    out, at = [], token_start
    for i, p in enumerate(parts):
        out.append(_kv_message(request_id, p, i, len(parts), at))
        at += p.shape[3]
    return out


def _kv_message(request_id: str, part: np.ndarray, block_index: int, num_blocks: int, token_start: int,
                scale: np.ndarray | None = None) -> KVTransfer:
    """One `KVTransfer` of `part` [layers, 2, kv_heads, n, head_dim] (its own dtype; `scale` its
    int8 scales [layers, 2, kv_heads, n, 1]): the one place both senders (`kv_part_messages`,
    `kv_pieces`) build the message that `kv_parts` reads."""
    return KVTransfer(request_id, 0, Tensor.from_numpy(part), part.shape[3], block_index, num_blocks,
                      token_start=token_start, scale=None if scale is None else Tensor.from_numpy(scale))


def kv_parts(msgs: Sequence[KVTransfer]) -> tuple[int, list[np.ndarray]]:
    """The `KVTransfer` messages of one hand-off (any order) -> (token_start, the parts' arrays
    [layers, 2, kv_heads, n_i, head_dim] in token order; an int8 part with its `scale`
    dequantized to float32). Inverse of `kv_part_messages` and `kv_pieces`.

    Raises:
        ValueError: no message, parts missing or repeated, tokens not contiguous, a tensor of
            the wrong shape, or an int8 part without its scale (or a scale of the wrong shape).
    """
    if not msgs:
        raise ValueError("no KVTransfer messages")
    parts = sorted(msgs, key=lambda m: m.token_start)
    total = parts[0].num_blocks if parts[0].block_index >= 0 else 1
    if len(parts) != total or len({m.block_index for m in parts}) != total:
        raise ValueError(f"{len(parts)} KV parts of {total}")
    arrays, at = [], parts[0].token_start
    for m in parts:
        a = m.kv.to_numpy()
        if a.ndim != 5 or a.shape[1] != 2 or a.shape[3] != m.num_tokens or m.token_start != at:
            raise ValueError(f"KV part {m.block_index}: shape {a.shape}, tokens {m.num_tokens} from {m.token_start}")
        if m.scale is not None or a.dtype == np.int8:
            s = None if m.scale is None else m.scale.to_numpy()
            if a.dtype != np.int8 or s is None or s.shape != a.shape[:4] + (1,):
                raise ValueError(f"KV part {m.block_index}: an int8 kv needs a scale of shape {a.shape[:4] + (1,)}, "
                                 f"got kv {a.dtype} with scale {None if s is None else s.shape}")
            a = dequantize_int8(a, s)
        arrays.append(a)
        at += m.num_tokens
    return parts[0].token_start, arrays


def kv_piece_tokens(kv: np.ndarray, max_bytes: int, wire: str = "float16") -> int:
    """Tokens of `kv` ([layers, 2, kv_heads, tokens, head_dim], counted in wire format `wire`,
    `wire_bytes_per_token`) one `KVTransfer` of at most `max_bytes` holds: (max_bytes -
    FRAME_MARGIN) // bytes per token.

    Raises:
        ValueError: `kv` is not 5-d, one token does not fit in `max_bytes`, or an unknown `wire`.
    """
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got shape {kv.shape}")
    per_token = wire_bytes_per_token(kv.shape[0], kv.shape[2], kv.shape[4], wire)
    step = (max_bytes - FRAME_MARGIN) // per_token if per_token else max(kv.shape[3], 1)
    if step < 1:
        raise ValueError(f"one token of KV is {per_token} bytes, more than the frame limit of {max_bytes}")
    return step


def kv_pieces(request_id: str, kv: np.ndarray, token_start: int, max_bytes: int = MAX_FRAME_BYTES,
              wire: str = "float16"):
    """`kv_messages`, one message at a time: a generator that builds piece i (its float16 copy,
    or with `wire` "int8" its `quantize_int8` values and scales, and the `Tensor`s) only when asked
    for it, so a sender that stops early (the device's Stop or Cancel) never builds the rest, and
    at most one piece is encoded at a time. Token order, `block_index` 0, 1, ...; one message with
    block_index -1 when it fits.

    Raises (on creation):
        ValueError: `kv` is not 5-d, one token does not fit in `max_bytes`, or an unknown `wire`.
    """
    step = kv_piece_tokens(kv, max_bytes, wire)
    n = kv.shape[3]
    total = max(-(-n // step), 1)

    def piece(i: int, lo: int, hi: int) -> KVTransfer:
        part, scale = kv[:, :, :, lo:hi], None
        if wire == "int8":
            part, scale = quantize_int8(part)
        else:
            part = part.astype(WIRE_DTYPE, copy=False)
        return _kv_message(request_id, part, i if total > 1 else -1, total, token_start + lo, scale)

    def gen():
        for i in range(total):
            yield piece(i, i * step, min((i + 1) * step, n))
    return gen()


def kv_messages(request_id: str, kv: np.ndarray, token_start: int,
                max_bytes: int = MAX_FRAME_BYTES, wire: str = "float16") -> list[KVTransfer]:
    """`kv` [layers, 2, kv_heads, tokens, head_dim] as `KVTransfer` messages in wire format `wire`
    (`KV_WIRES`) of at most `max_bytes` each (split by tokens: message i holds `block_index` i of
    `num_blocks`, its `token_start` absolute). One message, block_index -1, when it fits.
    (`kv_pieces` as a list.)

    Raises:
        ValueError: `kv` is not 5-d, one token does not fit in `max_bytes`, or an unknown `wire`.
    """
    return list(kv_pieces(request_id, kv, token_start, max_bytes, wire))


def kv_layers(msgs: Sequence[KVTransfer]) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
    """The `KVTransfer` messages of one hand-off (any order) -> (token_start, per layer (key,
    value) [1, kv_heads, tokens, head_dim], float16, or float32 from an int8 hand-off).

    Raises:
        ValueError: parts missing or repeated, tokens not contiguous, or a tensor of the wrong shape.
    """
    start, arrays = kv_parts(msgs)
    kv = np.concatenate(arrays, axis=3) if len(arrays) > 1 else arrays[0]
    return start, [(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])]
