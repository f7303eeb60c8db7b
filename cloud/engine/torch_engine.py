"""The cloud's single-request engine: prefill and decode over an explicit, pre-allocated KV cache."""
from __future__ import annotations

import functools
import os
from typing import Sequence

import numpy as np
import torch

from relayinfer.cloud.models.llama import (Llama, ObservationScores, StaticKV, load_llama, pack_linears,
                                           runs_on_blocks)
from relayinfer.protocol.model.decoding import GenerationOutput, SamplingParams, generate
from relayinfer.protocol.model.model_file import ModelConfig, fingerprint, open_gguf, read_config, resolve_model_path


def pick_device(device: str | None) -> str:
    """'cpu', 'cuda[:i]', 'npu' (when torch_npu is installed), or None / 'auto' for the best
    available ('cuda' when torch sees a CUDA device, else 'cpu').

    Raises:
        ValueError: the asked device is not one of those (a torch device type this engine does not
            run on, such as 'meta' or 'xla', or no device string at all), or is not available in
            this torch build (no CUDA device, a CUDA index past the last one, no torch_npu).
    """
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    choices = "choose auto, cpu, cuda, cuda:<index> or npu"
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ValueError("device 'npu' needs the torch_npu package") from None
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device; {choices}") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"device {device!r} is not supported; {choices}")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but this torch build sees no CUDA device")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) "
                         f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The weights' and KV cache's dtype: a name of `DTYPES` or a torch dtype; None / 'auto' is
    bfloat16 on an accelerator (cuda, npu: half the bytes per weight and KV token, tensor-core
    matmuls) and float32 on the CPU (the tested path: its tokens equal the device's fp32 model).

    Raises:
        ValueError: a name outside `DTYPES`, naming the choices.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of float32, bfloat16, float16")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device.startswith("cpu") else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


FLOAT16_OVERFLOWS = ("gemma3",)  # architectures whose residual stream exceeds float16's 65504


def check_dtype_fits(dtype: torch.dtype, cfg: ModelConfig | None = None,
                     model_path: str | os.PathLike | None = None) -> None:
    """Refuse float16 for an architecture of `FLOAT16_OVERFLOWS`: Gemma 3's residual stream
    reaches |x| ~ 1e5 (gemma3-270m, layer 7 of a chat prompt), float16 turns it into inf and
    every logit into NaN. bfloat16 (float32's range) runs it. The architecture is `cfg`'s, else
    read from `model_path`'s GGUF header, and only for float16 (a parse: 0.6 s for SmolLM2, 2.7 s
    for Gemma 3); neither given: nothing to check.

    Raises:
        ValueError: naming the dtype, the architecture and the dtypes that run it.
        ModelFileError: `model_path` is missing or corrupt (float16 only).
    """
    if dtype != torch.float16:
        return
    if cfg is None and model_path is not None:
        cfg = read_config(open_gguf(model_path))
    if cfg is not None and cfg.arch in FLOAT16_OVERFLOWS:
        raise ValueError(f"dtype float16 cannot run {cfg.arch}: its activations exceed float16's range "
                         f"(every logit NaN); choose bfloat16 or float32")


class TorchEngine:
    """Llama on PyTorch with an explicit KV cache (`StaticKV`).

    `prefill(ids, kv=None) -> (logits, kv)` and `decode(token, kv) -> (logits, kv)`: logits are
    float32 numpy [vocab] of the last position; `kv` is a `StaticKV` ([layers, 1, kv_heads, T,
    head_dim] K and V tensors) that the engine grows in place.

    `device`: 'cpu' (default), 'cuda', 'npu' or None / 'auto' (`pick_device`). `dtype`: the
    weights' and KV cache's dtype, None / 'auto' = bfloat16 on an accelerator and float32 on the
    CPU (`pick_dtype`); logits are float32 whatever it is. A `model` passed in keeps its own
    device and dtype.

    `pack_weights` (default): on the CPU in float32 the linear layers run on oneDNN pre-packed
    weights (`llama.PackedLinear`: faster at 4-16 rows); False keeps `nn.Linear` (a model passed
    in is packed in place).

    `weights` (`llama.WEIGHTS`): 'fp32' (default: every tensor dequantized, the reference the
    device's fp32 model equals) or 'gguf' (CPU, float32: the file's 4-bit block layers run on
    their blocks through torch's int4 kernel, `llama.BlockLinear`; 5.3x fewer bytes per weight,
    bfloat16 activations into those matmuls; bench/results/fidelity-cloud.md). It applies when the
    engine loads the model; a model passed in keeps its own.

    Raises:
        ValueError: the device is not available, the dtype is unknown, or float16 for a model
            whose activations overflow it (`check_dtype_fits`), a weight format the device or
            dtype cannot run (`llama.check_weights_fit`), or `weights` with a model passed in.
        ModelFileError / UnsupportedModelError: from `load_llama`.
    """

    def __init__(self, model_path: str | os.PathLike | None = None, device: str | None = "cpu",
                 threads: int | None = None, model: Llama | None = None, pack_weights: bool = True,
                 dtype: str | torch.dtype | None = None, weights: str = "fp32"):
        if threads:
            torch.set_num_threads(threads)
        self.model_path = resolve_model_path(model_path)
        if model is not None:
            p = next(model.parameters())
            self.device, self.dtype = str(p.device), p.dtype
        else:
            self.device = pick_device(device)
            self.dtype = pick_dtype(dtype, self.device)
        if model is not None and weights != "fp32":
            raise ValueError(f"weights {weights!r} applies when the engine loads the model; a model passed in "
                             f"keeps its own (load it with load_llama(weights=...))")
        check_dtype_fits(self.dtype, model.cfg if model is not None else None, self.model_path)  # before the load
        self.model = model if model is not None else load_llama(self.model_path, device=self.device, dtype=self.dtype,
                                                                weights=weights)
        self.weights = "gguf" if runs_on_blocks(self.model) else "fp32"
        if pack_weights:
            pack_linears(self.model)
        self.model.model_path = self.model_path  # an engine built on the bare model finds its tokenizer
        self.cfg: ModelConfig = self.model.cfg
        self.context_length = self.cfg.context_length
        self.eos_id = self.cfg.eos_id

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.model_path)

    @property
    def tokenizer(self):
        """The model file's `Tokenizer` (`tokenizer_of`): structured output needs it."""
        return tokenizer_of(self.model_path)


    def new_cache(self, capacity: int = 256) -> StaticKV:
        return StaticKV(self.cfg, capacity=capacity, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], kv: StaticKV, last_only: bool = True,
                obs: ObservationScores | None = None) -> torch.Tensor:
        """Run `ids` after the tokens cached in `kv`; logits float32 [V] (or [S, V])."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        kv.reserve(x.shape[1])
        logits = self.model(x, kv, kv.length, last_only=last_only, obs=obs)
        kv.commit()
        return logits[0].float()

    def prefill(self, ids: Sequence[int], kv: StaticKV | None = None) -> tuple[np.ndarray, StaticKV]:
        kv = kv if kv is not None else self.new_cache(max(256, len(ids) + 64))
        return self.forward(ids, kv).cpu().numpy(), kv

    def prefill_scored(self, ids: Sequence[int], window: int = 16) -> tuple[np.ndarray, StaticKV, np.ndarray]:
        """Prefill `ids` into a new cache and also return the importance score of every prompt
        position (float32 [len(ids)], see `ObservationScores`), for prompt refinement."""
        obs = ObservationScores(window)
        kv = self.new_cache(max(256, len(ids) + 64))
        logits = self.forward(ids, kv, obs=obs)
        return logits.cpu().numpy(), kv, obs.scores[0].float().cpu().numpy()

    def decode(self, token_id: int, kv: StaticKV) -> tuple[np.ndarray, StaticKV]:
        return self.forward([token_id], kv).cpu().numpy(), kv

    def warmup(self) -> None:
        """One short prefill and decode so the first request does not pay for allocations."""
        _, kv = self.prefill(list(range(16)))
        self.decode(0, kv)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        return generate(self, prompt_ids, params)


@functools.lru_cache(maxsize=8)
def tokenizer_of(model_path) -> "Tokenizer":
    """The `Tokenizer` of a model file, loaded once per process (from the tokenizer cache after the
    first build)."""
    from relayinfer.protocol.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)
