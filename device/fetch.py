"""Fetch the device model from a cloud service's HTTP side and verify every file by sha256."""
from __future__ import annotations

import hashlib
import json
import os
import ssl as _ssl
import urllib.error
import urllib.request
from pathlib import Path

from relayinfer.protocol.errors import ErrorCode, ModelFileError, RemoteError
from relayinfer.protocol.security import context_for_url

DEVICE_FILES = ("model.fp32.onnx", "config.json", "tokenizer.json", "tokenizer_meta.json")


def download_device_model(http_url: str, dest: str | os.PathLike, timeout_s: float = 120.0,
                          files: tuple[str, ...] = DEVICE_FILES, token: str | None = None,
                          ca: str | os.PathLike | None = None, verify: bool = True,
                          ssl: _ssl.SSLContext | None = None) -> Path:
    """Download `files` listed in `{http_url}/v1/device-model/manifest` into `dest` and check each
    against its sha256; writes the manifest too, so `OnnxEngine(dest)` loads the result.

    Args:
        http_url: base URL of the service's HTTP side (`http://` or `https://`).
        timeout_s: socket timeout of each request (seconds).
        token: the service's bearer token (sent as `Authorization: Bearer`), None for none.
        ca: PEM CA file trusted for an `https://` service (a private CA); None = system CAs.
        verify: False turns certificate verification off (a warning is logged).
        ssl: a ready client `ssl.SSLContext` (overrides `ca`/`verify`).

    Raises:
        ModelFileError: a file is missing from the manifest or its sha256 does not match (the bad
            file is deleted).
        RemoteError: UNAUTHORIZED when the service refuses the token (HTTP 401/403).
        urllib.error.URLError: the service cannot be reached, or its certificate does not verify
            (the reason is an `ssl.SSLCertVerificationError`).
        urllib.error.HTTPError: any other HTTP error (e.g. 404: the service has no device model).
    """
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    ctx = ssl if ssl is not None else context_for_url(http_url, ca, verify)
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def get(path: str):
        req = urllib.request.Request(f"{http_url}{path}", headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout_s, context=ctx)
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                e.close()
                raise RemoteError(ErrorCode.UNAUTHORIZED, f"{http_url}{path} refused the "
                                  f"{'token' if token else 'request without a token'} (HTTP {e.code})") from None
            raise

    with get("/v1/device-model/manifest") as r:
        manifest = json.loads(r.read())
    for name in files:
        want = manifest["files"].get(name)
        if want is None:
            raise ModelFileError(f"the service's manifest lists no {name!r}")
        h, tmp = hashlib.sha256(), d / f".{name}.part"
        with get(f"/v1/device-model/{name}") as r, open(tmp, "wb") as f:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
        if h.hexdigest() != want:
            tmp.unlink()
            raise ModelFileError(f"sha256 mismatch for {name}: got {h.hexdigest()[:16]}..., manifest says {want[:16]}...")
        os.replace(tmp, d / name)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d
