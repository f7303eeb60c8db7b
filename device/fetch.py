"""Fetch the device model from a cloud service's HTTP side and verify every file by sha256."""
from __future__ import annotations

import hashlib
import json
import os
import ssl as _ssl
import urllib.error
import urllib.request
from pathlib import Path

from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.model.errors import ModelFileError
from relayinfer.protocol.model.model_file import cache_dir, file_sha256
from relayinfer.protocol.transport.security import context_for_url
from relayinfer.device.onnx_engine import FORMAT_VERSION, onnx_file_name

DEVICE_FILES = (onnx_file_name(), "config.json", "tokenizer.json", "tokenizer_meta.json")


def download_device_model(http_url: str, dest: str | os.PathLike, timeout_s: float = 120.0,
                          files: tuple[str, ...] = DEVICE_FILES, token: str | None = None,
                          ca: str | os.PathLike | None = None, verify: bool = True,
                          ssl: _ssl.SSLContext | None = None, progress=None,
                          manifest: dict | None = None) -> Path:
    """Download `files` listed in `{http_url}/v1/device-model/manifest` into `dest` and check each
    against its sha256; writes the manifest too, so `OnnxEngine(dest)` loads the result.

    An interrupted download resumes: the bytes already in `dest/.NAME.part` are kept and the rest
    is asked for with an HTTP `Range` request (the service's file responses answer 206); a server
    that ignores the range (200) sends the whole file again. A file already in `dest` with the
    manifest's sha256 is not downloaded again.

    Args:
        http_url: base URL of the service's HTTP side (`http://` or `https://`).
        timeout_s: socket timeout of each request (seconds).
        token: the service's bearer token (sent as `Authorization: Bearer`), None for none.
        ca: PEM CA file trusted for an `https://` service (a private CA); None = system CAs.
        verify: False turns certificate verification off (a warning is logged).
        ssl: a ready client `ssl.SSLContext` (overrides `ca`/`verify`).
        progress: called as `progress(name, done_bytes, total_bytes)` after each chunk (bytes;
            `done_bytes` starts at the resumed size), None for none.
        manifest: the manifest when the caller already fetched it (`fetch_manifest`).

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

    def get(path: str, extra: dict | None = None):
        return _get(http_url, path, {**headers, **(extra or {})}, timeout_s, ctx, token)

    if manifest is None:
        with get("/v1/device-model/manifest") as r:
            manifest = json.loads(r.read())
    for name in files:
        want = manifest["files"].get(name)
        if want is None:
            raise ModelFileError(f"the service's manifest lists no {name!r}")
        if (d / name).is_file() and file_sha256(d / name) == want:
            continue
        _download_file(get, d, name, want, progress)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _download_file(get, d: Path, name: str, want: str, progress) -> None:
    """Download `name` into `d` through `get(path, extra_headers)`, resuming from `d/.NAME.part`
    (see `download_device_model`), and move it in place once its sha256 is `want`.

    Raises:
        ModelFileError: the sha256 does not match (the part file is deleted).
    """
    h, tmp = hashlib.sha256(), d / f".{name}.part"
    have = tmp.stat().st_size if tmp.is_file() else 0
    try:
        r = get(f"/v1/device-model/{name}", {"Range": f"bytes={have}-"} if have else None)
    except urllib.error.HTTPError as e:
        if e.code != 416:  # 416: the part is as long as the file or longer: start over
            raise
        e.close()
        have = 0
        r = get(f"/v1/device-model/{name}")
    with r:
        if have and r.status != 206:  # the server sent the whole file: start over
            have = 0
        total = have + int(r.headers.get("Content-Length") or 0)
        if have:
            with open(tmp, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        with open(tmp, "ab" if have else "wb") as f:
            done = have
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(name, done, total)
    if h.hexdigest() != want:
        tmp.unlink()
        raise ModelFileError(f"sha256 mismatch for {name}: got {h.hexdigest()[:16]}..., manifest says {want[:16]}...")
    os.replace(tmp, d / name)


def _get(http_url: str, path: str, headers: dict, timeout_s: float, ctx, token: str | None):
    """GET `http_url + path`; 401/403 become `RemoteError(UNAUTHORIZED)`."""
    req = urllib.request.Request(f"{http_url}{path}", headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=timeout_s, context=ctx)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            e.close()
            raise RemoteError(ErrorCode.UNAUTHORIZED, f"{http_url}{path} refused the "
                              f"{'token' if token else 'request without a token'} (HTTP {e.code})") from None
        raise


def fetch_manifest(http_url: str, token: str | None = None, timeout_s: float = 30.0,
                   ssl: _ssl.SSLContext | None = None) -> dict:
    """The service's device-model manifest: {"files": {name: sha256}, "model_fingerprint": hex, ...}.

    Raises:
        ModelFileError: the manifest names no `model_fingerprint` or no `files`.
        RemoteError: UNAUTHORIZED (HTTP 401/403).
        urllib.error.URLError / HTTPError: unreachable, or the service has no device model (404).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ctx = ssl if ssl is not None else context_for_url(http_url, None, True)
    with _get(http_url, "/v1/device-model/manifest", headers, timeout_s, ctx, token) as r:
        m = json.loads(r.read())
    if not isinstance(m, dict) or not m.get("model_fingerprint") or not isinstance(m.get("files"), dict):
        raise ModelFileError(f"{http_url}/v1/device-model/manifest names no model_fingerprint or files")
    return m


def cached_device_model(http_url: str, token: str | None = None, ssl: _ssl.SSLContext | None = None,
                        timeout_s: float = 120.0, progress=None) -> Path:
    """The cloud's device model in the local cache, downloaded (or resumed) when missing:
    `cache_dir()/models/<first 16 hex of the fingerprint>/onnx-v<FORMAT_VERSION>`, the directory
    `relayinfer export` uses for the same model file, so a device that also has the GGUF shares it.

    Raises: as `fetch_manifest` and `download_device_model`; ModelFileError also when the cloud
    serves another device-model format version than this device runs.
    """
    m = fetch_manifest(http_url, token, min(timeout_s, 30.0), ssl)
    fp = m["model_fingerprint"]
    if not all(c in "0123456789abcdef" for c in fp) or len(fp) < 16:
        raise ModelFileError(f"bad model_fingerprint {fp[:40]!r} in {http_url}/v1/device-model/manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise ModelFileError(f"the service at {http_url} serves device-model format {m.get('format_version', 1)}; "
                             f"this device runs format {FORMAT_VERSION} (upgrade the older side)")
    d = cache_dir() / "models" / fp[:16] / f"onnx-v{FORMAT_VERSION}"
    have = d / "manifest.json"
    if have.is_file() and json.loads(have.read_text()) == m and all((d / n).is_file() for n in DEVICE_FILES):
        return d
    return download_device_model(http_url, d, timeout_s, token=token, ssl=ssl, progress=progress, manifest=m)
