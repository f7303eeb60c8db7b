"""The cloud engine on the GGUF file's own 4-bit blocks (`weights='gguf'`, `llama.BlockLinear`):
the kernel computes the file's numbers, rows independently of the batch, the model stays close to
the fp32 one on real chat prompts, and every combination it cannot run is refused naming why."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from relayinfer.cloud.models.llama import BlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not BlockLinear.available(), reason="this torch has no CPU int4 kernel")


@pytest.fixture(scope="module")
def gguf_engine(model_path):
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    return TorchEngine(model_path, threads=1, weights="gguf")


def _file_blocks(model_path, name: str):
    """`ggml_blocks.Blocks` of one GGUF tensor of the model file."""
    from relayinfer.cloud.ggml_blocks import decompose
    from relayinfer.protocol.model.model_file import open_gguf

    t = next(t for t in open_gguf(model_path).tensors if t.name == name)
    k, n = int(t.shape[0]), int(t.shape[1])
    return decompose(np.asarray(t.data).reshape(n, -1), t.tensor_type.name, k), t.tensor_type.name


def test_block_linear_computes_the_files_q4_1_blocks(model_path):
    """On layer 3's gate projection (Q4_1 in this file): the output is x (rounded to bf16) times
    the file's own q with its scales and offsets (rounded to bf16), computed in float64, then
    rounded to bf16 (the kernel's output dtype); the dense fp32 product differs only by that
    rounding (~1e-2 relative); and a row's output does not depend on how many rows are in the call."""
    blocks, kind = _file_blocks(model_path, "blk.3.ffn_gate.weight")
    assert kind == "Q4_1" and blocks.bits == 4 and blocks.offset is not None
    lin = BlockLinear(blocks)
    n, k = lin.out_features, lin.in_features
    assert (n, k) == (blocks.q.shape[0], blocks.q.shape[1] * 32)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = lin(x)
        rows = torch.cat([lin(x[i:i + 1]) for i in range(7)])
    assert y.dtype == torch.float32 and y.shape == (7, n)
    assert torch.equal(rows, y)  # batch-invariant rows
    bf = lambda a: torch.from_numpy(np.asarray(a, np.float32)).bfloat16().double()  # noqa: E731
    w = (bf(blocks.scale)[..., None] * (torch.from_numpy(blocks.q.astype(np.float64)) - 8)
         + bf(blocks.offset)[..., None]).reshape(n, k)
    exact = x.bfloat16().double() @ w.T
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4 * exact.abs().max()).all()
    assert torch.equal(y, y.bfloat16().float())  # a bf16 result
    dense = x.double() @ torch.from_numpy(blocks.dense()).double().T
    rel = ((y.double() - dense).norm() / dense.norm()).item()
    assert 1e-4 < rel < 2e-2, rel  # bf16 rounding of x and the scales: present, and small


def test_block_linear_refuses_8bit_blocks(model_path):
    blocks, kind = _file_blocks(model_path, "token_embd.weight")
    assert kind == "Q8_0"
    with pytest.raises(ValueError, match="4-bit blocks of 32, got 8-bit"):
        BlockLinear(blocks)
    q4, _ = _file_blocks(model_path, "blk.0.ffn_up.weight")
    odd = type(q4)(4, 32, q4.q[:17], q4.scale[:17], q4.offset[:17])  # 17 rows: the kernel packs 16 at a time
    with pytest.raises(ValueError, match="output features a multiple of 16, got 17"):
        BlockLinear(odd)


def test_gguf_engine_is_close_to_float32_on_chat_prompts(torch_engine, gguf_engine, tokenizer):
    """Every layer linear of this Q4_1 file runs on its blocks (4 per layer, fused), the Q8_0 head stays
    dense; on real chat prompts the logits at every position pick the fp32 model's top-1 token at
    >= 95 % of positions with a mean KL(fp32 || gguf) below 5e-3 nats (measured here: >= 0.97 and
    <= 1.5e-3); prompts of another model file's tensors are not needed for this."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    m = gguf_engine.model
    assert gguf_engine.weights == "gguf" and torch_engine.weights == "fp32"
    assert sum(isinstance(x, BlockLinear) for x in m.modules()) == 4 * m.cfg.n_layers  # Q/K/V, gate/up fused
    assert not isinstance(m.lm_head, BlockLinear)
    for ids in chitchat_prompts_by_length(tokenizer, [40, 120, 300], per_length=1, seed=3):
        a = torch_engine.forward(ids, torch_engine.new_cache(len(ids)), last_only=False).double()
        b = gguf_engine.forward(ids, gguf_engine.new_cache(len(ids)), last_only=False).double()
        assert torch.isfinite(b).all() and not torch.equal(a, b)
        agree = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kl = (la.exp() * (la - lb)).sum(-1).mean().item()
        assert agree >= 0.95 and kl < 5e-3, (len(ids), agree, kl)


def test_weight_formats_it_cannot_run_are_refused(torch_engine):
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.models.llama import check_weights_fit

    check_weights_fit("gguf", "cpu", torch.float32)
    check_weights_fit("fp32", "cuda:0", torch.bfloat16)
    with pytest.raises(ValueError, match="weights 'int4' is not supported; choose one of fp32, gguf"):
        check_weights_fit("int4", "cpu", torch.float32)
    with pytest.raises(ValueError, match="runs on the CPU only.*not on cuda:0"):
        check_weights_fit("gguf", "cuda:0", torch.float32)
    with pytest.raises(ValueError, match="dtype torch.bfloat16 is not supported with it"):
        TorchEngine(torch_engine.model_path, weights="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="a model passed in keeps its own"):
        TorchEngine(model=torch_engine.model, weights="gguf")


def test_cloud_serve_refuses_gguf_weights_in_bfloat16_before_loading(monkeypatch):
    """`cloud serve --weights gguf --dtype bfloat16` exits 2 with one line naming --weights, before
    the device model export or the weights load; an unknown format too, on `pd serve` as well."""
    from typer.testing import CliRunner

    import relayinfer.sdk.cli as cli
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "__init__", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(cli, "_ensure_device_model", lambda *a, **k: pytest.fail("exported before the check"))
    for extra, msg in ((["--dtype", "bfloat16"], "error: --weights: weights 'gguf' keeps float32 activations"),
                       ([], None)):
        args = ["cloud", "serve", "--port", "0", "--http-port", "0", "--weights", "gguf" if extra else "q4",
                "--duration-s", "0", *extra]
        res = CliRunner(env={"COLUMNS": "200"}).invoke(cli.app, args)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stderr)
        assert lines[0].startswith(msg or "error: --weights: weights 'q4' is not supported"), lines[0]
    # `pd serve` takes the same flag and refuses the same way, before Ray or the model starts
    res = CliRunner(env={"COLUMNS": "200"}).invoke(cli.app, ["pd", "serve", "--port", "0", "--http-port", "0",
                                                             "--weights", "q4", "--duration-s", "0"])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stderr)
    assert lines[0].startswith("error: --weights: weights 'q4' is not supported; choose one of fp32, gguf"), lines[0]


def test_what_ray_actors_rebuild_a_gguf_model_from_runs_the_same_blocks(model_path, gguf_engine, chat_prompt_ids):
    """P/D actors rebuild the driver's model from `ray_pool.model_weights` (the kernel's operands
    are not in `state_dict`): every `BlockLinear` comes back with the file's own q (read back from
    the packed operand) and the same operands bit for bit, and the rebuilt engine's greedy tokens
    equal the driver's."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.pd.ray_pool import build_model, model_weights
    from relayinfer.protocol.model.decoding import SamplingParams

    cfg, dense, blocks = model_weights(gguf_engine.model)
    assert len(blocks) == 4 * cfg.n_layers and not any(k.endswith((".packed", ".scales_and_zeros")) for k in dense)
    file_up, _ = _file_blocks(model_path, "blk.0.ffn_up.weight")  # not Q/K: those rows are un-permuted
    assert np.array_equal(blocks["layers.0.gate_up"].q[cfg.ffn_dim:], file_up.q)
    rebuilt = build_model(cfg, dense, blocks)
    old = {n: m for n, m in gguf_engine.model.named_modules() if isinstance(m, BlockLinear)}
    new = {n: m for n, m in rebuilt.named_modules() if isinstance(m, BlockLinear)}
    assert old.keys() == new.keys()
    for n, m in old.items():
        assert torch.equal(m.packed, new[n].packed) and torch.equal(m.scales_and_zeros, new[n].scales_and_zeros), n
        assert (m.bias is None) == (new[n].bias is None)
    again = TorchEngine(model=rebuilt, threads=1)
    assert again.weights == "gguf"
    params = SamplingParams(max_new_tokens=16)
    for ids in chat_prompt_ids[:2]:
        assert again.generate(ids, params).token_ids == gguf_engine.generate(ids, params).token_ids


def test_fused_block_linears_compute_the_separate_layers_bits(model_path, gguf_engine):
    """Q/K/V and gate/up run as one `BlockLinear` each (`llama.FUSED`): at 1, 5 and 300 rows its
    output columns are bit for bit those of the separate layers built from the file's tensors."""
    from relayinfer.cloud.models.llama import _unpermute

    layer, cfg = gguf_engine.model.layers[5], gguf_engine.model.cfg
    sep = []
    for name, heads in (("attn_q", cfg.n_heads), ("attn_k", cfg.n_kv_heads), ("attn_v", 0), ("ffn_gate", 0),
                        ("ffn_up", 0)):
        b, _ = _file_blocks(model_path, f"blk.5.{name}.weight")
        if heads:  # the engine's rotary layout
            b = type(b)(4, 32, _unpermute(b.q, heads), _unpermute(b.scale, heads), _unpermute(b.offset, heads))
        sep.append(BlockLinear(b))
    from relayinfer.cloud.models.llama import set_block_linear

    with pytest.raises(ValueError, match="attn.wq is part of this layer's fused attn.wqkv; set attn.wqkv instead"):
        set_block_linear(layer, "attn.wq", sep[0])  # the forward would never read it
    set_block_linear(layer, "gate_up", layer.gate_up)  # setting a fused key again replaces it
    for rows in (1, 5, 300):
        x = torch.randn(1, rows, cfg.dim, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            assert torch.equal(layer.attn.wqkv(x), torch.cat([lin(x) for lin in sep[:3]], -1)), rows
            assert torch.equal(layer.gate_up(x), torch.cat([lin(x) for lin in sep[3:]], -1)), rows
