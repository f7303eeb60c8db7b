"""Tiny synthetic GGUF files of each supported architecture (random weights, `gguf`'s writer):
seconds to write and run, so the fast suite covers every architecture and tensor type.

`write_tiny(path, arch, kind)`: `arch` 'llama', 'qwen2' or 'gemma3'; every projection of type
`kind` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K); norms F32; the embedding Q8_0
(tied output head). Shapes are multiples of 256 so the K-quant super-blocks fit. A SentencePiece
vocabulary of the 256 byte tokens, four control tokens and a few hundred merged pieces.
K-quant tensors are random valid blocks (gguf-py has no K-quant quantizer): small fp16 super-block
scales, random 6-bit sub-block scales and minimums and random quants.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

DIM, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
HEAD_DIM = {"llama": 64, "qwen2": 64, "gemma3": 256}  # gemma3: key_length != dim / heads, as in Gemma 3 270M (and = its query_pre_attn_scalar)
LAYERS = {"llama": 2, "qwen2": 2, "gemma3": 6}  # gemma3: 5 sliding-window layers, then a global one
WINDOW = 8  # gemma3's sliding window here (tokens): prompts of tens of tokens cross it
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types): <pad> <eos> <bos> <unk> controls, the 256 byte tokens, then
    pieces of common English letters with U+2581 word starts, scored by length (longer = better)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256  # CONTROL, UNKNOWN, BYTE
    letters = "etaoinshrdlucmfwypvbgk"
    pieces = ["\u2581"] + list(letters) + ["\u2581" + c for c in letters]
    pieces += [a + b for a in "etaoinsh" for b in "etaoinsh"]
    pieces += ["\u2581" + a + b for a in "tahsw" for b in "heoai"] + ["\u2581the", "\u2581and", "ing", "tion"]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)
    scores = [0.0] * 260 + [-100.0 + len(t) for t in tokens[260:]]
    return tokens, scores, types


def _k_blocks(rng, n: int, k: int, kind: str) -> np.ndarray:
    """Random valid K-quant rows uint8 [n, k / 256 * bytes]: fp16 scales of about 1e-3."""
    nb, size = k // 256, _K_BYTES[kind]
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    def f16(off, lo, hi):
        raw[..., off:off + 2] = rng.uniform(lo, hi, size=(n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if kind == "Q6_K":
        raw[..., 192:208] = rng.integers(-40, 40, size=(n, nb, 16)).astype(np.int8).view(np.uint8)
        f16(208, 2e-4, 6e-4)
    else:
        f16(0, 5e-5, 2e-4)
        f16(2, 5e-5, 2e-4)
    return raw.reshape(n, -1)


def _tensor(w, name: str, arr: np.ndarray, kind: str, rng) -> None:
    import gguf

    t = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        w.add_tensor(name, arr.astype(np.float32))
    elif kind == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    elif kind in _K_BYTES:
        w.add_tensor(name, _k_blocks(rng, arr.shape[0], arr.shape[1], kind), raw_dtype=t)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), t), raw_dtype=t)


def write_tiny(path: str | Path, arch: str = "llama", kind: str = "Q8_0", seed: int = 0) -> Path:
    """Write the tiny model (see the module docstring) to `path` and return it."""
    import gguf

    rng = np.random.default_rng(seed)
    path = Path(path)
    hd, layers = HEAD_DIM[arch], LAYERS[arch]
    tokens, scores, types = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{kind}")
    w.add_context_length(512)
    w.add_embedding_length(DIM)
    w.add_block_count(layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    if arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(arch != "gemma3")  # Gemma 3's file says False; a Llama 2 style SentencePiece file True

    def mat(n, k, scale=None):
        return rng.normal(0.0, scale or k ** -0.5, size=(n, k)).astype(np.float32)

    def norm(n):  # gemma: the file stores 1 + w
        return (1.0 + rng.normal(0.0, 0.1, size=n)).astype(np.float32)

    _tensor(w, "token_embd.weight", mat(len(tokens), DIM, 0.5), "Q8_0", rng)
    w.add_tensor("output_norm.weight", norm(DIM))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(DIM))
        w.add_tensor(p + "ffn_norm.weight", norm(DIM))
        for name, (n, k) in {"attn_q": (HEADS * hd, DIM), "attn_k": (KV_HEADS * hd, DIM), "attn_v": (KV_HEADS * hd, DIM),
                             "attn_output": (DIM, HEADS * hd), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM),
                             "ffn_down": (DIM, FFN)}.items():
            _tensor(w, p + name + ".weight", mat(n, k), kind, rng)
        if arch == "qwen2":
            for name, n in {"attn_q": HEADS * hd, "attn_k": KV_HEADS * hd, "attn_v": KV_HEADS * hd}.items():
                w.add_tensor(p + name + ".bias", rng.normal(0.0, 0.1, size=n).astype(np.float32))
        if arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
            w.add_tensor(p + "post_attention_norm.weight", norm(DIM))
            w.add_tensor(p + "post_ffw_norm.weight", norm(DIM))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
