"""Sampling for one engine step: every sequence that samples in the step, at once.

Greedy rows (temperature below SAMPLING_EPS, no logit adjustments: the common case and the benchmarks') are one
`torch.argmax` over their logits [B, vocab] (first maximum on ties, as `np.argmax`). Rows that draw
(temperature > 0) or adjust logits (penalties, bias, min_tokens, a grammar's mask) go through
`protocol.model.decoding.sample`, the numpy sampler the device and the split service also use: it is
seeded per (seed, answer position), so a seeded request draws the same token whatever else is in
the batch and whichever side (cloud engine, `TorchEngine`, device) computes it, and it sorts no
more than the nucleus' candidates (`decoding.top_p_keep`), never the whole vocabulary. A torch
softmax/top-k of the whole batch would be faster still but rounds differently from numpy, which
would break that bit-for-bit cross-side reproducibility.
"""
from __future__ import annotations

import numpy as np
import torch

from relayinfer.protocol.model.decoding import SAMPLING_EPS, sample

from .sequence import Sequence


def sample_batch(logits: torch.Tensor, seqs: list[Sequence], eos_id: int | None) -> list[int]:
    """One token per row: `logits` float32 [len(seqs), vocab] (row i belongs to `seqs[i]`, whose
    `token_ids` hold the prompt and the answer so far and whose `params` decide the rule).
    Returns the token ids (int) in row order.

    Raises:
        ValueError: `logits` is not [len(seqs), vocab].
    """
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits must be [{len(seqs)}, vocab], got {tuple(logits.shape)}")
    out = [0] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature < SAMPLING_EPS and not s.params.needs_context]
    if greedy:
        rows = logits if len(greedy) == len(seqs) else logits[greedy]
        for i, t in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[i] = t
    if len(greedy) < len(seqs):
        arr: np.ndarray = logits.cpu().numpy()
        for i, s in enumerate(seqs):
            if s.params.temperature < SAMPLING_EPS and not s.params.needs_context:
                continue
            out[i] = sample(arr[i], s.params, s.num_output_tokens, s.token_ids, s.num_prompt_tokens, eos_id, s.guide)
    return out
