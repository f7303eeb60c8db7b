"""Tile encoder interface of the cloud fine screen, and the ViT implementation of it.

An encoder maps uint8 RGB tiles (N, H, W, 3) to float32 embeddings (N, dim), in batches, under
``torch.inference_mode``, optionally in bfloat16. ``ViTEncoder`` is ViT-L/16 (``vit.py``) with
either a local weights file (a timm-layout state dict: Digepath, UNI, any timm ViT; ``.pth``,
``.bin`` or ``.safetensors``) or, without one, **random initialisation** (``random_weights`` is then
True and every report says ``"encoder_weights": "random-init"``). Pathology foundation models'
weights cannot be fetched here; nothing loads anything from a hub.

Normalisation per model: ``imagenet`` (mean 0.485/0.456/0.406, std 0.229/0.224/0.225; UNI's and
DINOv2's transform, used for Digepath too) or ``inception`` (0.5/0.5; timm's augreg ViTs).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .vit import VIT_LARGE_16, ViTConfig, VisionTransformer

__all__ = ["NORMS", "TileEncoder", "ViTEncoder", "load_state_dict"]

NORMS = {"imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), "inception": ((0.5,) * 3, (0.5,) * 3)}
"""Per-channel (mean, std) of the encoders' input normalisation, on [0, 1] pixel values."""


class TileEncoder:
    """Interface: ``name``, ``dim`` (embedding width), ``weights`` ("random-init" or the file's sha256),
    ``random_weights`` (bool), ``tile_px``, and ``encode(tiles) -> float32 (N, dim)``."""

    name: str = ""
    dim: int = 0
    weights: str = "random-init"
    tile_px: int = 224

    @property
    def random_weights(self) -> bool:
        """True when the weights are a random initialisation (results mean nothing clinically)."""
        return self.weights == "random-init"

    def encode(self, tiles: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def load_state_dict(path: str | Path) -> dict:
    """Read a state dict (.safetensors, or a torch pickle read with weights_only=True), unwrap
    {"state_dict"|"model": ...} and strip "module."/"model."/"backbone." prefixes; drop "head.*".
    Raises ValueError naming the file when it cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such weights file: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read weights file {p}: {type(e).__name__}: {str(e)[:200]}") from None
    for key in ("state_dict", "model", "teacher"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise ValueError(f"{p} does not hold a state dict")
    out = {}
    for k, v in sd.items():
        for pre in ("module.", "model.", "backbone."):
            if k.startswith(pre):
                k = k[len(pre):]
        if not k.startswith("head."):
            out[k] = v
    return out


class ViTEncoder(TileEncoder):
    """ViT tile encoder. ``weights``: a timm-layout state dict file, or None for random init (seeded);
    ``cfg``: the ViT shape when random (default ViT-L/16; ignored with a file, whose shapes decide);
    ``norm``: a key of NORMS; ``heads``: attention heads of a weights file (a state dict does not
    show them; default 16 for width 1024, 12 for 768, 6 for 384); ``batch_size``: tiles per forward; ``bf16``: run in bfloat16 (CPU/GPU
    autocast-free: the weights are cast); ``device``: torch device.

    ``encode(tiles)``: uint8 (N, H, W, 3) -> float32 (N, dim); tiles of another size than the model's
    ``img_size`` are resized (bilinear, antialiased). Raises ValueError for a bad file, norm or input.
    """

    def __init__(self, weights: str | Path | None = None, cfg: ViTConfig = VIT_LARGE_16, norm: str = "imagenet",
                 batch_size: int = 8, bf16: bool = False, device: str = "cpu", seed: int = 0,
                 heads: int | None = None) -> None:
        if norm not in NORMS:
            raise ValueError(f"unknown normalisation {norm!r}; choose from {', '.join(NORMS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if weights is not None:
            from relayinfer.protocol.model.model_file import file_sha256

            sd = load_state_dict(weights)
            cfg = VisionTransformer.config_from_state_dict(sd, heads)
            model = VisionTransformer(cfg)
            try:
                model.load_state_dict(sd, strict=True)
            except RuntimeError as e:
                raise ValueError(f"{weights} does not fit a timm ViT of its own shapes: {str(e)[:300]}") from None
            self.weights = file_sha256(weights)
        else:
            torch.manual_seed(seed)
            model = VisionTransformer(cfg)
            self.weights = "random-init"
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = model.to(device=device, dtype=self.dtype).eval()
        self.cfg, self.dim, self.tile_px, self.device = cfg, cfg.dim, cfg.img_size, device
        self.batch_size, self.norm = batch_size, norm
        self.name = f"vit-{cfg.dim}d-{cfg.depth}x-p{cfg.patch}" + ("" if cfg != VIT_LARGE_16 else " (ViT-L/16)")
        mean, std = NORMS[norm]
        self._mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self._std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255

    def encode(self, tiles: np.ndarray) -> np.ndarray:
        tiles = np.asarray(tiles)
        if tiles.dtype != np.uint8 or tiles.ndim != 4 or tiles.shape[-1] != 3:
            raise ValueError(f"tiles must be uint8 (N, H, W, 3), got {tiles.dtype} {tiles.shape}")
        out = np.empty((len(tiles), self.dim), np.float32)
        with torch.inference_mode():
            for i in range(0, len(tiles), self.batch_size):
                x = torch.from_numpy(np.array(tiles[i:i + self.batch_size])).to(self.device)  # a writable copy
                x = (x.permute(0, 3, 1, 2).float() - self._mean) / self._std
                if x.shape[-1] != self.tile_px or x.shape[-2] != self.tile_px:
                    x = F.interpolate(x, size=(self.tile_px, self.tile_px), mode="bilinear", antialias=True)
                out[i:i + len(x)] = self.model(x.to(self.dtype)).float().cpu().numpy()
        return out
