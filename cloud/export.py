"""ONNX export of the Llama module for the device runtime (a build step on the torch side).

The graph takes `input_ids` [batch, seq] int64 and, per layer i, `past_key.i` / `past_value.i`
[batch, kv_heads, past, head_dim] float32, and returns `logits` [batch, vocab] float32 of the last
position plus `present_key.i` / `present_value.i` [batch, kv_heads, past + seq, head_dim]. batch, seq
and past are dynamic (exported with example sizes 2, 3, 4 so no axis is specialised to 0 or 1);
past = 0 is a valid empty cache.

Artefacts live in `model_cache_dir(model)` (keyed by the GGUF's sha256): `model.fp32.onnx`,
optionally `model.int8.onnx` (`onnxruntime.quantization.quantize_dynamic`, per-channel int8 MatMul
weights), `config.json`, `tokenizer.json`, `tokenizer_meta.json`, and `manifest.json` with each
file's sha256 so a device can verify what it downloaded.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from relayinfer.cloud.models.llama import ConcatKV, Llama, load_llama
from relayinfer.protocol.model_file import file_sha256, fingerprint, model_cache_dir, resolve_model_path
from relayinfer.protocol.tokenizer import Tokenizer

QUANTIZATIONS = (None, "int8")
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_meta.json")  # what a device needs besides the ONNX file
EXPORT_SECONDS = 65.0  # fp32 export of SmolLM2-135M measured on this project's 2-core machine (progress estimate)


def device_model_ready(model_path: str | os.PathLike | None = None, quantize: str | None = None) -> bool:
    """True when `ensure_device_model(model_path, quantize)` would return at once (the files are
    in the cache), so a caller can show export progress only when an export will happen."""
    d = model_cache_dir(resolve_model_path(model_path))
    manifest_path, target = d / "manifest.json", d / f"model.{quantize or 'fp32'}.onnx"
    if not (target.is_file() and manifest_path.is_file()):
        return False
    try:
        return target.name in json.loads(manifest_path.read_text()).get("files", {})
    except (ValueError, OSError):
        return False


class _ExportWrapper(nn.Module):
    """Flat tensors in/out around `Llama` with a `ConcatKV` cache, for torch.onnx.export."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids, *past):
        n = self.model.cfg.n_layers
        kv = ConcatKV([(past[2 * i], past[2 * i + 1]) for i in range(n)])
        logits = self.model(input_ids, kv, past[0].shape[2])
        return (logits, *[t for pair in kv.present for t in pair])


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the exported graph."""
    past = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    present = [f"present_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    return ["input_ids", *past], ["logits", *present]


def export_onnx(model: Llama, out: Path) -> None:
    """Export `model` (fp32, CPU) to the ONNX file `out` (single file, opset of the exporter)."""
    cfg = model.cfg
    b, s, p = 2, 3, 4
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    past = tuple(torch.zeros(b, cfg.n_kv_heads, p, cfg.head_dim) for _ in range(2 * cfg.n_layers))
    batch, seq, past_len = (torch.export.Dim("batch", max=256), torch.export.Dim("seq", max=cfg.context_length),
                            torch.export.Dim("past", max=cfg.context_length))
    shapes = ({0: batch, 1: seq}, tuple({0: batch, 2: past_len} for _ in past))
    inputs, outputs = io_names(cfg.n_layers)
    with warnings.catch_warnings(), _quiet("torch.onnx", "torch._export", "torch.export"):
        warnings.simplefilter("ignore")  # exporter chatter (torchvision ops, axis names, LeafSpec)
        _export(model, ids, past, out, inputs, outputs, shapes)


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _export(model, ids, past, out, inputs, outputs, shapes) -> None:
    torch.onnx.export(_ExportWrapper(model).eval(), (ids, *past), str(out), dynamo=True,
                      input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                      optimize=True, external_data=False, verbose=False)


def ensure_device_model(model_path: str | os.PathLike | None = None, quantize: str | None = None,
                        progress: Callable[[str], None] | None = None) -> Path:
    """Export (once) and return the directory holding the device model files for `model_path`.

    Export takes about `EXPORT_SECONDS` (65 s) on 2 CPU cores, int8 quantization a little more;
    both are skipped when the files are already in the cache (`device_model_ready`). `progress`
    receives one line per step.

    Raises:
        ValueError: `quantize` is not None or 'int8'.
        ModelFileError / UnsupportedModelError: bad model file.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose one of {QUANTIZATIONS}")
    say = progress or (lambda msg: None)
    path = resolve_model_path(model_path)
    d = model_cache_dir(path)
    with _export_lock(d):  # one exporter at a time (parallel test workers, two commands at once)
        return _ensure_locked(path, d, quantize, say)


@contextlib.contextmanager
def _export_lock(d: Path):
    """An exclusive inter-process lock on the cache directory `d` (fcntl; a no-op where absent)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover  (not POSIX)
        yield
        return
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".export.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_locked(path: Path, d: Path, quantize: str | None, say: Callable[[str], None]) -> Path:
    """`ensure_device_model` under the cache lock: check the manifest, export what is missing."""
    manifest_path = d / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"files": {}}
    fp32, target = d / "model.fp32.onnx", d / f"model.{quantize or 'fp32'}.onnx"
    if target.is_file() and target.name in manifest["files"]:
        return d
    t0 = time.perf_counter()
    if not (fp32.is_file() and fp32.name in manifest["files"]):
        say(f"loading {path.name}")
        model = load_llama(path)
        (d / "config.json").write_text(model.cfg.to_json())
        Tokenizer.from_gguf(path).save(d)
        for name in SIDE_FILES:
            manifest["files"][name] = file_sha256(d / name)
        say(f"exporting to ONNX (about {EXPORT_SECONDS:.0f} s on 2 cores)")
        tmp = d / f".{fp32.name}.{os.getpid()}"
        with torch.no_grad():
            export_onnx(model, tmp)
        os.replace(tmp, fp32)
        manifest["files"][fp32.name] = file_sha256(fp32)
    if quantize == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        say("quantizing weights to int8")
        tmp = d / f".{target.name}.{os.getpid()}"
        quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"])
        os.replace(tmp, target)
        manifest["files"][target.name] = file_sha256(target)
    manifest.update(model_fingerprint=fingerprint(path), model_file=path.name)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    say(f"device model ready in {time.perf_counter() - t0:.0f} s: {d}")
    return d
