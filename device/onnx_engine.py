"""The device runtime: the exported Llama (`cloud/onnx_graph.py`) on ONNX Runtime. No torch.

The KV cache is one pre-allocated buffer per layer and kind, float32 [1, kv_heads, capacity,
head_dim], owned by numpy and bound through IO binding as both `past_*` input and `present_*` output
of `com.microsoft.GroupQueryAttention` (ORT's `past_present_share_buffer`): a step writes only the
new tokens' keys/values in place, so neither decode nor chunked prefill copies the cache. The
buffer grows by doubling (one copy) when a prefill would overflow it, up to the context length.

Two weight formats (`WEIGHTS`): 'gguf' (the default: MatMulNBits over the GGUF file's own Q4_1/Q8_0
blocks) and 'fp32' (dequantized weights, the torch model's numbers).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from relayinfer.protocol.model.decoding import GenerationOutput, SamplingParams, generate
from relayinfer.protocol.model.errors import ModelFileError
from relayinfer.protocol.model.device_model import (  # noqa: F401  (part of this module's API)
    DEFAULT_WEIGHTS, FORMAT_VERSION, WEIGHTS, device_model_dir, onnx_file_name)
from relayinfer.protocol.model.model_file import ModelConfig
from relayinfer.protocol.model.tokenizer import Tokenizer

MIN_CAPACITY = 256  # tokens of a fresh cache buffer


@dataclass
class OnnxKV:
    """The device KV cache: `buffers` per layer (key, value) float32 numpy [1, kv_heads, capacity,
    head_dim] (post-RoPE keys), of which the first `length` positions are valid; `values` the
    OrtValues over the same memory, in graph order (key.0, value.0, key.1, ...).

    prefill/decode write the new tokens at positions length.. of these buffers in place and return
    an OnnxKV over the same buffers: an older OnnxKV of the same buffers stays valid for its own
    `length` tokens (so `truncate` is free) but two continuations of one OnnxKV overwrite each
    other; take a copy with `OnnxEngine.fork` (or kv_import(kv_export(kv))) to branch."""

    buffers: list
    values: list
    length: int

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0


class OnnxEngine:
    """Llama on ONNX Runtime (CPU execution provider by default).

    `prefill(ids, kv=None, positions=None) -> (logits, kv)` runs `ids` after the cached tokens;
    `decode(token, kv)` is prefill of one token. logits: float32 numpy [vocab] of the last position.

    Args:
        model_dir: directory with model.<gguf|fp32>.onnx, config.json and tokenizer files (made by
            `relayinfer export`, `relayinfer.cloud.export.ensure_device_model`).
        quantize: device weights, 'gguf' or 'fp32' (None = `DEFAULT_WEIGHTS`, 'gguf'); the old
            'int8' is refused (ValueError).
        threads: intra-op threads (the device default is 1).
        providers: ONNX Runtime execution providers.

    Raises:
        ModelFileError: the directory lacks the exported files.
        ValueError: unknown `quantize`.
    """

    def __init__(self, model_dir: str | os.PathLike, quantize: str | None = None, threads: int = 1,
                 providers: Sequence[str] = ("CPUExecutionProvider",)):
        import onnxruntime as ort

        d = Path(model_dir)
        self.weights = quantize or DEFAULT_WEIGHTS
        onnx_file = d / onnx_file_name(self.weights)
        if not onnx_file.is_file() or not (d / "config.json").is_file():
            raise ModelFileError(f"no exported device model at {onnx_file}; run `relayinfer export"
                                 f"{' --quantize ' + self.weights if quantize else ''}`")
        self.model_dir, self.onnx_file, self.threads = d, onnx_file, threads
        self.cfg = ModelConfig.from_json((d / "config.json").read_text())
        self.context_length, self.eos_id = self.cfg.context_length, self.cfg.eos_id
        self.manifest = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").is_file() else {}
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(onnx_file), so, providers=list(providers))
        self._ort = ort
        self._in = [i.name for i in self.session.get_inputs()]
        self._out = [o.name for o in self.session.get_outputs()]
        if "position_ids" not in self._in or "past_key.0" not in self._in:
            raise ModelFileError(f"{onnx_file} is not a format-{FORMAT_VERSION} device model; export it again")
        self._cache_names = [(f"past_{k}.{i}", f"present_{k}.{i}")
                             for i in range(self.cfg.n_layers) for k in ("key", "value")]

    @classmethod
    def for_model(cls, model_path: str | os.PathLike | None = None, **kw) -> "OnnxEngine":
        """The engine for an exported GGUF model (default model when None)."""
        return cls(device_model_dir(model_path), **kw)

    @property
    def fingerprint(self) -> str:
        return self.manifest.get("model_fingerprint", "")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.model_dir)

    # --- the cache -----------------------------------------------------------------------------------

    def new_cache(self, capacity: int = MIN_CAPACITY) -> OnnxKV:
        """An empty cache with room for `capacity` tokens (grows on demand; at most the context
        length). Memory: capacity x `cfg.kv_bytes_per_token` bytes (18 KiB/token for SmolLM2-135M)."""
        c = self.cfg
        cap = max(1, min(int(capacity), c.context_length))
        bufs = [np.zeros((1, c.n_kv_heads, cap, c.head_dim), np.float32) for _ in range(2 * c.n_layers)]
        return OnnxKV(bufs, [self._ort.OrtValue.ortvalue_from_numpy(b) for b in bufs], 0)

    def _room(self, kv: OnnxKV, n: int) -> OnnxKV:
        """`kv` with capacity for `n` more tokens (a doubled buffer with the valid part copied)."""
        need = kv.length + n
        if need > self.context_length:
            raise ValueError(f"{kv.length} cached + {n} new tokens exceed the context length {self.context_length}")
        if need <= kv.capacity:
            return kv
        new = self.new_cache(max(need, 2 * kv.capacity, MIN_CAPACITY))
        for dst, src in zip(new.buffers, kv.buffers):
            dst[:, :, :kv.length] = src[:, :, :kv.length]
        new.length = kv.length
        return new

    def truncate(self, kv: OnnxKV, n: int) -> OnnxKV:
        """The cache of the first `n` tokens of `kv` (0 <= n <= kv.length). O(1): the same buffers
        with a shorter length (see `OnnxKV` on sharing).

        Raises:
            ValueError: `n` outside [0, kv.length].
        """
        if not 0 <= n <= kv.length:
            raise ValueError(f"truncate to {n} tokens: the cache holds {kv.length}")
        return OnnxKV(kv.buffers, kv.values, n)

    def fork(self, kv: OnnxKV) -> OnnxKV:
        """An independent copy of `kv` (its own buffers, same capacity)."""
        new = self.new_cache(max(kv.capacity, 1))
        for dst, src in zip(new.buffers, kv.buffers):
            dst[:, :, :kv.length] = src[:, :, :kv.length]
        new.length = kv.length
        return new

    def kv_export(self, kv: OnnxKV) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (key, value) float32 numpy [1, kv_heads, length, head_dim] (keys after RoPE, as
        the torch model's cache holds them); copies, so later steps do not change them."""
        b, n = kv.buffers, kv.length
        return [(b[2 * i][:, :, :n].copy(), b[2 * i + 1][:, :, :n].copy()) for i in range(self.cfg.n_layers)]

    def kv_import(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], length: int) -> OnnxKV:
        """A cache from per-layer (key, value) arrays [1, kv_heads, length, head_dim] (any float
        dtype; converted to float32), as `kv_export` returns them. Copied into fresh buffers with
        room for MIN_CAPACITY more tokens.

        Raises:
            ValueError: the number of layers or an array's shape does not match the model, or
                `length` exceeds the context length.
        """
        c = self.cfg
        if len(layers) != c.n_layers:
            raise ValueError(f"KV of {len(layers)} layers; the model has {c.n_layers}")
        if not 0 <= length <= c.context_length:
            raise ValueError(f"KV of {length} tokens; the context length is {c.context_length}")
        want = (1, c.n_kv_heads, length, c.head_dim)
        kv = self.new_cache(length + MIN_CAPACITY)
        for i, (k, v) in enumerate(layers):
            for j, (name, a) in enumerate((("key", k), ("value", v))):
                if tuple(a.shape) != want:
                    raise ValueError(f"layer {i} {name}: shape {tuple(a.shape)}, expected {want}")
                kv.buffers[2 * i + j][:, :, :length] = a
        kv.length = length
        return kv

    # --- steps ---------------------------------------------------------------------------------------

    def prefill(self, ids: Sequence[int], kv: OnnxKV | None = None,
                positions: Sequence[int] | np.ndarray | None = None) -> tuple[np.ndarray, OnnxKV]:
        """Run `ids` (len S >= 1) after the `kv.length` cached tokens (a new cache when None).

        positions: int RoPE positions of the new tokens [S] (default kv.length + arange(S)); the
        cache slots stay kv.length.. whatever the positions (a refined prompt keeps its tokens'
        original positions). Returns (logits float32 [vocab] of the last token, kv with
        length + S).

        Raises:
            ValueError: no ids, `positions` of the wrong length or out of [0, context_length), or
                the cache would exceed the context length.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        s = ids.shape[0]
        if s == 0:
            raise ValueError("prefill of no tokens")
        kv = self._room(kv if kv is not None else self.new_cache(max(MIN_CAPACITY, s)), s)
        total = kv.length + s
        if positions is None:
            pos = np.arange(kv.length, total, dtype=np.int64)
        else:
            pos = np.asarray(positions, dtype=np.int64).reshape(-1)
            if pos.shape[0] != s:
                raise ValueError(f"{pos.shape[0]} positions for {s} tokens")
            if pos.size and (pos.min() < 0 or pos.max() >= self.context_length):
                raise ValueError(f"positions must lie in [0, {self.context_length})")
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", ids[None])
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(pos[None]))
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        binding.bind_output("logits", "cpu")
        for (past, present), value in zip(self._cache_names, kv.values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)  # the same buffer: written in place
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()[0]
        return logits, OnnxKV(kv.buffers, kv.values, total)

    def decode(self, token_id: int, kv: OnnxKV) -> tuple[np.ndarray, OnnxKV]:
        """`prefill([token_id], kv)`."""
        return self.prefill([token_id], kv)

    def warmup(self) -> None:
        """One short prefill and decode so the first request does not pay for allocations."""
        _, kv = self.prefill(list(range(16)))
        self.decode(0, kv)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        return generate(self, prompt_ids, params)
