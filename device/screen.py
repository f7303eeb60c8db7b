"""Device coarse screen of a WSI: ONNX Runtime scores low-magnification regions, and only the tissue
tiles of candidate regions go to the cloud (torch-free: onnxruntime + numpy + OpenSlide + Pillow).

Two magnifications, as in coarse-to-fine WSI screening (Digepath's screening module, arXiv 2505.21928,
finds sparse lesion areas by a coarse pass before the fine one): the fine grid has ``tile_px`` tiles
at ``mpp`` µm/px (224 px at 0.5 µm/px = 112 µm); the coarse screen looks at regions of
``region_tiles`` x ``region_tiles`` fine tiles read at ``region_tiles * mpp`` µm/px (224 px at 2 µm/px
= 448 µm), so one EfficientNet-Lite0 pass covers 16 fine tiles. A region is a candidate when its score
is at least ``threshold`` or it is among the top ``keep`` fraction of tissue regions (whichever keeps
more); the fine tissue tiles inside candidate regions are then read and sent.

The coarse model (``cloud/patho/effnet.py``, exported on the torch side): uint8 tiles (N, 224, 224, 3)
-> features float32 (N, 1280), score float32 (N,). Its head is random-initialised unless a trained
head was exported (the model's ``.onnx.json`` says which; ``CoarseScreen.head``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .slide import Slide, SlideError, TileSpec, tile_grid

__all__ = ["CoarseScreen", "Region", "coarse_regions", "select_candidates", "payload_mode"]


class CoarseScreen:
    """ONNX Runtime session of the coarse-screen model. ``threads``: intra-op threads (default 1).
    ``run(tiles)``: uint8 (N, px, px, 3) -> (features float32 (N, 1280), scores float32 (N,)), in
    batches of ``batch_size``. ``head``: "random-init" or the trained head's sha256 (from the side file).
    Raises SlideError if the model file is missing or not an ONNX model of that signature."""

    def __init__(self, path: str | Path, threads: int = 1, batch_size: int = 8) -> None:
        import onnxruntime as ort

        p = Path(path)
        if not p.is_file():
            raise SlideError(f"no coarse-screen model at {p} (export one: relayinfer patho export)")
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        try:
            self.session = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise SlideError(f"{p} is not a loadable ONNX model: {str(e)[:200]}") from None
        names = [i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]
        if names != (["tiles"], ["features", "score"]):
            raise SlideError(f"{p} is not a coarse-screen model (inputs/outputs {names})")
        self.tile_px = int(self.session.get_inputs()[0].shape[1])
        meta = Path(str(p) + ".json")
        self.meta = json.loads(meta.read_text()) if meta.is_file() else {}
        self.head = self.meta.get("head", "unknown")
        self.path, self.batch_size = p, batch_size

    def run(self, tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feats, scores = [], []
        for i in range(0, len(tiles), self.batch_size):
            f, s = self.session.run(None, {"tiles": np.ascontiguousarray(tiles[i:i + self.batch_size], np.uint8)})
            feats.append(f)
            scores.append(s)
        if not feats:
            return np.zeros((0, 1280), np.float32), np.zeros(0, np.float32)
        return np.concatenate(feats), np.concatenate(scores)


@dataclass
class Region:
    """A coarse region: level-0 offset/size like a TileSpec, its fine ``tiles`` (tissue tiles inside it)
    and, once screened, its device ``score``."""

    spec: TileSpec
    tiles: list[TileSpec]
    score: float = float("nan")


def coarse_regions(slide: Slide, mask: np.ndarray, scale: float, mpp: float, tile_px: int,
                   region_tiles: int = 4, min_tissue: float = 0.25) -> tuple[list[Region], list[TileSpec]]:
    """(regions that hold at least one fine tissue tile, all fine tissue tiles). A region is the square
    of ``region_tiles`` x ``region_tiles`` fine grid cells; at the slide's right and bottom edges it may
    extend past the slide, and that part reads as white glass."""
    fine = tile_grid(slide, mask, scale, mpp, tile_px, min_tissue)
    size = int(round(tile_px * mpp / slide.mpp)) * region_tiles
    by_cell: dict[tuple[int, int], list[TileSpec]] = {}
    for t in fine:
        by_cell.setdefault((t.col // region_tiles, t.row // region_tiles), []).append(t)
    regions = []
    for (c, r), tiles in sorted(by_cell.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        frac = float(np.mean([t.tissue for t in tiles])) * len(tiles) / region_tiles ** 2
        regions.append(Region(TileSpec(c * size, r * size, size, frac, c, r), tiles))
    return regions, fine


def select_candidates(scores: np.ndarray, threshold: float, keep: float) -> np.ndarray:
    """Indices (ascending) of regions with score >= threshold or in the top ceil(keep * n) by score."""
    n = len(scores)
    if n == 0:
        return np.zeros(0, np.int64)
    if not 0 <= keep <= 1:
        raise ValueError(f"keep must be a fraction in [0, 1], got {keep}")
    top = np.argsort(-scores, kind="stable")[:math.ceil(keep * n)]
    return np.union1d(top, np.flatnonzero(scores >= threshold)).astype(np.int64)


def payload_mode(link_mbps: float | None, n_tiles: int, jpeg_bytes_per_tile: float = 12_000,
                 cloud_tiles_per_s: float = 2.0) -> str:
    """"jpeg" or "features": send JPEG tiles when the link carries them faster than the cloud encodes
    them (the transfer hides behind the ViT), else the device's 1280-d features (2.5 KB a tile in
    float16), scored by the cloud's feature ABMIL. ``link_mbps`` None = unknown -> "jpeg"."""
    if link_mbps is None or n_tiles == 0:
        return "jpeg"
    send_s = n_tiles * jpeg_bytes_per_tile * 8 / (link_mbps * 1e6)
    return "jpeg" if send_s <= n_tiles / cloud_tiles_per_s else "features"
