"""Fast checks of the split benchmark's metrics (no model)."""
from __future__ import annotations

import pytest

from relayinfer.sdk.cli import bench_module

_split = bench_module("split")  # the driver lives in bench/, importing the library
_refine_saving, lcs_len, rouge_l = _split._refine_saving, _split.lcs_len, _split.rouge_l


def test_lcs_and_rouge_l():
    assert lcs_len([1, 2, 3, 4], [1, 3, 4, 5]) == 3
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0 and rouge_l([1, 2], [3, 4]) == 0.0 and rouge_l([], [1]) == 0.0
    # P = 3/4, R = 3/4 -> F = 0.75
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)


def test_refine_saving_uses_prompts_where_both_handed_off():
    row = lambda m, i, ms, n: {"bench_mode": m, "prompt_idx": i, "device_prefill_ms": ms,  # noqa: E731
                               "device_prompt_tokens": n, "prompt_tokens": 100}
    rows = [row("split", 0, 1000.0, 100), row("split+refine", 0, 600.0, 50),
            row("split", 1, 0.0, 100), row("split+refine", 1, 500.0, 50)]  # prompt 1: split never handed off
    s = _refine_saving(rows)
    assert s["prompts"] == 1 and s["prefill_ms_saving"] == pytest.approx(0.4) and s["prompt_token_saving"] == 0.5
    assert _refine_saving(rows[2:]) is None
