"""ViT-L/16 tile encoder in one readable file (Dosovitskiy et al. 2021), with timm's state-dict layout.

Why not timm itself: timm 1.0.x imports torchvision at import time (`timm/layers/create_norm.py`:
`from torchvision.ops.misc import FrozenBatchNorm2d`), and PyPI's torchvision wheels pull a CUDA torch
2.14 instead of working beside this project's CPU torch 2.13.0. So the model is written here, with
the parameter names of `timm.models.vision_transformer.VisionTransformer` (`patch_embed.proj`,
`cls_token`, `pos_embed`, `blocks.i.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}`,
`norm`), so a timm ViT state dict loads as is: UNI (Chen et al. 2024, `vit_large_patch16_224`,
LayerScale init 1e-5), Digepath's ViT-L/16 (DINOv2-style) or any plain timm ViT. LayerScale and
register tokens are taken from the state dict when present. Checked once against timm 1.0.31's
`VisionTransformer` (torchvision stubbed out; not in the suite, timm cannot import here): identical
outputs (max abs difference 0.0) for vit_large_patch16_224 with and without LayerScale, and for
reg_tokens=4 with and without `no_embed_class`.

Output: the class token after the final norm, float (N, embed_dim) (1024 for ViT-L).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ViTConfig", "VisionTransformer", "VIT_LARGE_16", "VIT_TINY_TEST"]


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT: ``img_size``/``patch`` in pixels, ``dim`` embedding width, ``depth`` blocks, ``heads``,
    ``mlp_ratio``, ``layerscale`` (LayerScale gammas present), ``reg_tokens`` (register tokens), ``pos_prefix``
    (how many of the prefix tokens [cls, registers...] have a position in ``pos_embed``: 1 = the class
    token, timm's default and DINOv2 with registers, Darcet et al. 2024; 1 + reg_tokens = all, timm's
    default with ``reg_tokens``; 0 = patches only, timm's ``no_embed_class``)."""

    img_size: int = 224
    patch: int = 16
    dim: int = 1024
    depth: int = 24
    heads: int = 16
    mlp_ratio: float = 4.0
    layerscale: bool = False
    reg_tokens: int = 0
    pos_prefix: int = 1


VIT_LARGE_16 = ViTConfig()
"""ViT-L/16 at 224 px: 24 blocks, width 1024, 16 heads, 303 M parameters (timm `vit_large_patch16_224`)."""
VIT_TINY_TEST = ViTConfig(dim=64, depth=2, heads=4)
"""A two-block ViT of the same code path, for fast tests only."""


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)             # (b, heads, n, c / heads)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.ls1 = LayerScale(cfg.dim) if cfg.layerscale else nn.Identity()
        self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.mlp = Mlp(cfg.dim, int(cfg.dim * cfg.mlp_ratio))
        self.ls2 = LayerScale(cfg.dim) if cfg.layerscale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.dim, cfg.patch, stride=cfg.patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)          # (N, patches, dim)


class VisionTransformer(nn.Module):
    """``forward(x)``: normalised float (N, 3, img_size, img_size) -> class-token embedding (N, dim).

    Parameters are timm-named (see the module docstring); ``from_state_dict`` infers the config."""

    def __init__(self, cfg: ViTConfig = VIT_LARGE_16) -> None:
        super().__init__()
        self.cfg = cfg
        n = (cfg.img_size // cfg.patch) ** 2
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, cfg.dim)) if cfg.reg_tokens else None
        self.pos_embed = nn.Parameter(torch.randn(1, n + cfg.pos_prefix, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        nn.init.normal_(self.cls_token, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        b, pp = x.shape[0], self.cfg.pos_prefix
        prefix = self.cls_token.expand(b, -1, -1)
        if self.reg_token is not None:
            prefix = torch.cat([prefix, self.reg_token.expand(b, -1, -1)], dim=1)   # [cls, registers]
        prefix = torch.cat([prefix[:, :pp] + self.pos_embed[:, :pp], prefix[:, pp:]], dim=1)
        x = torch.cat([prefix, x + self.pos_embed[:, pp:]], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]

    @staticmethod
    def config_from_state_dict(sd: dict, heads: int | None = None) -> ViTConfig:
        """The ViTConfig of a timm-layout state dict (heads: 16 for width 1024, 12 for 768, 6 for 384,
        else dim // 64, unless given). Raises ValueError if it is not a ViT state dict."""
        try:
            w = sd["patch_embed.proj.weight"]
            dim, patch = w.shape[0], w.shape[-1]
            depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
            regs = sd["reg_token"].shape[1] if "reg_token" in sd else 0
            n_pos = sd["pos_embed"].shape[1]
            hidden = sd["blocks.0.mlp.fc1.weight"].shape[0]
        except (KeyError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"not a timm ViT state dict (missing or odd {e})") from None
        for pp in (1, 0, 1 + regs):                               # which prefix tokens have positions
            side = int(round(max(n_pos - pp, 0) ** 0.5))
            if side > 0 and side * side == n_pos - pp:
                break
        else:
            raise ValueError(f"pos_embed has {n_pos} positions: not a square patch grid plus 0, 1 or {1 + regs} prefix positions")
        return ViTConfig(img_size=side * patch, patch=patch, dim=dim, depth=depth,
                         heads=heads or {1024: 16, 768: 12, 384: 6}.get(dim, max(1, dim // 64)),
                         mlp_ratio=hidden / dim, layerscale="blocks.0.ls1.gamma" in sd,
                         reg_tokens=regs, pos_prefix=pp)
