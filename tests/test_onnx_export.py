"""The device ONNX model (cloud/onnx_graph.py) and its engine (device/onnx_engine.py): the GGUF's
own blocks reproduce the file's weights, ONNX equals the torch reference for prefill, chunked
prefill after a cached prefix and decode, RoPE positions are an input, and the cache API
(truncate / kv_export / kv_import / growth) keeps the numbers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from relayinfer.protocol.model.decoding import SamplingParams


def _unpack4(packed):
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


@pytest.fixture(scope="module")
def gguf_weights(model_path):
    from relayinfer.cloud.onnx_graph import _Weights
    from relayinfer.protocol.model.model_file import open_gguf, read_config

    reader = open_gguf(model_path)
    return _Weights(reader, read_config(reader))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"])
def test_gguf_blocks_reproduce_the_file_weights(gguf_weights, name):
    """Q4_1 / Q8_0 blocks repacked for MatMulNBits dequantize to what gguf.quants gives (the torch
    model's weights), Q/K rows un-permuted the same way."""
    import gguf

    from relayinfer.cloud.models.llama import _unpermute

    w, cfg = gguf_weights, gguf_weights.cfg
    t = w.t[name]
    k = int(t.shape[0])
    b = w.blocks(name, k)
    assert b.bits == (8 if t.tensor_type.name == "Q8_0" else 4) and b.scale.dtype == np.float32
    if b.bits == 4:
        assert b.packed().shape == (int(t.shape[1]), k // 32, 16)
        assert np.array_equal(_unpack4(b.packed()), b.q)  # the MatMulNBits nibble order
    ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    if ".attn_q." in name:
        ref = _unpermute(ref, cfg.n_heads)
    ours = b.dense()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())


def _torch_steps(model, ids, cuts, positions=None):
    """Logits of the torch reference after each chunk ids[a:b] for consecutive cuts."""
    from relayinfer.cloud.models.llama import StaticKV

    kv, out = StaticKV(model.cfg, capacity=len(ids) + 8), []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            kv.reserve(b - a)
            pos = None if positions is None else torch.tensor(positions[a:b])
            out.append(model(torch.tensor([ids[a:b]]), kv, a, positions=pos)[0].numpy())
            kv.commit()
    return out, kv


@pytest.fixture(scope="module")
def torch_model(torch_engine):
    return torch_engine.model


def _check_steps(eng, model, ids, tol):
    """Prefill, chunked prefill after a cached prefix (2 chunks), then 3 decode steps: logits
    within `tol` of torch and equal argmax; the cache holds torch's post-RoPE keys and values."""
    n = len(ids)
    cuts = [0, n - 12, n - 7, n - 3, n - 2, n - 1, n]
    ref, tkv = _torch_steps(model, ids, cuts)
    kv = None
    for (a, b), r in zip(zip(cuts, cuts[1:]), ref):
        logits, kv = eng.prefill(ids[a:b], kv) if b - a > 1 or kv is None else eng.decode(ids[a], kv)
        assert logits.dtype == np.float32 and logits.shape == r.shape
        assert np.abs(logits - r).max() < tol, (a, b)
        assert logits.argmax() == r.argmax()
    assert kv.length == n
    layers = eng.kv_export(kv)
    for i in (0, len(layers) - 1):  # fp32 rounding after i layers: 1e-4 relative to the largest entry
        for got, ref in ((layers[i][0], tkv.k[i, :, :, :n].numpy()), (layers[i][1], tkv.v[i, :, :, :n].numpy())):
            assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), i


def test_gguf_engine_equals_torch_prefill_chunked_decode(onnx_engine, torch_model, chat_prompt_ids):
    """The default (GGUF-blocks) engine; its greedy tokens on the chat prompts are checked against
    torch in tests/test_runtimes.py::test_onnx_equals_torch."""
    assert onnx_engine.weights == "gguf"
    _check_steps(onnx_engine, torch_model, chat_prompt_ids[0], 1e-3)


@pytest.mark.slow
def test_fp32_engine_equals_torch(model_path, torch_model, torch_engine, chat_prompt_ids):
    """The fp32-weights variant (exported here: ~15 s) within 1e-3 of torch, same greedy tokens."""
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine

    eng = OnnxEngine(ensure_device_model(model_path, "fp32"), quantize="fp32")
    _check_steps(eng, torch_model, chat_prompt_ids[1], 1e-3)
    params = SamplingParams(max_new_tokens=24)
    for ids in chat_prompt_ids:
        assert eng.generate(ids, params).token_ids == torch_engine.generate(ids, params).token_ids


def test_positions_input(onnx_engine, torch_model, chat_prompt_ids):
    """positions=None equals explicit contiguous positions; other positions change the logits and
    match torch run at the same positions with the cache contiguous."""
    ids = chat_prompt_ids[2]
    head = 9
    _, kv = onnx_engine.prefill(ids[:head])
    a, _ = onnx_engine.prefill(ids[head:], onnx_engine.fork(kv))
    b, _ = onnx_engine.prefill(ids[head:], onnx_engine.fork(kv), positions=np.arange(head, len(ids)))
    assert np.array_equal(a, b)
    gap = list(range(head)) + list(range(head + 40, head + 40 + len(ids) - head))  # 40 dropped tokens
    c, kv2 = onnx_engine.prefill(ids[head:], kv, positions=gap[head:])
    assert kv2.length == len(ids)
    assert np.abs(c - a).max() > 0.1
    ref, _ = _torch_steps(torch_model, ids, [0, head, len(ids)], positions=gap)
    assert np.abs(c - ref[-1]).max() < 1e-3
    with pytest.raises(ValueError, match="positions"):
        onnx_engine.prefill(ids[:3], positions=[0, 1])


def test_truncate_export_import_and_growth(onnx_engine, chat_prompt_ids):
    """truncate is O(1) and continuing from it equals a fresh prefill; kv_import(kv_export) round
    trips; a prefill past the buffer's capacity (doubling) equals one long prefill."""
    ids = chat_prompt_ids[0]
    full, kv = onnx_engine.prefill(ids)
    cut = onnx_engine.truncate(kv, 10)
    assert cut.length == 10 and cut.buffers[0] is kv.buffers[0]  # no copy
    again, _ = onnx_engine.prefill(ids[10:], cut)
    assert np.abs(again - full).max() < 1e-4 * max(1.0, np.abs(full).max())  # fp32 rounding scales with |logit|
    with pytest.raises(ValueError, match="truncate"):
        onnx_engine.truncate(kv, kv.length + 1)
    _, kv = onnx_engine.prefill(ids[:-1])
    layers = onnx_engine.kv_export(kv)
    assert layers[0][0].shape == (1, onnx_engine.cfg.n_kv_heads, len(ids) - 1, onnx_engine.cfg.head_dim)
    imported = onnx_engine.kv_import(layers, len(ids) - 1)
    step, _ = onnx_engine.decode(ids[-1], imported)
    assert np.abs(step - full).max() < 1e-4 * max(1.0, np.abs(full).max())  # fp32 rounding scales with |logit|
    with pytest.raises(ValueError, match="layer 0 key"):
        onnx_engine.kv_import([(k[:, :, :3], v) for k, v in layers], len(ids) - 1)
    long_ids = (ids * 12)[:300]
    one, _ = onnx_engine.prefill(long_ids)
    small = onnx_engine.new_cache(capacity=64)
    _, small = onnx_engine.prefill(long_ids[:50], small)
    two, grown = onnx_engine.prefill(long_ids[50:], small)
    assert grown.capacity >= 300 and grown.length == 300
    assert np.abs(one - two).max() < 1e-4 * max(1.0, np.abs(one).max())  # fp32 rounding scales with |logit|


def test_export_format_and_refused_options(model_path, device_model_dir):
    """The export sits in a format-versioned directory, its manifest records the version and each
    file's sha256; the former int8 option is refused with a clear error."""
    from relayinfer.cloud.export import device_model_ready, ensure_device_model
    from relayinfer.device.onnx_engine import FORMAT_VERSION, OnnxEngine, onnx_file_name
    from relayinfer.protocol.model.model_file import file_sha256

    assert device_model_dir.name == f"onnx-v{FORMAT_VERSION}"
    m = json.loads((device_model_dir / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and m["default_onnx"] == onnx_file_name() == "model.gguf.onnx"
    assert m["files"]["model.gguf.onnx"] == file_sha256(device_model_dir / "model.gguf.onnx")
    assert device_model_ready(model_path)
    for bad in ("int8", "int4"):
        with pytest.raises(ValueError, match="gguf"):
            ensure_device_model(model_path, bad)
        with pytest.raises(ValueError, match="gguf"):
            OnnxEngine(device_model_dir, quantize=bad)


def _linear_layout(tag: str, k: int, n: int, gguf: bool) -> tuple[list, list]:
    """(nodes, initializers) of one projection [.., K] -> [.., N] over Q4_1 blocks (MatMulNBits plus
    the block-offset term) or dense fp32 weights."""
    if not gguf:
        return [("MatMul", tag)], [(f"{tag}.w", (k, n), "FLOAT")]
    nodes = [("MatMulNBits", tag), ("Reshape", f"{tag}.blocks"), ("ReduceSum", f"{tag}.block_sums"),
             ("MatMul", f"{tag}.offset"), ("Add", f"{tag}.add_offset")]
    inits = [(f"{tag}.q", (n, k // 32, 16), "UINT8"), (f"{tag}.scales", (n, k // 32), "FLOAT"),
             (f"{tag}.bshape", (4,), "INT64"), (f"{tag}.baxis", (1,), "INT64"),
             (f"{tag}.offsets", (k // 32, n), "FLOAT")]
    return nodes, inits


def _expected_layout(cfg, gguf: bool) -> tuple[list, list]:
    """The graph of the SmolLM2 GGUF (Q4_1 matrices, a tied Q8_0 embedding) in order: nodes as
    (op_type, name) and initializers as (name, shape, dtype name)."""
    dim, ffn, v, hd = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    inits = [("rope.cos", (cfg.context_length, hd // 2), "FLOAT"), ("rope.sin", (cfg.context_length, hd // 2), "FLOAT")]
    if gguf:
        nodes = [("GatherBlockQuantized", "embed"), ("Reshape", "embed_flat")]
        inits += [("embed.q", (v, dim // 32, 32), "UINT8"), ("embed.scales3", (v, dim // 32, 1), "FLOAT"),
                  ("shape.embed", (3,), "INT64")]
    else:
        nodes, inits = [("Gather", "embed")], inits + [("embed.w", (v, dim), "FLOAT")]
    for i in range(cfg.n_layers):
        p = f"l{i}."
        lin = {tag: _linear_layout(p + tag, k, n, gguf)
               for tag, k, n in (("qkv", dim, qkv), ("wo", dim, dim), ("gate_up", dim, 2 * ffn), ("down", ffn, dim))}
        nodes += [("SkipSimplifiedLayerNormalization" if i else "SimplifiedLayerNormalization", p + "attn_norm"),
                  *lin["qkv"][0], ("Split", p + "qkv_split"), ("RotaryEmbedding", p + "rope_q"),
                  ("RotaryEmbedding", p + "rope_k"), ("GroupQueryAttention", p + "gqa"), *lin["wo"][0],
                  ("SkipSimplifiedLayerNormalization", p + "ffn_norm"), *lin["gate_up"][0], ("Split", p + "gu_split"),
                  ("Sigmoid", p + "sigmoid"), ("Mul", p + "silu"), ("Mul", p + "swiglu"), *lin["down"][0]]
        inits += [(p + "attn_norm", (dim,), "FLOAT"), *lin["qkv"][1], (p + "qkv.split", (3,), "INT64"), *lin["wo"][1],
                  (p + "ffn_norm", (dim,), "FLOAT"), *lin["gate_up"][1], (p + "gu.split", (2,), "INT64"),
                  *lin["down"][1]]
    nodes += [("Add", "final_residual"), ("Slice", "last_position"), ("Squeeze", "last_squeeze"),
              ("SimplifiedLayerNormalization", "output_norm")]
    inits += [(n, (1,), "INT64") for n in ("slice.start", "slice.end", "slice.axis", "squeeze.axis")]
    inits += [("output_norm", (dim,), "FLOAT")]
    if gguf:  # the Q8_0 head as two 4-bit MatMulNBits over its nibbles, the high one with the 8 s offset
        hi_nodes, hi_inits = _linear_layout("lm_head.hi", dim, v, True)
        nodes += [("Unsqueeze", "lm_head.x3"), *hi_nodes, ("MatMulNBits", "lm_head.lo"), ("Add", "lm_head"),
                  ("Squeeze", "lm_head.squeeze")]
        inits += [*hi_inits, ("lm_head.lo.q", (v, dim // 32, 16), "UINT8"), ("lm_head.lo.scales", (v, dim // 32), "FLOAT")]
    else:
        nodes += [("Gemm", "lm_head")]
    return nodes, inits


@pytest.fixture(scope="module", params=["gguf", pytest.param("fp32", marks=pytest.mark.slow)])
def built_graph(request, model_path):
    """(weights, onnx.ModelProto, ModelConfig) of the shipped model built by `build_model` (~15 s for
    gguf, ~35 s for fp32)."""
    from relayinfer.cloud.onnx_graph import build_model

    model, cfg = build_model(model_path, request.param)
    return request.param, model, cfg


def test_graph_layout(built_graph):
    """Every node (op type and name, in order), every initializer (name, shape, dtype, in order) and
    the graph's inputs/outputs, for both weight formats; the level-0 gguf head reads the tied Q8_0
    embedding's blocks as two 4-bit halves (`ggml_blocks.split_nibbles`), the fp32 one is a Gemm."""
    from onnx import TensorProto

    from relayinfer.cloud.onnx_graph import io_names

    weights, model, cfg = built_graph
    g = model.graph
    nodes, inits = _expected_layout(cfg, weights == "gguf")
    assert [(n.op_type, n.name) for n in g.node] == nodes
    assert [(t.name, tuple(t.dims), TensorProto.DataType.Name(t.data_type)) for t in g.initializer] == inits
    ins, outs = io_names(cfg.n_layers)
    assert [i.name for i in g.input] == ins and [o.name for o in g.output] == outs
    head = g.node[-1]
    assert list(head.output) == ["logits"]
    if weights == "fp32":
        assert list(head.input) == ["output_norm/out0", "embed.w"]
    assert g.name == f"llama-{weights}" and model.ir_version == 10


@pytest.mark.parametrize("built_graph", ["gguf"], indirect=True)
def test_built_graph_greedy_equals_torch(built_graph, tmp_path, device_model_dir, torch_engine, chat_prompt_ids):
    """The graph built here (not a cached export), run by the device engine: the same 24 greedy
    tokens as the torch engine on a chat prompt."""
    import shutil

    import onnx

    from relayinfer.device.onnx_engine import OnnxEngine, onnx_file_name

    weights, model, _ = built_graph
    shutil.copy(device_model_dir / "config.json", tmp_path / "config.json")
    onnx.save_model(model, str(tmp_path / onnx_file_name(weights)))
    eng = OnnxEngine(tmp_path, quantize=weights)
    params = SamplingParams(max_new_tokens=24)
    ids = chat_prompt_ids[0]
    assert eng.generate(ids, params).token_ids == torch_engine.generate(ids, params).token_ids


def test_gguf_q8_levels_and_closeness(model_path, onnx_engine, chat_prompt_ids):
    """'gguf-q8' (exported here: ~15 s): the MLP's Q4_1 blocks and the 8-bit head on int8 activations
    (accuracy level 4), the attention projections on fp32 activations (level 0), recorded as revision
    2 of the variant; its logits are close to the default variant's (not equal: int8 activations)
    and their greedy first token is gguf's up to a near-tie on the chat prompts."""
    import onnx

    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.protocol.model.device_model import WEIGHTS_REVISION

    d = ensure_device_model(model_path, "gguf-q8")
    assert json.loads((d / "manifest.json").read_text())["revisions"]["model.gguf-q8.onnx"] == WEIGHTS_REVISION["gguf-q8"] == 2
    g = onnx.load(str(d / "model.gguf-q8.onnx"), load_external_data=False).graph
    levels = {n.name: next(a.i for a in n.attribute if a.name == "accuracy_level") for n in g.node if n.op_type == "MatMulNBits"}
    cfg = onnx_engine.cfg
    for i in range(cfg.n_layers):
        assert (levels[f"l{i}.qkv"], levels[f"l{i}.wo"], levels[f"l{i}.gate_up"], levels[f"l{i}.down"]) == (0, 0, 4, 4)
    assert levels["lm_head"] == 4 and len(levels) == 4 * cfg.n_layers + 1
    eng = OnnxEngine(d, quantize="gguf-q8")
    for ids in chat_prompt_ids:
        a, _ = onnx_engine.prefill(ids)
        b, _ = eng.prefill(ids)
        assert 0 < np.abs(a - b).max() < 2.0 and np.corrcoef(a, b)[0, 1] > 0.998
        # gguf's greedy token is q8's too up to a near-tie (first-token gaps of 0.02 logit occur)
        assert float(b.max() - b[int(a.argmax())]) < 0.5


def test_variant_revision_decides_reexport():
    """A manifest entry is current only at its variant's revision (absent = 1): an older gguf or
    gguf-q8 export is re-made, the other variants' files are kept."""
    from relayinfer.cloud.export import _current

    files = {"model.gguf.onnx": "a", "model.gguf-q8.onnx": "b", "model.fp32.onnx": "c"}
    assert _current({"files": files}, "model.fp32.onnx")
    assert not _current({"files": files}, "model.gguf.onnx")
    assert not _current({"files": files}, "model.gguf-q8.onnx")
    assert _current({"files": files, "revisions": {"model.gguf.onnx": 2}}, "model.gguf.onnx")
    assert _current({"files": files, "revisions": {"model.gguf-q8.onnx": 2}}, "model.gguf-q8.onnx")
    assert not _current({"files": {"model.gguf.onnx": "a"}, "revisions": {"model.gguf-q8.onnx": 2}},
                        "model.fp32.onnx")  # never exported
