"""Attention-based multiple-instance learning (ABMIL) over tile embeddings: the slide score and a
per-tile attention for the heatmap.

Gated attention of Ilse, Tomczak & Welling, "Attention-based Deep Multiple Instance Learning", ICML
2018, eq. 9: a_k = softmax_k( w^T (tanh(V h_k) ⊙ sigm(U h_k)) ), z = Σ a_k h_k, score = sigm(c^T z + b),
with a first projection of the embeddings (as in CLAM, Lu et al. 2021: 1024 -> 512 -> attention 256).
The attention weights a_k sum to 1 over the slide's tiles and are what the heatmap shows.

Weights: a trained ABMIL head is loaded from a state dict file; without one the head is
random-initialised with a seed, and every result says ``"mil": "random-init"``.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ABMIL"]


class ABMIL(nn.Module):
    """Gated-attention MIL. ``forward(h)``: embeddings float (N, in_dim), N >= 1 tiles of one slide ->
    (score float scalar in [0, 1], attention float (N,) summing to 1). Raises ValueError for N = 0."""

    def __init__(self, in_dim: int = 1024, hidden: int = 512, attn_dim: int = 256) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU())
        self.attn_v = nn.Linear(hidden, attn_dim)
        self.attn_u = nn.Linear(hidden, attn_dim)
        self.attn_w = nn.Linear(attn_dim, 1)
        self.classifier = nn.Linear(hidden, 1)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if h.ndim != 2 or h.shape[0] == 0:
            raise ValueError(f"ABMIL needs embeddings of shape (N >= 1, {self.fc[0].in_features}), got {tuple(h.shape)}")
        x = self.fc(h)                                                    # (N, hidden)
        a = self.attn_w(torch.tanh(self.attn_v(x)) * torch.sigmoid(self.attn_u(x))).squeeze(1)   # (N,)
        a = torch.softmax(a, dim=0)
        z = a @ x                                                         # (hidden,)
        return torch.sigmoid(self.classifier(z)).squeeze(0), a
