"""Prompt refinement end to end: the device prefills the refined prompt at the kept tokens' original
RoPE positions and continues the answer at n + k (`device.split.prefill_at`), and `refine='auto'`
picks the keep ratio from the measured table (`protocol.model.refine.choose_refine`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.split import SplitOptions, takes_positions
from relayinfer.protocol.model import refine as refine_mod
from relayinfer.protocol.model.refine import REFINE_BY_LENGTH, check_refine, choose_refine
from relayinfer.sdk import Client

from test_refine import CONV  # tests/ is on sys.path
from conftest import CloudFirstClient


class Recorder:
    """A device engine that records every prefill's ids, positions and logits (decode is a
    one-token prefill, as in `OnnxEngine`)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.eos_id, self.context_length, self.fingerprint = engine.eos_id, engine.context_length, engine.fingerprint

    def tokenizer(self):
        return self.engine.tokenizer()

    def prefill(self, ids, kv=None, positions=None):
        logits, kv = self.engine.prefill(ids, kv, positions=positions)
        self.calls.append((list(ids), None if positions is None else list(map(int, positions)), logits))
        return logits, kv

    def decode(self, token_id, kv):
        return self.prefill([token_id], kv)


def test_refine_setting_checked_and_table_from_results():
    """'auto' follows REFINE_BY_LENGTH, which is derived from the committed bench results; short
    prompts are never refined; invalid values are refused with the value named."""
    from relayinfer.sdk.cli import bench_module

    bench = bench_module("refine")
    assert REFINE_BY_LENGTH == bench.refine_table(bench.merged_summary())  # bench/results/refine*.json
    assert choose_refine(100, "auto") is None and choose_refine(100, 0.5) is None  # short: whole prompt
    for lo, keep in REFINE_BY_LENGTH:
        assert choose_refine(lo, "auto") == keep
    assert choose_refine(4096, None) is None and choose_refine(4096, 1.0) is None
    assert choose_refine(4096, 0.3) == 0.3  # an explicit ratio on a long prompt is used as given
    for bad in ("fast", 0, 1.5, -0.2, True, [0.5]):
        with pytest.raises(ValueError, match="refine must be"):
            check_refine(bad)
        with pytest.raises(ValueError, match="refine must be"):
            SplitOptions(refine=bad)


def test_device_refined_prefill_at_original_positions(torch_engine, onnx_engine, tokenizer, monkeypatch):
    """Split generation with refinement on the ONNX device engine: the kept prompt tokens are
    prefilled at their original positions, the cloud's tokens and the device's own at n + k, and
    the device's logits and tokens equal the torch reference run at the same positions."""
    monkeypatch.setattr(refine_mod, "MIN_REFINE_TOKENS", 0)
    eng = Recorder(onnx_engine)
    assert takes_positions(eng) and takes_positions(onnx_engine) and not takes_positions(torch_engine)
    svc = CloudService(torch_engine, torch_engine.fingerprint, step_delay_ms=20.0, max_frame_bytes=1 << 20)
    prompt = tokenizer.encode_chat(CONV)
    n = len(prompt)
    with ServiceThread(svc) as running:
        c = CloudFirstClient(cloud_url=running.url, engine=eng, cloud_budget=6, target_tpot_ms=1.0, kv_handoff=False)
        with pytest.raises(ValueError, match="refine must be"):
            c.complete(prompt, max_new_tokens=4, refine="half")  # refused before anything runs
        auto = c.complete(prompt, max_new_tokens=4, refine="auto")  # a short prompt: never refined
        eng.calls.clear()
        res = c.complete(prompt, max_new_tokens=16, refine=0.5)
        c.close()
    assert choose_refine(n, "auto") is None and auto.device_prompt_tokens == n
    assert res.mode == "split" and res.fault is None and res.device_tokens > 0, res
    assert res.device_prompt_tokens < n  # refined
    # the calls: system turn (contiguous), kept tokens at their positions, cloud tokens, own tokens
    kept_pos = [p for ids, pos, _ in eng.calls if pos is not None for p in pos if p < n]
    head = eng.calls[0][1] is None and len(eng.calls[0][0])
    assert head and kept_pos[0] >= head and kept_pos == sorted(kept_pos) and head + len(kept_pos) == res.device_prompt_tokens
    assert len(set(kept_pos)) == len(kept_pos) and kept_pos[-1] == n - 1 and kept_pos != list(range(head, head + len(kept_pos)))
    h = res.handoff_index
    answer_pos = [p for _, pos, _ in eng.calls if pos is not None for p in pos if p >= n]
    assert answer_pos == list(range(n, n + len(res.token_ids) - 1))  # the last token is never fed back
    # reference: one forward of the kept prompt at its positions, then the answer at n + k
    kept = list(range(head)) + kept_pos
    x = torch.tensor([[prompt[i] for i in kept] + res.token_ids[:h]])
    pos = torch.tensor(kept + list(range(n, n + h)))
    kv = torch_engine.new_cache(1024)
    with torch.inference_mode():
        kv.reserve(x.shape[1])
        ref = torch_engine.model(x, kv, 0, last_only=True, positions=pos)[0].float().numpy()
        kv.commit()
    dev = next(lg for ids, p, lg in eng.calls if p and p[-1] == n + h - 1)  # the catch-up's last logits
    assert np.abs(dev - ref).max() < 1e-3
    toks, lg = [], ref  # greedy from the reference (temperature 0): the device's tokens after the hand-off
    with torch.inference_mode():
        for i in range(h, len(res.token_ids)):
            toks.append(int(np.argmax(lg)))
            kv.reserve(1)
            lg = torch_engine.model(torch.tensor([[toks[-1]]]), kv, kv.length, last_only=True,
                                    positions=torch.tensor([n + i]))[0].float().numpy()
            kv.commit()
    assert res.token_ids[h:] == toks
