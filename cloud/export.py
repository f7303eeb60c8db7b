"""Export of the device model: the ONNX graph of `cloud/onnx_graph.py`, written straight from the
GGUF file (no torch, a few seconds), plus the config and tokenizer files a device needs.

Artefacts live in `device_model_dir(model)` = `model_cache_dir(model)/onnx-v<FORMAT_VERSION>` (keyed
by the GGUF's sha256 and the graph format): `model.gguf.onnx` (the default: MatMulNBits over the
GGUF's own blocks) and/or `model.fp32.onnx` (dequantized weights), `config.json`, `tokenizer.json`,
`tokenizer_meta.json`, and `manifest.json` with each file's sha256 (so a device can verify what it
downloaded), the model fingerprint and `format_version`.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from relayinfer.cloud.onnx_graph import io_names, write_model  # noqa: F401  (io_names: public API)
from relayinfer.protocol.model.device_model import (DEFAULT_WEIGHTS, FORMAT_VERSION, WEIGHTS, WEIGHTS_REVISION,
    device_model_dir, onnx_file_name)
from relayinfer.protocol.model.model_file import file_sha256, fingerprint, read_config, open_gguf, resolve_model_path
from relayinfer.protocol.model.tokenizer import Tokenizer
from relayinfer.protocol.model.errors import ModelFileError

QUANTIZATIONS = (None, *WEIGHTS)  # None = DEFAULT_WEIGHTS ('gguf')
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_meta.json")  # what a device needs besides the ONNX file
EXPORT_SECONDS = 15.0  # export of SmolLM2-135M on this project's 2-core machine (progress estimate)
_EXPORT_REF_BYTES = 98_362_432  # its GGUF's size: other files are estimated in proportion


def export_seconds(model_path: str | os.PathLike | None = None) -> float:
    """The progress estimate of one export (s): `EXPORT_SECONDS` scaled by the GGUF file's size
    against SmolLM2-135M's (98 MB), never less than `EXPORT_SECONDS`."""
    try:
        size = os.path.getsize(resolve_model_path(model_path))
    except (OSError, ValueError, ModelFileError):
        return EXPORT_SECONDS
    return EXPORT_SECONDS * max(1.0, size / _EXPORT_REF_BYTES)


def device_model_ready(model_path: str | os.PathLike | None = None, quantize: str | None = None) -> bool:
    """True when `ensure_device_model(model_path, quantize)` would return at once (the files are
    in the cache), so a caller can show export progress only when an export will happen.

    Raises:
        ValueError: unknown `quantize` (see `onnx_file_name`).
    """
    name = onnx_file_name(quantize)
    d = device_model_dir(model_path)
    manifest_path, target = d / "manifest.json", d / name
    if not (target.is_file() and manifest_path.is_file()):
        return False
    try:
        m = json.loads(manifest_path.read_text())
    except (ValueError, OSError):
        return False
    return m.get("format_version") == FORMAT_VERSION and _current(m, name)


def _current(manifest: dict, name: str) -> bool:
    """True when the manifest lists the ONNX file `name` at its variant's `WEIGHTS_REVISION`."""
    return name in manifest.get("files", {}) and manifest.get("revisions", {}).get(name, 1) == _revision(name)


def _revision(name: str) -> int:
    """The `WEIGHTS_REVISION` of the variant whose ONNX file is `name` (model.<weights>.onnx)."""
    return WEIGHTS_REVISION[name.split(".")[1]]


def ensure_device_model(model_path: str | os.PathLike | None = None, quantize: str | None = None,
                        progress: Callable[[str], None] | None = None) -> Path:
    """Export (once) and return the directory holding the device model files for `model_path`.

    quantize: device weights, 'gguf' (MatMulNBits over the GGUF's own Q4_1/Q8_0 blocks), 'gguf-q8'
    (the same blocks, the MLP and 8-bit ones on int8 activations), 'fp32' (dequantized), or None for
    the default ('gguf'). A file exported at an older `WEIGHTS_REVISION` of its variant is exported again. Export takes about `EXPORT_SECONDS` on 2 CPU
    cores and is skipped when the file is already in the cache (`device_model_ready`). `progress`
    receives one line per step.

    Raises:
        ValueError: unknown `quantize`; 'int8' (the former quantize_dynamic export) is refused.
        ModelFileError / UnsupportedModelError: bad model file.
    """
    name = onnx_file_name(quantize)
    say = progress or (lambda msg: None)
    path = resolve_model_path(model_path)
    d = device_model_dir(path)
    with _export_lock(d):  # one exporter at a time (parallel test workers, two commands at once)
        return _ensure_locked(path, d, name, say)


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


def _ensure_locked(path: Path, d: Path, name: str, say: Callable[[str], None]) -> Path:
    """`ensure_device_model` under the cache lock: check the manifest, export what is missing."""
    manifest_path = d / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest.get("format_version") != FORMAT_VERSION:
        manifest = {"files": {}}
    target = d / name
    if target.is_file() and _current(manifest, name):
        return d
    t0 = time.perf_counter()
    if not all((d / f).is_file() and f in manifest["files"] for f in SIDE_FILES):
        say(f"reading {path.name}")
        (d / "config.json").write_text(read_config(open_gguf(path)).to_json())
        Tokenizer.from_gguf(path).save(d)
        for f in SIDE_FILES:
            manifest["files"][f] = file_sha256(d / f)
    say(f"writing the ONNX graph ({name}, about {export_seconds(path):.0f} s on 2 cores)")
    tmp = d / f".{name}.{os.getpid()}"
    try:
        write_model(path, tmp, name.split(".")[1])
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    manifest["files"][name] = file_sha256(target)
    manifest.setdefault("revisions", {})[name] = _revision(name)
    manifest.update(model_fingerprint=fingerprint(path), model_file=path.name, format_version=FORMAT_VERSION,
                    default_onnx=onnx_file_name(DEFAULT_WEIGHTS))
    manifest_path.write_text(json.dumps(manifest, indent=1))
    say(f"device model ready in {time.perf_counter() - t0:.0f} s: {d}")
    return d
