"""Fetch the device model from a cloud service's HTTP side and verify every file by sha256."""
from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path

from relayinfer.protocol.errors import ModelFileError

DEVICE_FILES = ("model.fp32.onnx", "config.json", "tokenizer.json", "tokenizer_meta.json")


def download_device_model(http_url: str, dest: str | os.PathLike, timeout_s: float = 120.0,
                          files: tuple[str, ...] = DEVICE_FILES) -> Path:
    """Download `files` listed in `{http_url}/v1/device-model/manifest` into `dest` and check each
    against its sha256; writes the manifest too, so `OnnxEngine(dest)` loads the result.

    Raises:
        ModelFileError: a file is missing from the manifest or its sha256 does not match (the bad
            file is deleted). urllib.error.URLError: the service cannot be reached.
    """
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(f"{http_url}/v1/device-model/manifest", timeout=timeout_s) as r:
        manifest = json.loads(r.read())
    for name in files:
        want = manifest["files"].get(name)
        if want is None:
            raise ModelFileError(f"the service's manifest lists no {name!r}")
        h, tmp = hashlib.sha256(), d / f".{name}.part"
        with urllib.request.urlopen(f"{http_url}/v1/device-model/{name}", timeout=timeout_s) as r, open(tmp, "wb") as f:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
        if h.hexdigest() != want:
            tmp.unlink()
            raise ModelFileError(f"sha256 mismatch for {name}: got {h.hexdigest()[:16]}..., manifest says {want[:16]}...")
        os.replace(tmp, d / name)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d
