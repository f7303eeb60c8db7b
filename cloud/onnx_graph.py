"""The device's ONNX graph of a Llama GGUF, written directly with `onnx.helper` (no torch tracing).

Weight formats (`WEIGHTS`; 'gguf-q8' is 'gguf' with the MLP's blocks, every 8-bit block matrix and the
head at accuracy level 4, i.e. on int8 activations as llama.cpp's Q8_1; see `build_model`):

* ``gguf``: every block-quantized GGUF matrix becomes a `com.microsoft.MatMulNBits` initializer that
  holds the file's own blocks and scales (no re-quantization; `cloud.ggml_blocks` maps each type:
  Q4_0, Q4_1, Q4_K as 4-bit blocks, Q5_0, Q5_K, Q6_K, Q8_0 as 8-bit blocks, K-quant sub-block
  scales and minimums kept), plus, for the types with per-block minimums (Q4_1, Q4_K, Q5_K), a
  small fp32 MatMul of the per-block input sums with the offsets. F16/BF16 and other types are
  stored dequantized (dense fp32). A tied Q8_0 embedding is read by `GatherBlockQuantized` from the
  same bytes as the output head.
* ``fp32``: the matrices dequantized with `gguf.quants.dequantize` (the same numbers as the torch
  `Llama` of `cloud/models/llama.py`), as plain MatMul/Gemm.

Graph (batch 1, `S` new tokens, the KV cache a shared buffer of capacity `C`):

    inputs:  input_ids int64 [1, S]; position_ids int64 [1, S] (RoPE positions of the new tokens);
             seqlens_k int32 [1] (cached + new tokens - 1); total_sequence_length int32 scalar
             (cached + new tokens); past_key.i / past_value.i float32 [1, kv_heads, C, head_dim]
    outputs: logits float32 [1, vocab] (last position); present_key.i / present_value.i, the same
             buffers when bound to the same memory (ORT's `past_present_share_buffer`)

Per layer: SimplifiedLayerNormalization (RMSNorm) / SkipSimplifiedLayerNormalization (residual add +
RMSNorm), one fused QKV matmul (+ biases, Qwen2), q/k norms (Gemma 3), `RotaryEmbedding`
(rotate_half layout, positions from `position_ids`, so a token can keep its original position while
its cache slot is the next free one; one table per RoPE base), `GroupQueryAttention` (fused causal
GQA writing the new keys/values into the buffer at seqlens_k + 1 - S; `local_window_size` on
sliding-window layers), the output projection, a fused gate/up matmul and SwiGLU (Shazeer 2020) or
GeGLU, and Gemma's norms after attention and MLP. Llama's Q/K rows are un-permuted from llama.cpp's
interleaved rotary layout (`_unpermute`), so the cache holds the same post-RoPE keys as the torch
model's. Op schemas: onnxruntime `contrib_defs.cc`
(ORT 1.32); the layout follows onnxruntime-genai's model builder for Llama.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from relayinfer.cloud.ggml_blocks import Blocks, decompose, split_nibbles
from relayinfer.protocol.model.device_model import WEIGHTS  # noqa: F401  (this module's API)
from relayinfer.protocol.model.errors import ModelFileError
from relayinfer.protocol.model.model_file import ModelConfig, open_gguf, read_config, rope_inv_freq

ROPE_POSITIONS = 32768  # RoPE table rows at most (positions; the context is capped to it on the device)
ACCURACY_LEVEL = 0  # MatMulNBits: 0 = activations stay fp32 (4 = int8 activations; see docs/SPLIT.md)
OPSET = 21
MS = "com.microsoft"
_BLOCK = 32  # GGUF block length of Q4_0/Q4_1/Q8_0 (QK4_1 = QK8_0 = 32)
_MLP = (".gate_up", ".down")  # the tags of the MLP projections (`_layer`)


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
        if self.cfg.rope_permuted and ".attn_q." in name:
            raw = _unpermute(raw, self.cfg.n_heads)
        elif self.cfg.rope_permuted and ".attn_k." in name:
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

    def blocks(self, name: str, k: int) -> Blocks | None:
        """The tensor's rows as MatMulNBits `Blocks` (`cloud.ggml_blocks.decompose`: Q4_0, Q4_1,
        Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), else None (stored dense)."""
        raw, kind = self._rows(name)
        return decompose(raw, kind.name, k)


class _Linear:
    """The projections x [.., K] @ W^T of one graph, W the row-concatenation of GGUF tensors.

    'gguf' weights: one MatMulNBits over the file's own Q4_1 / Q8_0 blocks when every tensor has
    them at the same bit width (else a dense fp32 MatMul), plus for Q4_1 the block-offset term
    (block sums of the input [.., K/32] @ offsets [K/32, N]); the block sums of one input are built
    once and shared by every projection that reads it. 'fp32' weights: a dense fp32 MatMul.
    """

    def __init__(self, b: _Builder, w: _Weights, weights: str, accuracy_level: int, level_8bit: int | None = None,
                 mlp_level: int | None = None):
        self.b, self.w, self.weights, self.accuracy_level = b, w, weights, accuracy_level
        self.level_8bit = accuracy_level if level_8bit is None else level_8bit
        self.mlp_level = accuracy_level if mlp_level is None else mlp_level
        self.block_sums: dict[tuple[str, int], str] = {}  # (input, block) -> its per-block sums [.., K/block]

    def __call__(self, x: str, names: list[str], k: int, tag: str, bias: list[str] | None = None) -> str:
        """The output name of x [.., K] @ W^T (+ the concatenated `bias` vectors) -> [.., N] (N: the
        rows of `names` together); nodes and initializers are named after `tag`. The tensors stay
        blocks when every one of them has blocks of the same bits and length; otherwise all of
        them are dense."""
        y = None
        if self.weights == "gguf":
            parts = [self.w.blocks(n, k) for n in names]
            if all(p is not None for p in parts) and len({(p.bits, p.block) for p in parts}) == 1:
                y = self._blocks(x, parts, k, tag)
        if y is None:
            wt = np.concatenate([self.w.dense(n) for n in names]).T  # [K, N]
            y = self.b.op("MatMul", [x, self.b.init(f"{tag}.w", wt)], name=tag)[0]
        if bias:
            vec = np.concatenate([self.w.vector(n) for n in bias])
            y = self.b.op("Add", [y, self.b.init(f"{tag}.bias", vec)], name=f"{tag}.add_bias")[0]
        return y

    def _blocks(self, x: str, parts: list[Blocks], k: int, tag: str, level: int | None = None) -> str:
        """MatMulNBits over the concatenated blocks of `parts`, plus the block-offset term where
        a part has offsets (Q4_1, Q4_K, Q5_K; zeros for the parts without); `level`: its accuracy
        level (None: by the parts' bits and the tag)."""
        b, block = self.b, parts[0].block
        bq = b.init(f"{tag}.q", np.concatenate([p.packed() for p in parts]))
        sc = b.init(f"{tag}.scales", np.concatenate([p.scale for p in parts]))
        n = sum(p.q.shape[0] for p in parts)
        if level is None:
            level = self.level_8bit if parts[0].bits == 8 else self.mlp_level if tag.endswith(_MLP) else self.accuracy_level
        y = b.op("MatMulNBits", [x, bq, sc], domain=MS, name=tag, K=k, N=n, bits=parts[0].bits,
                 block_size=block, accuracy_level=level)[0]
        if all(p.offset is None for p in parts):
            return y
        sums = self._block_sums(x, k, block, tag)
        off = np.concatenate([p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts])
        corr = b.op("MatMul", [sums, b.init(f"{tag}.offsets", off.T)], name=f"{tag}.offset")[0]  # [K/block, N]
        return b.op("Add", [y, corr], name=f"{tag}.add_offset")[0]

    def _block_sums(self, x: str, k: int, block: int, tag: str) -> str:
        """x [.., K] -> [.., K/block]: the inputs summed per block (built on first use of `x`)."""
        if (x, block) not in self.block_sums:
            b = self.b
            r = b.op("Reshape", [x, b.init(f"{tag}.bshape", np.array([0, 0, k // block, block], np.int64))],
                     name=f"{tag}.blocks")[0]
            self.block_sums[x, block] = b.op("ReduceSum", [r, b.init(f"{tag}.baxis", np.array([-1], np.int64))],
                                             name=f"{tag}.block_sums", keepdims=0)[0]
        return self.block_sums[x, block]


def _rms_norm(b: _Builder, x: str, name: str, weight: np.ndarray, eps: float) -> str:
    """RMSNorm of x [.., dim] (SimplifiedLayerNormalization; fp32 statistics); node and weight `name`."""
    return b.op("SimplifiedLayerNormalization", [x, b.init(name, weight)], name=name, axis=-1, epsilon=eps,
                stash_type=1)[0]


def _skip_norm(b: _Builder, x: str, residual: str, name: str, weight: np.ndarray, eps: float) -> tuple[str, str]:
    """(RMSNorm(x + residual), x + residual) (SkipSimplifiedLayerNormalization); node and weight `name`."""
    hn, _, _, res = b.op("SkipSimplifiedLayerNormalization", [x, residual, b.init(name, weight)], n_out=4,
                         domain=MS, name=name, epsilon=eps)
    return hn, res


def _rope_tables(b: _Builder, cfg: ModelConfig, positions: int) -> dict[float, tuple[str, str]]:
    """Per RoPE base of the model (`ModelConfig.rope_thetas`) the cos/sin initializers float32
    [positions, head_dim/2] (rotate_half layout) of positions 0..positions-1 times
    `rope_inv_freq`, in float32 as the torch model's `rope`."""
    out = {}
    for j, theta in enumerate(cfg.rope_thetas):
        freqs = np.arange(positions, dtype=np.float32)[:, None] * rope_inv_freq(cfg, theta)[None, :]
        tag = "rope" if j == 0 else f"rope{j}"
        out[theta] = b.init(f"{tag}.cos", np.cos(freqs)), b.init(f"{tag}.sin", np.sin(freqs))
    return out


def _embedding(lin: _Linear, cfg: ModelConfig) -> tuple[str, Blocks | None]:
    """(hidden states [1, S, dim] of `input_ids` times `cfg.embed_scale`, the embedding's Q8_0
    blocks or None). 'gguf' with a Q8_0 embedding: GatherBlockQuantized over its blocks; else a
    Gather over the dequantized table."""
    b, dim = lin.b, cfg.dim
    blocks = lin.w.blocks("token_embd.weight", dim) if lin.weights == "gguf" else None
    if blocks is None or blocks.bits != 8 or blocks.block != _BLOCK or blocks.offset is not None:
        b.init("embed.w", lin.w.dense("token_embd.weight"))
        x, blocks = b.op("Gather", ["embed.w", "input_ids"], name="embed")[0], None
    else:
        b.init("embed.q", blocks.q)
        g = b.op("GatherBlockQuantized", ["embed.q", "input_ids", b.init("embed.scales3", blocks.scale[..., None])],
                 domain=MS, name="embed", bits=8, block_size=_BLOCK, gather_axis=0, quantize_axis=2)[0]
        x = b.op("Reshape", [g, b.init("shape.embed", np.array([0, 0, dim], np.int64))], name="embed_flat")[0]
    if cfg.embed_scale != 1.0:  # Gemma: sqrt(dim), rounded to float32 as the torch model's
        x = b.op("Mul", [x, b.init("embed.scale", np.array(cfg.embed_scale, np.float32))], name="embed_scale")[0]
    return x, blocks


def _layer(lin: _Linear, cfg: ModelConfig, i: int, hn: str, residual: str,
           rope: dict[float, tuple[str, str]]) -> tuple[str | None, str]:
    """Decoder layer `i` on its normed input `hn` [1, S, dim] and residual stream: attention (fused
    QKV with the biases where the model has them, q/k norms, RoPE of the layer's base, GQA over the
    cache buffers past_*.i / present_*.i with the layer's sliding window, output projection, the
    post-attention norm) and the gated MLP (SwiGLU or GeGLU, the post-MLP norm).
    Returns (the next layer's normed input, the residual stream); after the last layer the first
    is None and the second the final hidden states."""
    b, p, eps = lin.b, f"blk.{i}.", float(cfg.norm_eps)
    h, kvh, hd, ffn = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    qkv_names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    bias = [n.replace(".weight", ".bias") for n in qkv_names] if cfg.qkv_bias else None
    qkv = lin(hn, qkv_names, cfg.dim, f"l{i}.qkv", bias)
    q, k, v = b.op("Split", [qkv, b.init(f"l{i}.qkv.split", np.array([h * hd, kvh * hd, kvh * hd], np.int64))],
                   n_out=3, name=f"l{i}.qkv_split", axis=-1)
    if cfg.qk_norm:  # Gemma 3: RMSNorm over head_dim of each head, before RoPE
        q = _head_norm(b, q, h, hd, f"l{i}.q_norm", lin.w.vector(p + "attn_q_norm.weight"), eps)
        k = _head_norm(b, k, kvh, hd, f"l{i}.k_norm", lin.w.vector(p + "attn_k_norm.weight"), eps)
    tables = rope[cfg.layer_rope_theta(i)]
    q = b.op("RotaryEmbedding", [q, "position_ids", *tables], domain=MS, name=f"l{i}.rope_q", num_heads=h,
             interleaved=0)[0]
    k = b.op("RotaryEmbedding", [k, "position_ids", *tables], domain=MS, name=f"l{i}.rope_k", num_heads=kvh,
             interleaved=0)[0]
    # a sliding window of W keys (q_pos - k_pos < W, as transformers and llama.cpp mask) is ORT's
    # local_window_size W: measured equal to the torch model and transformers, prefill and decode
    # across the window (tests/test_architectures.py)
    window = {"local_window_size": cfg.window(i)} if cfg.window(i) else {}
    attn = b.op("GroupQueryAttention",
                [q, k, v, f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length"],
                domain=MS, name=f"l{i}.gqa", outputs=[f"l{i}.gqa/out", f"present_key.{i}", f"present_value.{i}"],
                num_heads=h, kv_num_heads=kvh, do_rotary=0, **window)[0]
    o = lin(attn, [p + "attn_output.weight"], h * hd, f"l{i}.wo")
    if cfg.post_norms:
        o = _rms_norm(b, o, f"l{i}.post_attn_norm", lin.w.vector(p + "post_attention_norm.weight"), eps)
    hn, residual = _skip_norm(b, o, residual, f"l{i}.ffn_norm", lin.w.vector(p + "ffn_norm.weight"), eps)
    gu = lin(hn, [p + "ffn_gate.weight", p + "ffn_up.weight"], cfg.dim, f"l{i}.gate_up")
    gate, up = b.op("Split", [gu, b.init(f"l{i}.gu.split", np.array([ffn, ffn], np.int64))],
                    n_out=2, name=f"l{i}.gu_split", axis=-1)
    if cfg.act == "gelu_tanh":  # GeGLU with the tanh approximation (Gemma)
        a = b.op("Gelu", [gate], name=f"l{i}.gelu", approximate="tanh")[0]
    else:
        a = b.op("Mul", [gate, b.op("Sigmoid", [gate], name=f"l{i}.sigmoid")[0]], name=f"l{i}.silu")[0]
    act = b.op("Mul", [a, up], name=f"l{i}.geglu" if cfg.act == "gelu_tanh" else f"l{i}.swiglu")[0]
    d = lin(act, [p + "ffn_down.weight"], ffn, f"l{i}.down")
    if cfg.post_norms:
        d = _rms_norm(b, d, f"l{i}.post_ffn_norm", lin.w.vector(p + "post_ffw_norm.weight"), eps)
    if i + 1 == cfg.n_layers:
        return None, b.op("Add", [d, residual], name="final_residual")[0]
    return _skip_norm(b, d, residual, f"l{i + 1}.attn_norm", lin.w.vector(f"blk.{i + 1}.attn_norm.weight"), eps)


def _head_norm(b: _Builder, x: str, heads: int, hd: int, name: str, weight: np.ndarray, eps: float) -> str:
    """RMSNorm over head_dim of each head of x [1, S, heads * hd] (q/k norm): reshaped to
    [1, S, heads, hd], normed, reshaped back."""
    r = b.op("Reshape", [x, b.init(f"{name}.shape", np.array([0, 0, heads, hd], np.int64))], name=f"{name}.split")[0]
    n = _rms_norm(b, r, name, weight, eps)
    return b.op("Reshape", [n, b.init(f"{name}.back", np.array([0, 0, heads * hd], np.int64))], name=f"{name}.merge")[0]


def _head(lin: _Linear, cfg: ModelConfig, hidden: str, emb_q8: Blocks | None, head_level: int) -> None:
    """logits [1, vocab] of the last position of `hidden` [1, S, dim]: final RMSNorm, then the
    output head. Tied Q8_0 embedding (`emb_q8`): at `head_level` 4 an 8-bit MatMulNBits over its
    blocks; at level 0 (float32 activations) the same blocks as two 4-bit MatMulNBits over their
    high and low nibbles (`ggml_blocks.split_nibbles`: exact, 1.4 bytes per weight instead of the
    dequantized table's 4, 3.0 against 4.5 ms a call on one core, for SmolLM2's 49,152 x 576 head);
    untied: the projection of `output.weight`."""
    b = lin.b
    last = b.op("Slice", [hidden, b.init("slice.start", np.array([-1], np.int64)),
                          b.init("slice.end", np.array([np.iinfo(np.int64).max], np.int64)),
                          b.init("slice.axis", np.array([1], np.int64))], name="last_position")[0]
    last = b.op("Squeeze", [last, b.init("squeeze.axis", np.array([1], np.int64))], name="last_squeeze")[0]
    xn = _rms_norm(b, last, "output_norm", lin.w.vector("output_norm.weight"), float(cfg.norm_eps))
    q8_head = cfg.tied_embeddings and emb_q8 is not None
    if q8_head and head_level == 4:
        b.init("embed.scales", emb_q8.scale)
        b.op("MatMulNBits", [xn, "embed.q", "embed.scales"], domain=MS, name="lm_head", outputs=["logits"],
             K=cfg.dim, N=cfg.vocab_size, bits=8, block_size=_BLOCK, accuracy_level=head_level)
    elif q8_head and head_level == 0:
        hi, lo = split_nibbles(emb_q8)
        x3 = b.op("Unsqueeze", [xn, "squeeze.axis"], name="lm_head.x3")[0]  # [1, 1, dim]: the block sums' layout
        y_hi = lin._blocks(x3, [hi], cfg.dim, "lm_head.hi", level=0)
        y_lo = lin._blocks(x3, [lo], cfg.dim, "lm_head.lo", level=0)
        y = b.op("Add", [y_hi, y_lo], name="lm_head")[0]
        b.op("Squeeze", [y, "squeeze.axis"], name="lm_head.squeeze", outputs=["logits"])
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
                head_accuracy_level: int | None = None, level_8bit: int | None = None, mlp_level: int | None = None):
    """The `onnx.ModelProto` of the GGUF at `model_path` (see the module docstring for its inputs
    and outputs) and its `ModelConfig`. `weights`: 'gguf' (MatMulNBits over the file's own blocks,
    `cloud.ggml_blocks`; tensors of other types, e.g. F16, fall back to dense fp32) or 'fp32'.
    `accuracy_level`: of the MatMulNBits nodes (0: fp32 activations; 4: activations quantized to
    int8 per block). At level 0 an 8-bit (Q8_0) output head is stored dequantized (fp32 Gemm)
    because ORT 1.32 runs 8-bit MatMulNBits at level 0 by dequantizing the whole matrix per call
    (about 70x slower); the embedding still reads the Q8_0 blocks (GatherBlockQuantized).
    `head_accuracy_level`: that of the output head alone (None: `accuracy_level`). `level_8bit`:
    that of the 8-bit projections (Q5_0, Q5_K, Q6_K, Q8_0 layers; None: `accuracy_level`). `mlp_level`:
    that of the 4-bit gate/up/down projections (None: `accuracy_level`).

    'gguf-q8' sets the head, the 8-bit projections and the 4-bit MLP to level 4 and keeps the 4-bit
    attention projections at level 0: on SmolLM2 (bench/fidelity.py, 24 prompts x 64 greedy tokens)
    int8 activations into Q/K/V and the output projection moved the answers further from fp32 than
    llama.cpp's (median first divergence 10.5 vs 12 with every matrix at level 4), while the MLP at
    level 4 alone stays closer (26.5); the MLP holds 75 % of a layer's weights.

    Raises:
        ValueError: unknown `weights`.
        ModelFileError / UnsupportedModelError: bad or unsupported model file.
    """
    from onnx import helper

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {WEIGHTS}")
    if weights == "gguf-q8":  # int8 activations (llama.cpp's Q8_1 way) except into the 4-bit attention projections
        weights = "gguf"
        level_8bit, mlp_level, head_accuracy_level = (4 if v is None else v for v in (level_8bit, mlp_level,
                                                                                        head_accuracy_level))
    reader = open_gguf(model_path)
    cfg = read_config(reader)
    lin = _Linear(_Builder(), _Weights(reader, cfg), weights, accuracy_level, level_8bit, mlp_level)
    b = lin.b
    rope = _rope_tables(b, cfg, min(cfg.context_length, ROPE_POSITIONS))
    x, emb_q8 = _embedding(lin, cfg)
    hn = _rms_norm(b, x, "l0.attn_norm", lin.w.vector("blk.0.attn_norm.weight"), float(cfg.norm_eps))
    residual = x
    for i in range(cfg.n_layers):
        hn, residual = _layer(lin, cfg, i, hn, residual, rope)
    _head(lin, cfg, residual, emb_q8, accuracy_level if head_accuracy_level is None else head_accuracy_level)
    graph = helper.make_graph(b.nodes, f"{cfg.arch}-{weights}", *_io_specs(cfg), b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="relayinfer")
    model.ir_version = 10
    return model, cfg


def write_model(model_path: str | os.PathLike, out: str | os.PathLike, weights: str = "gguf", **levels) -> ModelConfig:
    """Build the graph (`build_model`; `levels`: its accuracy-level keywords) and save it as one
    ONNX file `out` (must stay < 2 GiB). Returns the model's config."""
    import onnx

    model, cfg = build_model(model_path, weights, **levels)
    onnx.save_model(model, str(Path(out)))
    return cfg
