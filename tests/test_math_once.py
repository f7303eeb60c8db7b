"""The pieces of math written once and called from everywhere: KV bytes per token, RoPE's
inverse frequencies (the torch model and the device graph), the display release rule and its
stall count, TPOT from arrival times, and the one `KVTransfer` codec (the device hand-off and the
P/D payload both use it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from relayinfer.cloud.engine.model_runner import kv_bytes_per_token as engine_kv_bytes
from relayinfer.cloud.models.llama import rope, rope_inv_freq
from relayinfer.cloud.pd.kv import KVPayload, from_messages, to_messages
from relayinfer.device.settings import Timing, simulate
from relayinfer.device.speed import SpeedController, count_stalls, release_time, tpot_from_arrivals
from relayinfer.protocol.kvhandoff import kv_bytes_per_token, kv_layers, kv_messages, kv_part_messages, kv_parts
from relayinfer.protocol.messages import decode, encode
from relayinfer.protocol.model.model_file import ModelConfig, rope_inv_freq as model_inv_freq

CFG = ModelConfig(n_layers=30, dim=576, ffn_dim=1536, n_heads=9, n_kv_heads=3, vocab_size=49152,
                  context_length=8192, rope_theta=100000.0, norm_eps=1e-5, bos_id=1, eos_id=2, tied_embeddings=True)


def test_kv_bytes_per_token_one_formula():
    assert kv_bytes_per_token(30, 3, 64) == 30 * 2 * 3 * 64 * 2 == 23040
    assert CFG.kv_bytes_per_token == kv_bytes_per_token(30, 3, 64, 4) == 46080
    assert engine_kv_bytes(CFG) == 46080 and engine_kv_bytes(CFG, torch.bfloat16) == 23040


def test_rope_inv_freq_once_for_torch_and_the_device_graph():
    """One numpy formula: bit for bit transformers' float32 torch values for SmolLM2, the torch
    model's buffer, and the source of the ONNX graph's cos/sin tables (within 1 ulp of the torch
    model's `rope` at every one of the 8,192 positions)."""
    from onnx import numpy_helper

    from relayinfer.cloud.onnx_graph import _Builder, _rope_tables

    inv = model_inv_freq(CFG)
    assert inv.dtype == np.float32 and inv.shape == (32,) and inv[0] == 1.0
    ref = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))  # transformers' Llama
    assert torch.equal(torch.from_numpy(inv), ref) and torch.equal(rope_inv_freq(CFG), ref)
    b = _Builder()
    assert _rope_tables(b, CFG, CFG.context_length) == {CFG.rope_theta: ("rope.cos", "rope.sin")}
    tables = {t.name: numpy_helper.to_array(t) for t in b.inits}
    cos, sin = rope(torch.arange(CFG.context_length), rope_inv_freq(CFG))
    assert tables["rope.cos"].shape == (8192, 32)
    assert np.abs(tables["rope.cos"] - cos[:, :32].numpy()).max() <= 1.2e-7
    assert np.abs(tables["rope.sin"] - sin[:, :32].numpy()).max() <= 1.2e-7


def test_release_rule_and_stalls_same_in_controller_and_simulation():
    assert release_time(5.0, None, 50.0) == 5.0
    assert release_time(10.0, 100.0, 50.0) == 150.0 and release_time(200.0, 100.0, 50.0) == 200.0
    assert count_stalls([0, 50, 100, 260], 50.0, 50.0) == 1          # 160 > 2 x 50
    assert count_stalls([0, 50, 100, 260], [50, 50, 50, 100], 50.0) == 0  # the last gap judged at 100
    assert count_stalls([3.0], 50.0, 50.0) == 0
    t = Timing(60.0, 5.0, 30.0, 200.0, 45.0)
    sim = simulate(t, 100, 40, 10, 50.0, 50.0)
    sc = SpeedController(50.0, 50.0)
    ready = np.asarray(sim["shown_ms"])  # releasing the shown times again changes nothing
    for r in ready:
        sc.shown(sc.release_at(r))
    assert np.allclose(sc.shown_ms, ready) and sc.stats(0.0)["stalls"] == sim["stalls"]


def test_tpot_from_arrivals():
    assert tpot_from_arrivals([]) is None and tpot_from_arrivals([7.0]) is None
    assert tpot_from_arrivals([10.0, 30.0, 70.0]) == 30.0


def test_one_kv_transfer_codec_for_the_handoff_and_the_pd_payload():
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((4, 2, 3, 40, 8)).astype(np.float32)
    # P/D block-fixed: one part per 16-token block, each message with its own tokens
    blocks = [kv[:, :, :, i:i + 16] for i in range(0, 40, 16)]
    msgs = to_messages(KVPayload("block-fixed", 40, 16, blocks, kv.nbytes), "r")
    assert [(m.block_index, m.num_blocks, m.num_tokens, m.token_start) for m in msgs] == \
        [(0, 3, 16, 0), (1, 3, 16, 16), (2, 3, 8, 32)]
    back = from_messages([decode(encode(m)) for m in reversed(msgs)])
    assert back.mode == "block-fixed" and back.num_tokens == 40
    assert np.array_equal(np.concatenate(back.parts, axis=3), kv)
    one = to_messages(KVPayload("contiguous", 40, 16, [kv], kv.nbytes), "r")
    assert len(one) == 1 and one[0].block_index == -1 and one[0].num_tokens == 40
    assert from_messages(one).mode == "contiguous"
    # the device hand-off: the same codec, float16, cut to frames, from an absolute position
    start, layers = kv_layers(kv_messages("r", kv, 5, max_bytes=kv[:, :, :, :1].astype(np.float16).nbytes * 10 + 4096))
    assert start == 5 and np.array_equal(layers[1][0][0], kv[1, 0].astype(np.float16))
    with pytest.raises(ValueError, match="parts"):
        kv_parts(msgs[:2])
    with pytest.raises(ValueError, match="position 0"):
        from_messages(kv_part_messages("r", [kv], 3))
