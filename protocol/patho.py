"""What the device and the cloud of pathology screening must agree on (torch-free).

The handshake's model fingerprint (``Hello.model_fingerprint``) for the slide service is
:func:`patho_fingerprint`: the sha256 of the tile geometry (``tile_px`` pixels at ``mpp`` µm/px),
since an encoder's embeddings only mean something for tiles at the magnification it was trained on;
a device tiling at another magnification is refused with FINGERPRINT_MISMATCH. Tiles travel as raw
uint8 pixels or as JPEG files (:func:`jpeg_encode` / :func:`jpeg_decode`, Pillow).
"""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np

__all__ = ["TILE_PX", "TILE_MPP", "patho_fingerprint", "jpeg_encode", "jpeg_decode"]

TILE_PX = 224
"""Tile side in pixels seen by the cloud encoder (ViT-L/16 at 224 px)."""
TILE_MPP = 0.5
"""Microns per pixel of the fine-screen tiles (20x; UNI and most pathology encoders use 0.5 µm/px)."""


def patho_fingerprint(tile_px: int = TILE_PX, mpp: float = TILE_MPP) -> str:
    """sha256 hex of the tile geometry, the fingerprint both ends present at the handshake."""
    spec = json.dumps({"task": "patho-screen", "tile_px": int(tile_px), "mpp": round(float(mpp), 4)}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()


def jpeg_encode(tile: np.ndarray, quality: int = 90) -> bytes:
    """JPEG bytes of a uint8 RGB tile (H, W, 3) at ``quality`` (1..95)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(tile, dtype=np.uint8), "RGB").save(buf, "JPEG", quality=int(quality))
    return buf.getvalue()


def jpeg_decode(data: bytes, size: int | None = None) -> np.ndarray:
    """uint8 RGB (H, W, 3) of JPEG bytes. Raises ValueError if the bytes are not an image, or not
    ``size`` x ``size`` pixels when ``size`` is given."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG":
                raise ValueError(f"tile is {im.format}, not JPEG")
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"tile is not a readable JPEG ({len(data)} bytes): {e}") from None
    if size is not None and arr.shape[:2] != (size, size):
        raise ValueError(f"tile is {arr.shape[1]}x{arr.shape[0]} px, expected {size}x{size}")
    return arr
