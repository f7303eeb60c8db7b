"""Faults of the cloud engine's dtype / device options (bfloat16 / float16 weights and KV cache,
odd --device / --dtype values), each found by using them and kept here as a regression test."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_rope_table_stays_float32_in_half_precision(torch_engine):
    """A bfloat16 / float16 model keeps RoPE's inverse frequencies in float32: the bf16 table
    rounded them by up to 0.3 % and layer 0's keys at positions 900-1000 were 18 % (relative
    norm) off the float32 model's instead of bf16 rounding (~0.4 %, as at positions 0-100)."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.models.llama import rope_bases

    ids = [(i * 7919) % 40000 + 100 for i in range(1000)]
    ref = torch_engine.new_cache(len(ids))
    torch_engine.forward(ids, ref)
    for dtype, tol in (("bfloat16", 0.01), ("float16", 0.002)):
        half = TorchEngine(torch_engine.model_path, threads=1, dtype=dtype)
        assert half.model.inv_freq.dtype == torch.float32
        assert torch.equal(half.model.inv_freq, rope_bases(half.cfg))
        # Layer 0's keys depend on the embeddings and block 0 only: the other blocks are dropped
        # from the half model (half-precision matmuls are slow on CPU).
        half.model.layers = half.model.layers[:1]
        kv = half.new_cache(len(ids))
        half.forward(ids, kv)
        a, b = ref.k[0, 0, :, 900:1000], kv.k[0, 0, :, 900:1000].float()
        assert ((a - b).norm() / a.norm()).item() < tol


@pytest.mark.parametrize("device", ["meta", "xla", "gpu", "", "CPU", "mps"])
def test_cloud_serve_refuses_a_device_it_cannot_run_on(device, monkeypatch):
    """`cloud serve --device meta|xla|gpu|''|CPU|mps` exits 2 with one line naming --device and
    the choices, before any model loads (it passed the check, then the model load or the warm-up
    died with a torch traceback: 'Cannot copy out of meta tensor', 'not linked with support for
    xla devices')."""
    from typer.testing import CliRunner

    from relayinfer.cloud.engine.torch_engine import TorchEngine, pick_device
    from relayinfer.sdk.cli import app

    monkeypatch.setattr(TorchEngine, "__init__", lambda *a, **k: pytest.fail("the model loaded before the check"))
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["cloud", "serve", "--port", "0", "--http-port", "0", "--device", device, "--duration-s", "0"])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stderr)
    assert lines[0].startswith("error: --device") and "choose auto, cpu, cuda" in lines[0], lines[0]
    assert pick_device("cpu:0") == pick_device("cpu") == "cpu"


def test_gemma3_float16_is_refused_and_bfloat16_serves_under_its_name():
    """Gemma 3's residual stream reaches |x| ~ 1e5 (layer 7 of gemma3-270m on a chat prompt),
    past float16's 65504: every logit came out NaN (every answer one token id). The engine
    refuses float16 for it before loading, naming the dtype and what runs instead; bfloat16
    runs it with finite logits."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    with pytest.raises(ValueError, match=r"dtype float16 .*gemma3.*bfloat16 or float32"):
        TorchEngine("gemma3-270m", threads=1, dtype="float16")
    bf = TorchEngine("gemma3-270m", threads=1, dtype="bfloat16")
    logits, _ = bf.prefill(bf.tokenizer.encode_chat("Write a haiku about the sea."))
    assert logits.dtype.name == "float32" and bool((abs(logits) < 1e4).all())
    served_model_id_names_the_model(bf)


def served_model_id_names_the_model(gemma):
    """A cloud service over Gemma 3 names it in /healthz and /v1/models ('gemma3-270m'; it said
    'smollm2-135m-instruct', the default model's id, whatever --model was); the default model keeps
    its id and any other file is its stem."""
    from pathlib import Path

    from relayinfer.cloud.serve.service import CloudService, model_id
    from relayinfer.protocol.model.model_file import default_model_path

    svc = CloudService(gemma, gemma.fingerprint)
    assert svc.model_name == "gemma3-270m" and svc.health_response(True)[0]["model"] == "gemma3-270m"
    assert model_id(default_model_path()) == "smollm2-135m-instruct"
    assert model_id(Path("/models/Qwen2.5-0.5B-Instruct-Q8_0.gguf")) == "qwen2.5-0.5b-instruct-q8_0"


def test_cloud_serve_refuses_float16_gemma3_before_loading(monkeypatch):
    """`cloud serve --model gemma3-270m --dtype float16` exits 2 with one line naming --dtype,
    before the device model export or the weights load."""
    from typer.testing import CliRunner

    import relayinfer.sdk.cli as cli
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "__init__", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(cli, "_ensure_device_model", lambda *a, **k: pytest.fail("exported before the check"))
    res = CliRunner(env={"COLUMNS": "200"}).invoke(cli.app, [
        "cloud", "serve", "--port", "0", "--http-port", "0", "--model", "gemma3-270m", "--dtype", "float16",
        "--duration-s", "0"])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stderr)
    assert lines[0].startswith("error: --dtype: dtype float16 cannot run gemma3") and "bfloat16 or float32" in lines[0]


def test_prompt_scores_of_a_bfloat16_model_are_float32_sums(torch_engine):
    """Refinement's importance scores (`prefill_scored`) of a bfloat16 engine are summed in
    float32: the bf16 sums tied 54 of a 259-token prompt's positions (205 distinct values), so
    the kept half was picked among ties; now every position has its own score and the kept half
    is the float32 model's but for a few positions."""
    import numpy as np

    from relayinfer.cloud.engine.torch_engine import TorchEngine

    half = TorchEngine(torch_engine.model_path, threads=1, dtype="bfloat16")
    ids = torch_engine.tokenizer.encode_chat(
        "Explain in two sentences why the sky is blue. Then tell me a story about a robot. " * 12)
    _, _, ref = torch_engine.prefill_scored(ids)
    _, _, got = half.prefill_scored(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids),)
    assert len(np.unique(got)) >= 0.98 * len(ids)
    k = len(ids) // 2
    kept = set(np.argsort(-ref, kind="stable")[:k]) & set(np.argsort(-got, kind="stable")[:k])
    assert len(kept) >= 0.97 * k
