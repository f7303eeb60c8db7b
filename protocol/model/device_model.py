"""The device model's files, shared by the side that writes them (`cloud.export`) and the side that
loads them (`device.onnx_engine`, `device.fetch`): the graph format version, the weight formats and
their file names, and the cache directory of one GGUF model's export. Torch-free, ONNX-free."""
from __future__ import annotations

import os
from pathlib import Path

from relayinfer.protocol.model.model_file import model_cache_dir, resolve_model_path

FORMAT_VERSION = 4  # of the exported graph; part of the cache directory (v1: torch-traced, concat KV; v2: RoPE tables 1 ulp from the torch model; v4: the model description of every architecture in config.json
WEIGHTS = ("gguf", "gguf-q8", "fp32")
"""Device weight formats: 'gguf' the GGUF's own blocks with float32 activations (greedy tokens equal
the fp32 model's); 'gguf-q8' the same blocks with the 8-bit ones, the 4-bit MLP ones and the tied
Q8_0 output head run on int8-quantized activations, as llama.cpp runs them on Q8_1 (MatMulNBits
accuracy level 4: about 2x faster decode, not fp32-equal, as close to fp32 as llama.cpp by
bench/fidelity.py); 'fp32' dequantized."""
DEFAULT_WEIGHTS = "gguf"
WEIGHTS_REVISION = {"gguf": 2, "gguf-q8": 2, "fp32": 1}
"""Revision of each variant's export, kept per file in manifest.json (absent = 1): a change of what a
variant computes (gguf-q8 2: the 4-bit MLP blocks on int8 activations too; gguf 2: the tied Q8_0
head as two exact 4-bit MatMulNBits instead of a dequantized fp32 Gemm) re-exports that file only;
the graph's inputs and outputs, which a device checks, are `FORMAT_VERSION`."""


def check_weights(weights: str | None, what: str = "quantize") -> None:
    """Raise ValueError naming `what` (the parameter or flag) when `weights` is neither None nor
    one of `WEIGHTS` (an empty string included)."""
    if weights is not None:
        try:
            onnx_file_name(weights)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None


def onnx_file_name(weights: str | None = None) -> str:
    """The ONNX file name of `weights` (one of `WEIGHTS`; None = `DEFAULT_WEIGHTS`).

    Raises:
        ValueError: unknown weights; 'int8' (the former `quantize_dynamic` export) is refused with
            a pointer to 'gguf'.
    """
    w = DEFAULT_WEIGHTS if weights is None else weights
    if w == "int8":
        raise ValueError("the int8 (quantize_dynamic) device model was replaced by 'gguf' (the GGUF "
                         "file's own 4/8-bit blocks, same greedy tokens as fp32); use --quantize gguf")
    if w not in WEIGHTS:
        raise ValueError(f"unknown device weights {w!r}; choose one of {WEIGHTS}")
    return f"model.{w}.onnx"


def device_model_dir(model_path: str | os.PathLike | None = None) -> Path:
    """Where `relayinfer export` puts the device files of `model_path` (default model when None):
    `model_cache_dir(model)/onnx-v<FORMAT_VERSION>`, so exports of an older graph format are never
    loaded."""
    d = model_cache_dir(resolve_model_path(model_path)) / f"onnx-v{FORMAT_VERSION}"
    d.mkdir(parents=True, exist_ok=True)
    return d
