"""The device's ONNX graph of a Llama GGUF, written directly with `onnx.helper` (no torch tracing).

Two weight formats (`WEIGHTS`):

* ``gguf``: every block-quantized GGUF matrix becomes a `com.microsoft.MatMulNBits` initializer that
  holds the file's own blocks and scales (no re-quantization): Q4_1 (w = d*q + m, q in 0..15) as
  bits=4 with the default zero point 8 and scale d, plus a small fp32 MatMul of the per-block input
  sums with the offsets m + 8d (`q4_1_blocks`); Q8_0 (w = d*q, q int8) as bits=8, q + 128 with the
  default zero point 128.
  The tied Q8_0 embedding is read by `GatherBlockQuantized` from the same bytes as the output head.
  Format of the blocks: ggml `block_q4_1` / `block_q8_0` (ggml-common.h).
* ``fp32``: the matrices dequantized with `gguf.quants.dequantize` (the same numbers as the torch
  `Llama` of `cloud/models/llama.py`), as plain MatMul/Gemm.

Graph (batch 1, `S` new tokens, the KV cache a shared buffer of capacity `C`):

    inputs:  input_ids int64 [1, S]; position_ids int64 [1, S] (RoPE positions of the new tokens);
             seqlens_k int32 [1] (cached + new tokens - 1); total_sequence_length int32 scalar
             (cached + new tokens); past_key.i / past_value.i float32 [1, kv_heads, C, head_dim]
    outputs: logits float32 [1, vocab] (last position); present_key.i / present_value.i, the same
             buffers when bound to the same memory (ORT's `past_present_share_buffer`)

Per layer: SimplifiedLayerNormalization (RMSNorm) / SkipSimplifiedLayerNormalization (residual add +
RMSNorm), one fused QKV matmul, `RotaryEmbedding` (rotate_half layout, positions from
`position_ids`, so a token can keep its original position while its cache slot is the next free
one), `GroupQueryAttention` (fused causal GQA writing the new keys/values into the buffer at
seqlens_k + 1 - S), the output projection, a fused gate/up matmul and SwiGLU (Shazeer 2020).
Q/K rows are un-permuted from llama.cpp's interleaved rotary layout (`_unpermute`), so the cache
holds the same post-RoPE keys as the torch model's. Op schemas: onnxruntime `contrib_defs.cc`
(ORT 1.32); the layout follows onnxruntime-genai's model builder for Llama.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from relayinfer.protocol.model.device_model import WEIGHTS  # noqa: F401  (this module's API)
from relayinfer.protocol.model.errors import ModelFileError
from relayinfer.protocol.model.model_file import ModelConfig, open_gguf, read_config, rope_inv_freq

ACCURACY_LEVEL = 0  # MatMulNBits: 0 = activations stay fp32 (4 = int8 activations; see docs/SPLIT.md)
OPSET = 21
MS = "com.microsoft"
_BLOCK = 32  # GGUF block length of Q4_0/Q4_1/Q8_0 (QK4_1 = QK8_0 = 32)


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the graph; the cache names per layer i are
    past_key.i, past_value.i / present_key.i, present_value.i (in that order after the fixed ones)."""
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    present = [f"present_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", "seqlens_k", "total_sequence_length", *past], ["logits", *present]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate_half rotary layout); rows are
    axis 0 (whole quantized rows move together, the blocks run along K inside a row)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 rows -> MatMulNBits (bits 4, default zero point 8) B and scales, plus the block
    offsets that MatMulNBits cannot hold.

    raw: uint8 [N, K/32*20] (per block fp16 d, fp16 m, 16 bytes: element j in the low nibble of
    byte j, element j+16 in the high nibble). A Q4_1 weight is w = d*q + m = d*(q - 8) + (m + 8d):
    MatMulNBits computes the d*(q - 8) part with its fast kernels (a float zero point -m/d would be
    exact too but takes ORT's slow dequantize-per-call path, 20x slower at decode), and the graph
    adds sum over blocks b of (m + 8d)[n, b] * (sum of the inputs in block b), as llama.cpp does.
    Returns B uint8 [N, K/32, 16] (element 2i in the low nibble of byte i, 2i+1 in the high one),
    scales float32 [N, K/32] (d) and offsets float32 [N, K/32] (m + 8d).
    """
    n, nb = raw.shape[0], k // _BLOCK
    blk = np.ascontiguousarray(raw).reshape(n, nb, 20)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blk[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, nb, 32] in element order
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, d, (m + 8 * d).astype(np.float32)


def q8_0_blocks(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 rows -> MatMulNBits (bits 8) B uint8 [N, K/32, 32] (q + 128, the default zero
    point 128) and scales float32 [N, K/32]. raw: uint8 [N, K/32*34] (fp16 d, 32 int8 q)."""
    n, nb = raw.shape[0], k // _BLOCK
    blk = np.ascontiguousarray(raw).reshape(n, nb, 34)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d


class _Builder:
    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

    def init(self, name: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
           outputs: list[str] | None = None, **attrs) -> list[str]:
        from onnx import helper

        self._n += 1
        base = name or f"{op}_{self._n}"
        outs = outputs or [f"{base}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=base, domain=domain, **attrs))
        return outs


class _Weights:
    """The GGUF tensors by name, with the Q/K un-permutation applied to the rows."""

    def __init__(self, reader, cfg: ModelConfig):
        self.cfg, self.t = cfg, {t.name: t for t in reader.tensors}

    def _rows(self, name: str) -> tuple[np.ndarray, object]:
        t = self.t.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file lacks tensor {name}")
        raw = np.asarray(t.data)
        if ".attn_q." in name:
            raw = _unpermute(raw, self.cfg.n_heads)
        elif ".attn_k." in name:
            raw = _unpermute(raw, self.cfg.n_kv_heads)
        return raw, t.tensor_type

    def vector(self, name: str) -> np.ndarray:
        raw, kind = self._rows(name)
        if kind.name != "F32":
            raise ModelFileError(f"tensor {name} is {kind.name}, expected F32")
        return raw.astype(np.float32)

    def dense(self, name: str) -> np.ndarray:
        """float32 [N, K] (rows = outputs), dequantized as the torch loader does."""
        import gguf

        raw, kind = self._rows(name)
        try:
            return gguf.quants.dequantize(raw, kind).astype(np.float32, copy=False)
        except Exception as e:
            raise ModelFileError(f"cannot dequantize tensor {name} ({kind.name}): {e}") from e

    def blocks(self, name: str, k: int):
        """(bits, B, scales, block offsets or None) of a Q4_1 / Q8_0 tensor, else None."""
        raw, kind = self._rows(name)
        if kind.name == "Q4_1":
            return (4, *q4_1_blocks(raw, k))
        if kind.name == "Q8_0":
            return (8, *q8_0_blocks(raw, k), None)
        return None


class _Linear:
    """The projections x [.., K] @ W^T of one graph, W the row-concatenation of GGUF tensors.

    'gguf' weights: one MatMulNBits over the file's own Q4_1 / Q8_0 blocks when every tensor has
    them at the same bit width (else a dense fp32 MatMul), plus for Q4_1 the block-offset term
    (block sums of the input [.., K/32] @ offsets [K/32, N]); the block sums of one input are built
    once and shared by every projection that reads it. 'fp32' weights: a dense fp32 MatMul.
    """

    def __init__(self, b: _Builder, w: _Weights, weights: str, accuracy_level: int):
        self.b, self.w, self.weights, self.accuracy_level = b, w, weights, accuracy_level
        self.block_sums: dict[str, str] = {}  # input name -> name of its per-block sums [.., K/32]

    def __call__(self, x: str, names: list[str], k: int, tag: str) -> str:
        """The output name of x [.., K] @ W^T -> [.., N] (N: the rows of `names` together); nodes and
        initializers are named after `tag`."""
        if self.weights == "gguf":
            parts = [self.w.blocks(n, k) for n in names]
            if all(p is not None for p in parts) and len({p[0] for p in parts}) == 1:
                return self._blocks(x, parts, k, tag)
        wt = np.concatenate([self.w.dense(n) for n in names]).T  # [K, N]
        return self.b.op("MatMul", [x, self.b.init(f"{tag}.w", wt)], name=tag)[0]

    def _blocks(self, x: str, parts: list, k: int, tag: str) -> str:
        """MatMulNBits over the concatenated blocks of `parts` ((bits, B, scales, offsets or None)
        each), plus the Q4_1 block-offset term."""
        b = self.b
        bq = b.init(f"{tag}.q", np.concatenate([p[1] for p in parts]))
        sc = b.init(f"{tag}.scales", np.concatenate([p[2] for p in parts]))
        n = sum(p[1].shape[0] for p in parts)
        y = b.op("MatMulNBits", [x, bq, sc], domain=MS, name=tag, K=k, N=n, bits=parts[0][0],
                 block_size=_BLOCK, accuracy_level=self.accuracy_level)[0]
        if parts[0][3] is None:
            return y
        sums = self._block_sums(x, k, tag)
        off = b.init(f"{tag}.offsets", np.concatenate([p[3] for p in parts]).T)  # [K/32, N]
        corr = b.op("MatMul", [sums, off], name=f"{tag}.offset")[0]
        return b.op("Add", [y, corr], name=f"{tag}.add_offset")[0]

    def _block_sums(self, x: str, k: int, tag: str) -> str:
        """x [.., K] -> [.., K/32]: the inputs summed per block (built on first use of `x`)."""
        if x not in self.block_sums:
            b = self.b
            r = b.op("Reshape", [x, b.init(f"{tag}.bshape", np.array([0, 0, k // _BLOCK, _BLOCK], np.int64))],
                     name=f"{tag}.blocks")[0]
            self.block_sums[x] = b.op("ReduceSum", [r, b.init(f"{tag}.baxis", np.array([-1], np.int64))],
                                      name=f"{tag}.block_sums", keepdims=0)[0]
        return self.block_sums[x]


def _rms_norm(b: _Builder, x: str, name: str, weight: np.ndarray, eps: float) -> str:
    """RMSNorm of x [.., dim] (SimplifiedLayerNormalization; fp32 statistics); node and weight `name`."""
    return b.op("SimplifiedLayerNormalization", [x, b.init(name, weight)], name=name, axis=-1, epsilon=eps,
                stash_type=1)[0]


def _skip_norm(b: _Builder, x: str, residual: str, name: str, weight: np.ndarray, eps: float) -> tuple[str, str]:
    """(RMSNorm(x + residual), x + residual) (SkipSimplifiedLayerNormalization); node and weight `name`."""
    hn, _, _, res = b.op("SkipSimplifiedLayerNormalization", [x, residual, b.init(name, weight)], n_out=4,
                         domain=MS, name=name, epsilon=eps)
    return hn, res


def _rope_tables(b: _Builder, cfg: ModelConfig) -> tuple[str, str]:
    """The RoPE cos/sin initializers float32 [context_length, head_dim/2] (rotate_half layout) of
    positions 0..context_length-1 times `rope_inv_freq`, in float32 as the torch model's `rope`."""
    freqs = np.arange(cfg.context_length, dtype=np.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    return b.init("rope.cos", np.cos(freqs)), b.init("rope.sin", np.sin(freqs))


def _embedding(lin: _Linear, cfg: ModelConfig) -> tuple[str, tuple | None]:
    """(hidden states [1, S, dim] of `input_ids`, the embedding's Q8_0 blocks or None). 'gguf' with a
    Q8_0 embedding: GatherBlockQuantized over its blocks; else a Gather over the dequantized table."""
    b, dim = lin.b, cfg.dim
    blocks = lin.w.blocks("token_embd.weight", dim) if lin.weights == "gguf" else None
    if blocks is None or blocks[0] != 8:
        b.init("embed.w", lin.w.dense("token_embd.weight"))
        return b.op("Gather", ["embed.w", "input_ids"], name="embed")[0], None
    _, eq, es, _ = blocks
    b.init("embed.q", eq)
    g = b.op("GatherBlockQuantized", ["embed.q", "input_ids", b.init("embed.scales3", es[..., None])],
             domain=MS, name="embed", bits=8, block_size=_BLOCK, gather_axis=0, quantize_axis=2)[0]
    return b.op("Reshape", [g, b.init("shape.embed", np.array([0, 0, dim], np.int64))], name="embed_flat")[0], blocks


def _layer(lin: _Linear, cfg: ModelConfig, i: int, hn: str, residual: str,
           rope: tuple[str, str]) -> tuple[str | None, str]:
    """Decoder layer `i` on its normed input `hn` [1, S, dim] and residual stream: attention (fused
    QKV, RoPE, GQA over the cache buffers past_*.i / present_*.i, output projection) and SwiGLU.
    Returns (the next layer's normed input, the residual stream); after the last layer the first
    is None and the second the final hidden states."""
    b, p, eps = lin.b, f"blk.{i}.", float(cfg.norm_eps)
    h, kvh, hd, ffn = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    qkv = lin(hn, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], cfg.dim, f"l{i}.qkv")
    q, k, v = b.op("Split", [qkv, b.init(f"l{i}.qkv.split", np.array([h * hd, kvh * hd, kvh * hd], np.int64))],
                   n_out=3, name=f"l{i}.qkv_split", axis=-1)
    q = b.op("RotaryEmbedding", [q, "position_ids", *rope], domain=MS, name=f"l{i}.rope_q", num_heads=h,
             interleaved=0)[0]
    k = b.op("RotaryEmbedding", [k, "position_ids", *rope], domain=MS, name=f"l{i}.rope_k", num_heads=kvh,
             interleaved=0)[0]
    attn = b.op("GroupQueryAttention",
                [q, k, v, f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length"],
                domain=MS, name=f"l{i}.gqa", outputs=[f"l{i}.gqa/out", f"present_key.{i}", f"present_value.{i}"],
                num_heads=h, kv_num_heads=kvh, do_rotary=0)[0]
    o = lin(attn, [p + "attn_output.weight"], h * hd, f"l{i}.wo")
    hn, residual = _skip_norm(b, o, residual, f"l{i}.ffn_norm", lin.w.vector(p + "ffn_norm.weight"), eps)
    gu = lin(hn, [p + "ffn_gate.weight", p + "ffn_up.weight"], cfg.dim, f"l{i}.gate_up")
    gate, up = b.op("Split", [gu, b.init(f"l{i}.gu.split", np.array([ffn, ffn], np.int64))],
                    n_out=2, name=f"l{i}.gu_split", axis=-1)
    silu = b.op("Mul", [gate, b.op("Sigmoid", [gate], name=f"l{i}.sigmoid")[0]], name=f"l{i}.silu")[0]
    act = b.op("Mul", [silu, up], name=f"l{i}.swiglu")[0]
    d = lin(act, [p + "ffn_down.weight"], ffn, f"l{i}.down")
    if i + 1 == cfg.n_layers:
        return None, b.op("Add", [d, residual], name="final_residual")[0]
    return _skip_norm(b, d, residual, f"l{i + 1}.attn_norm", lin.w.vector(f"blk.{i + 1}.attn_norm.weight"), eps)


def _head(lin: _Linear, cfg: ModelConfig, hidden: str, emb_q8: tuple | None, head_level: int) -> None:
    """logits [1, vocab] of the last position of `hidden` [1, S, dim]: final RMSNorm, then the
    output head. Tied Q8_0 embedding (`emb_q8`): at `head_level` 4 a MatMulNBits over its blocks,
    else a fp32 Gemm over the dequantized table; untied: the projection of `output.weight`."""
    b = lin.b
    last = b.op("Slice", [hidden, b.init("slice.start", np.array([-1], np.int64)),
                          b.init("slice.end", np.array([np.iinfo(np.int64).max], np.int64)),
                          b.init("slice.axis", np.array([1], np.int64))], name="last_position")[0]
    last = b.op("Squeeze", [last, b.init("squeeze.axis", np.array([1], np.int64))], name="last_squeeze")[0]
    xn = _rms_norm(b, last, "output_norm", lin.w.vector("output_norm.weight"), float(cfg.norm_eps))
    q8_head = cfg.tied_embeddings and emb_q8 is not None
    if q8_head and head_level == 4:
        b.init("embed.scales", emb_q8[2])
        b.op("MatMulNBits", [xn, "embed.q", "embed.scales"], domain=MS, name="lm_head", outputs=["logits"],
             K=cfg.dim, N=cfg.vocab_size, bits=8, block_size=_BLOCK, accuracy_level=head_level)
    elif cfg.tied_embeddings:
        if q8_head:
            b.init("embed.w", lin.w.dense("token_embd.weight"))
        b.op("Gemm", [xn, "embed.w"], name="lm_head", outputs=["logits"], transB=1)
    else:
        b.op("Identity", [lin(xn, ["output.weight"], cfg.dim, "lm_head")], name="logits_out", outputs=["logits"])


def _io_specs(cfg: ModelConfig) -> tuple[list, list]:
    """The graph's (inputs, outputs) as `onnx.ValueInfoProto`s, in `io_names` order."""
    from onnx import TensorProto, helper

    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    cache = ["batch", cfg.n_kv_heads, "capacity", cfg.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", i32, [])]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", cfg.vocab_size])]
    for i in range(cfg.n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", f32, cache))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", f32, cache))
    return inputs, outputs


def build_model(model_path: str | os.PathLike, weights: str = "gguf", accuracy_level: int = ACCURACY_LEVEL,
                head_accuracy_level: int | None = None):
    """The `onnx.ModelProto` of the GGUF at `model_path` (see the module docstring for its inputs
    and outputs) and its `ModelConfig`. `weights`: 'gguf' (MatMulNBits over the file's own blocks;
    tensors of other types, e.g. F16 or K-quants, fall back to dense fp32) or 'fp32'.
    `accuracy_level`: of the MatMulNBits nodes (0: fp32 activations; 4: activations quantized to
    int8 per block). At level 0 an 8-bit (Q8_0) output head is stored dequantized (fp32 Gemm)
    because ORT 1.32 runs 8-bit MatMulNBits at level 0 by dequantizing the whole matrix per call
    (about 70x slower); the embedding still reads the Q8_0 blocks (GatherBlockQuantized).
    `head_accuracy_level`: that of the output head alone (None: `accuracy_level`).

    Raises:
        ValueError: unknown `weights`.
        ModelFileError / UnsupportedModelError: bad or unsupported model file.
    """
    from onnx import helper

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {WEIGHTS}")
    reader = open_gguf(model_path)
    cfg = read_config(reader)
    lin = _Linear(_Builder(), _Weights(reader, cfg), weights, accuracy_level)
    b = lin.b
    rope = _rope_tables(b, cfg)
    x, emb_q8 = _embedding(lin, cfg)
    hn = _rms_norm(b, x, "l0.attn_norm", lin.w.vector("blk.0.attn_norm.weight"), float(cfg.norm_eps))
    residual = x
    for i in range(cfg.n_layers):
        hn, residual = _layer(lin, cfg, i, hn, residual, rope)
    _head(lin, cfg, residual, emb_q8, accuracy_level if head_accuracy_level is None else head_accuracy_level)
    graph = helper.make_graph(b.nodes, f"llama-{weights}", *_io_specs(cfg), b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="relayinfer")
    model.ir_version = 10
    return model, cfg


def write_model(model_path: str | os.PathLike, out: str | os.PathLike, weights: str = "gguf",
                accuracy_level: int = ACCURACY_LEVEL, head_accuracy_level: int | None = None) -> ModelConfig:
    """Build the graph (`build_model`) and save it as one ONNX file `out` (must stay < 2 GiB).
    Returns the model's config."""
    import onnx

    model, cfg = build_model(model_path, weights, accuracy_level, head_accuracy_level)
    onnx.save_model(model, str(Path(out)))
    return cfg
