"""Engine factory for the SDK and CLI: pick the torch (cloud) or ONNX (device) runtime by name."""
from __future__ import annotations

import os

from relayinfer.protocol.model.errors import UnknownEngineError

ENGINES = ("torch", "onnx")


def load_engine(name: str, model: str | os.PathLike | None = None, quantize: str | None = None,
                threads: int | None = None, device: str | None = "cpu", export: bool = True):
    """A `TorchEngine` ('torch') or `OnnxEngine` ('onnx') for the GGUF `model` (default when None).

    For 'onnx' the device model is exported first when missing and `export` is True (needs the
    `[cloud]` extra); on a torch-free install run `relayinfer export` elsewhere. `threads` defaults
    to 1 for ONNX (the device default) and to torch's default for torch.

    Raises:
        UnknownEngineError: `name` is not 'torch' or 'onnx'.
        ValueError: `quantize` is set for the torch engine.
    """
    if name == "torch":
        if quantize:
            raise ValueError("--quantize applies to the onnx engine only")
        from relayinfer.cloud.engine.torch_engine import TorchEngine

        return TorchEngine(model, device=device, threads=threads)
    if name == "onnx":
        from relayinfer.device.onnx_engine import OnnxEngine, device_model_dir

        d = device_model_dir(model)
        if export:
            try:
                from relayinfer.cloud.export import ensure_device_model
            except ImportError:  # torch-free install: use what is already exported
                pass
            else:
                d = ensure_device_model(model, quantize)
        return OnnxEngine(d, quantize=quantize, threads=threads or 1)
    raise UnknownEngineError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
