"""The device runtime: the exported Llama on ONNX Runtime with explicit KV inputs/outputs. No torch.

The KV cache stays inside ONNX Runtime between steps: outputs are bound with IO binding and the
`present_*` OrtValues of one step are bound as the `past_*` inputs of the next, so no cache tensor is
copied into numpy (at 2k tokens the cache is 94 MB in fp32).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from relayinfer.protocol.decoding import GenerationOutput, SamplingParams, generate
from relayinfer.protocol.errors import ModelFileError
from relayinfer.protocol.model_file import ModelConfig, model_cache_dir, resolve_model_path
from relayinfer.protocol.tokenizer import Tokenizer


def device_model_dir(model_path: str | os.PathLike | None = None) -> Path:
    """Where `relayinfer export` put the device files of `model_path` (default model when None)."""
    return model_cache_dir(resolve_model_path(model_path))


@dataclass
class OnnxKV:
    """The device KV cache: per layer (key, value) OrtValues [1, kv_heads, length, head_dim] fp32."""

    values: list
    length: int


class OnnxEngine:
    """Llama on ONNX Runtime (CPU execution provider by default).

    `prefill(ids, kv=None) -> (logits, kv)` runs `ids` after the cached tokens; `decode(token, kv)`
    is prefill of one token. logits: float32 numpy [vocab] of the last position.

    Args:
        model_dir: directory with model.<fp32|int8>.onnx, config.json and tokenizer files (made by
            `relayinfer export`).
        quantize: None (fp32) or 'int8'.
        threads: intra-op threads (the device default is 1).
        providers: ONNX Runtime execution providers.

    Raises:
        ModelFileError: the directory lacks the exported files.
    """

    def __init__(self, model_dir: str | os.PathLike, quantize: str | None = None, threads: int = 1,
                 providers: Sequence[str] = ("CPUExecutionProvider",)):
        import onnxruntime as ort

        d = Path(model_dir)
        onnx_file = d / f"model.{quantize or 'fp32'}.onnx"
        if not onnx_file.is_file() or not (d / "config.json").is_file():
            hint = " --quantize int8" if quantize else ""
            raise ModelFileError(f"no exported device model at {onnx_file}; run `relayinfer export{hint}`")
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
        self._empty = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((1, self.cfg.n_kv_heads, 0, self.cfg.head_dim), np.float32))

    @classmethod
    def for_model(cls, model_path: str | os.PathLike | None = None, **kw) -> "OnnxEngine":
        """The engine for an exported GGUF model (default model when None)."""
        return cls(device_model_dir(model_path), **kw)

    @property
    def fingerprint(self) -> str:
        return self.manifest.get("model_fingerprint", "")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.model_dir)

    def new_cache(self) -> OnnxKV:
        return OnnxKV([self._empty] * (2 * self.cfg.n_layers), 0)

    def prefill(self, ids: Sequence[int], kv: OnnxKV | None = None) -> tuple[np.ndarray, OnnxKV]:
        kv = kv if kv is not None else self.new_cache()
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([list(ids)], dtype=np.int64))
        for name, value in zip(self._in[1:], kv.values):
            binding.bind_ortvalue_input(name, value)
        for name in self._out:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        return outs[0].numpy()[0], OnnxKV(list(outs[1:]), kv.length + len(ids))

    def decode(self, token_id: int, kv: OnnxKV) -> tuple[np.ndarray, OnnxKV]:
        return self.prefill([token_id], kv)

    def warmup(self) -> None:
        """One short prefill and decode so the first request does not pay for allocations."""
        _, kv = self.prefill(list(range(16)))
        self.decode(0, kv)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        return generate(self, prompt_ids, params)

    # --- KV cache hand-over (multi-turn reuse, KV hand-off from the cloud) ---------------------------

    def truncate(self, kv: OnnxKV, n: int) -> OnnxKV:
        """The cache of the first `n` tokens of `kv` (0 <= n <= kv.length; copies the kept part).

        Raises:
            ValueError: `n` outside [0, kv.length].
        """
        if not 0 <= n <= kv.length:
            raise ValueError(f"truncate to {n} tokens: the cache holds {kv.length}")
        if n == kv.length:
            return kv
        return self.kv_import([(k[:, :, :n], v[:, :, :n]) for k, v in self.kv_export(kv)], n)

    def kv_export(self, kv: OnnxKV) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (key, value) float32 numpy [1, kv_heads, length, head_dim] (keys after RoPE)."""
        vals = [v.numpy() for v in kv.values]
        return [(vals[2 * i][:, :, :kv.length], vals[2 * i + 1][:, :, :kv.length]) for i in range(self.cfg.n_layers)]

    def kv_import(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], length: int) -> OnnxKV:
        """A cache from per-layer (key, value) arrays [1, kv_heads, length, head_dim] (any float
        dtype; converted to float32), as `kv_export` returns them.

        Raises:
            ValueError: the number of layers or an array's shape does not match the model.
        """
        c = self.cfg
        if len(layers) != c.n_layers:
            raise ValueError(f"KV of {len(layers)} layers; the model has {c.n_layers}")
        want, out = (1, c.n_kv_heads, length, c.head_dim), []
        for i, (k, v) in enumerate(layers):
            for name, a in (("key", k), ("value", v)):
                if tuple(a.shape) != want:
                    raise ValueError(f"layer {i} {name}: shape {tuple(a.shape)}, expected {want}")
                ov = self._ort.OrtValue.ortvalue_from_shape_and_type(want, np.float32, "cpu", 0)
                ov.update_inplace(np.ascontiguousarray(a, dtype=np.float32))  # copied: ORT owns the memory
                out.append(ov)
        return OnnxKV(out, length)
