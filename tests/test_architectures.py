"""Every supported architecture and tensor type on both sides, on tiny synthetic GGUF files
(`tests/gguf_synth.py`: random weights, seconds to run): the device graph's MatMulNBits blocks stand
for exactly the file's weights, the ONNX device model and the torch engine agree token for token and
in logits, and both agree with transformers' own GGUF loader (an independent reference)."""
from __future__ import annotations

import numpy as np
import pytest

from gguf_synth import TYPES, WINDOW, write_tiny
from conftest import CloudFirstClient

PROMPT = "the rain in spain stays mainly on the plain and the north wind howls at night"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_decomposition_is_the_files_weights(kind):
    """`decompose` (q, per-block scale and offset) reproduces gguf-py's dequantization of random
    valid blocks of each type (within one float32 ulp of the larger weights)."""
    import gguf

    from relayinfer.cloud.ggml_blocks import BLOCK_BYTES, decompose

    rng = np.random.default_rng(1)
    per, size = BLOCK_BYTES[kind]
    n, k = 6, 512
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
    for off in halves[kind]:  # finite fp16 scales
        raw[..., off:off + 2] = rng.uniform(-0.1, 0.1, size=(n, k // per)).astype(np.float16).view(np.uint8).reshape(
            n, k // per, 2)
    raw = raw.reshape(n, -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    b = decompose(raw, kind, k)
    assert b.bits in (4, 8) and b.q.max() < 2 ** b.bits and b.q.shape == (n, k // b.block, b.block)
    np.testing.assert_allclose(b.dense(), ref, rtol=0, atol=np.abs(ref).max() * 2 ** -22)
    assert b.packed().shape == (n, k // b.block, b.block * b.bits // 8)
    assert decompose(raw, "F16", k) is None
    if b.bits == 8:  # the 8-bit blocks as two 4-bit halves (the device's level-0 output head): the same weights
        from relayinfer.cloud.ggml_blocks import split_nibbles

        hi, lo = split_nibbles(b)
        assert hi.bits == lo.bits == 4 and hi.q.max() < 16 and lo.q.max() < 16 and lo.offset is None
        tol = 0 if b.offset is None else np.abs(ref).max() * 2 ** -22  # exact unless an offset is added to 8 s
        np.testing.assert_allclose(hi.dense() + lo.dense(), b.dense(), rtol=0, atol=tol)
    else:
        from relayinfer.cloud.ggml_blocks import split_nibbles

        with pytest.raises(ValueError, match="takes 8-bit blocks, got 4-bit"):
            split_nibbles(b)


CASES = [("llama", "Q4_K"), ("llama", "F16"), ("qwen2", "Q5_0"), ("qwen2", "BF16"), ("qwen2", "Q4_0"),
         ("gemma3", "Q8_0"), ("gemma3", "Q4_K"), ("gemma3", "Q5_K"), ("gemma3", "Q6_K"), ("gemma3", "Q4_1"),
         ("gemma3", "F32")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(arch, kind):
        if (arch, kind) not in made:
            made[arch, kind] = write_tiny(tmp_path_factory.mktemp(f"{arch}-{kind}") / f"tiny-{arch}-{kind}.gguf",
                                          arch, kind)
        return made[arch, kind]
    return get


def _greedy(engine, ids, n):
    logits, kv = engine.prefill(ids)
    first, out = np.asarray(logits, dtype=np.float32), []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits, kv = engine.decode(t, kv)
    return out, first


@pytest.mark.parametrize("arch,kind", CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_torch_engine_and_onnx_device_agree(tiny, arch, kind):
    """Greedy tokens equal and first-step logits within 2e-3 (relative to their range) of the torch
    engine (dequantized fp32) and the ONNX device model (the file's blocks; F16 / BF16 dense), on
    a prompt longer than Gemma 3's sliding window here."""
    from relayinfer.protocol.model.model_file import open_gguf, read_config
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.engines import load_engine

    path = tiny(arch, kind)
    cfg = read_config(open_gguf(path))
    assert cfg.arch == arch
    ids = Tokenizer.from_gguf(path, use_cache=False).encode_prompt(PROMPT)
    if arch == "gemma3":
        assert len(ids) > 3 * WINDOW and [cfg.window(i) for i in range(cfg.n_layers)] == [WINDOW] * 5 + [0]
    torch_tokens, torch_logits = _greedy(load_engine("torch", path, threads=1), ids, 12)
    onnx_tokens, onnx_logits = _greedy(load_engine("onnx", path), ids, 12)
    span = float(torch_logits.max() - torch_logits.min())
    assert np.abs(torch_logits - onnx_logits).max() <= 2e-3 * span
    assert onnx_tokens == torch_tokens


@pytest.mark.parametrize("arch,kind", [("llama", "Q4_1"), ("qwen2", "Q4_0"), ("gemma3", "Q4_K"), ("llama", "Q8_0")])
def test_gguf_weights_run_every_4bit_layer_on_its_blocks(tiny, arch, kind):
    """`weights='gguf'` on each architecture and 4-bit type: every layer linear runs on a
    `BlockLinear` over the file's blocks, Q/K/V and gate/up each as one (4 per layer; Q/K rows
    un-permuted for Llama, Qwen2's Q/K/V biases kept in order)
    and the first-step logits stay within 1 % of their range of the fp32 engine's (measured <= 0.25 %; bf16 inputs into
    the matmuls; a wrong row order would be far off); a file without 4-bit layers (Q8_0) is refused
    naming its types."""
    import torch

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.models.llama import BlockLinear
    from relayinfer.protocol.model.tokenizer import Tokenizer

    path = tiny(arch, kind)
    if kind == "Q8_0":
        with pytest.raises(ValueError, match="no layer linear in 4-bit blocks.*Q8_0; use weights 'fp32'"):
            TorchEngine(path, threads=1, weights="gguf")
        from typer.testing import CliRunner

        import relayinfer.sdk.cli as cli

        # the command line finds it from the file's tensor types, before any export or load
        mp = pytest.MonkeyPatch()
        mp.setattr(cli, "_ensure_device_model", lambda *a, **k: pytest.fail("exported before the check"))
        mp.setattr(TorchEngine, "__init__", lambda *a, **k: pytest.fail("the model loaded before the check"))
        try:
            for cmd in ("cloud", "pd"):
                res = CliRunner(env={"COLUMNS": "300"}).invoke(cli.app, [cmd, "serve", "--port", "0", "--http-port",
                                                                         "0", "--weights", "gguf", "--model", str(path)])
                lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
                assert res.exit_code == 2 and len(lines) == 1, (cmd, res.exit_code, res.stderr)
                assert lines[0].startswith("error: --weights: weights 'gguf': this file has no layer linear") and \
                    "its layer linears are Q8_0" in lines[0], lines[0]
        finally:
            mp.undo()
        return
    fp32, blk = TorchEngine(path, threads=1), TorchEngine(path, threads=1, weights="gguf")
    assert blk.weights == "gguf" and fp32.weights == "fp32"
    assert sum(isinstance(m, BlockLinear) for m in blk.model.modules()) == 4 * blk.cfg.n_layers  # Q/K/V, gate/up fused
    attn, c = blk.model.layers[0].attn, blk.cfg
    assert attn.wqkv.out_features == (c.n_heads + 2 * c.n_kv_heads) * c.head_dim and not hasattr(attn, "wq")
    if blk.cfg.qkv_bias:
        assert attn.wqkv.bias is not None and torch.equal(attn.wqkv.bias[-c.n_kv_heads * c.head_dim:],
                                                          fp32.model.layers[0].attn.wv.bias)
    ids = Tokenizer.from_gguf(path, use_cache=False).encode_prompt(PROMPT)
    a, b = fp32.prefill(ids)[0], blk.prefill(ids)[0]
    span = float(a.max() - a.min())
    assert np.isfinite(b).all() and 0 < np.abs(a - b).max() <= 0.01 * span, (np.abs(a - b).max(), span)
    assert torch.equal(torch.from_numpy(blk.prefill(ids)[0]), torch.from_numpy(b))  # deterministic


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_torch_engine_equals_transformers_on_the_same_file(tiny, arch):
    """transformers' GGUF loader (its own dequantization and model code) gives the same greedy
    tokens and logits within 1e-4 of their range as the torch engine, and the same prompt ids."""
    import torch
    transformers = pytest.importorskip("transformers")

    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.engines import load_engine

    path = tiny(arch, "Q8_0")
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = Tokenizer.from_gguf(path, use_cache=False).encode_prompt(PROMPT)
    assert hf_tok(PROMPT).input_ids == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        ref_logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
    tokens, logits = _greedy(load_engine("torch", path, threads=1), ids, 12)
    assert np.abs(logits - ref_logits).max() <= 1e-4 * float(ref_logits.max() - ref_logits.min())
    assert tokens == ref


def test_sentencepiece_ids_equal_transformers(tiny):
    """The SentencePiece vocabulary (byte fallback, merges recovered from the vocabulary) encodes
    and decodes as transformers' GGUF tokenizer does, including bytes outside the vocabulary."""
    transformers = pytest.importorskip("transformers")
    from relayinfer.protocol.model.tokenizer import Tokenizer

    path = tiny("gemma3", "Q8_0")
    ours, hf = Tokenizer.from_gguf(path, use_cache=False), transformers.AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name)
    for text in [PROMPT, "  two  spaces", "Ünïcödé ✓ 東京", "tab\there\nnew line", "", "a <bos> in the text"]:
        ids = ours.encode(text)  # control tokens written in the text matched, as transformers does
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == text == hf.decode(ids)
        dec = ours.stream_decoder()
        assert "".join(dec.push(i) for i in ids) == text.replace("<bos>", "")  # a control token shows nothing


def test_every_listed_type_writes(tmp_path):
    """The synthetic writer covers every tensor type the issue lists (the cases above draw from it)."""
    from relayinfer.protocol.model.model_file import open_gguf

    assert set(TYPES) >= {k for _, k in CASES}
    r = open_gguf(write_tiny(tmp_path / "t.gguf", "llama", "Q6_K"))
    assert {t.tensor_type.name for t in r.tensors} == {"F32", "Q8_0", "Q6_K"}


PROMPTS = ["The capital of France is", "Once upon a time, there was a little robot who", "def fibonacci(n):\n",
           "Hello! How are you today? I am", "The three primary colors are", "Water boils at"]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_pd_hand_off_and_batched_engine_equal_the_single_request_engine(tiny, arch):
    """P/D and the batching engine on each non-llama architecture: a prompt longer than Gemma 3's
    sliding window here (and a second one sharing its first blocks, a prefix-cache hit) prefilled
    on a prefill instance, its KV moved (contiguous and block-fixed) to a decode instance: the
    greedy tokens equal the batching engine's and the single-request engine's."""
    import asyncio

    from relayinfer.cloud.engine.llm_engine import LLMEngine
    from relayinfer.cloud.pd.instance import Instance, InstanceConfig
    from relayinfer.protocol.model.decoding import SamplingParams
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.engines import load_engine

    path = tiny(arch, "Q8_0")
    engine = load_engine("torch", path, threads=1)
    a = Tokenizer.from_gguf(path, use_cache=False).encode_prompt(PROMPT)
    prompts, params = [a, a[:len(a) // 2 + 16] + a[:9]], SamplingParams(max_new_tokens=8)
    single = [_greedy(engine, ids, 8)[0] for ids in prompts]
    assert LLMEngine(engine, kv_cache_bytes=4 << 20).generate(prompts, params) == single

    async def pd(mode):
        p = Instance(engine, "p", "prefill", InstanceConfig(kv_cache_bytes=4 << 20, transfer=mode))
        d = Instance(engine, "d", "decode", InstanceConfig(kv_cache_bytes=4 << 20))
        try:
            out = []
            for i, ids in enumerate(prompts):
                ho = await p.prefill(f"r{i}", ids, params)
                out.append([ho.new_token] + [o.token_id async for o in d.decode(ho)])
            return out, d.engine.request_stats("r1").prefix_hit_tokens
        finally:
            p.shutdown()
            d.shutdown()

    for mode in ("contiguous", "block-fixed"):
        out, hit = asyncio.run(pd(mode))
        assert out == single and hit >= 16, (mode, hit)


def test_refined_prompt_on_a_model_without_a_chat_template(tiny, monkeypatch):
    """A file with no chat template (plain-text prompts): the template has no scaffold, so the
    cloud's refinement keeps tokens by score (the last window always) and the device prefills the
    refined prompt and completes the split answer. A template whose turns cannot be found gets a
    bad_request naming refine (the device answers alone), not an internal error."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.protocol.model import refine as refine_mod
    from relayinfer.protocol.model.refine import TemplateMarkers
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk import Client
    from relayinfer.sdk.engines import load_engine

    monkeypatch.setattr(refine_mod, "MIN_REFINE_TOKENS", 0)
    path = tiny("gemma3", "Q8_0")
    tok = Tokenizer.from_gguf(path, use_cache=False)
    assert tok.chat_template is None and TemplateMarkers.from_tokenizer(tok).headers == ()
    ids = tok.encode_chat(PROMPT + " " + PROMPT)
    engine = TorchEngine(path, device="cpu", threads=1)
    with ServiceThread(CloudService(engine, engine.fingerprint, step_delay_ms=20.0), http_port=None) as cloud:
        c = CloudFirstClient(cloud_url=cloud.url, engine=load_engine("onnx", path), cloud_budget=4, target_tpot_ms=1.0,
                   kv_handoff=False)
        res = c.complete(ids, max_new_tokens=8, refine=0.5)
        c.close()
    assert res.fault is None and res.mode == "split" and res.device_tokens > 0, res
    assert len(ids) // 2 <= res.device_prompt_tokens < len(ids)
    # a template whose turns cannot be found: the request is refused naming refine, not failed inside
    svc = CloudService(engine, engine.fingerprint)
    monkeypatch.setattr(svc._markers, "get", lambda: (_ for _ in ()).throw(
        ValueError("the chat template does not write the role name 'system'")))
    with ServiceThread(svc, http_port=None) as cloud:
        c = Client(cloud_url=cloud.url, engine=load_engine("onnx", path), cloud_budget=4, kv_handoff=False)
        res = c.complete(ids, max_new_tokens=8, refine=0.5)
        c.close()
    assert res.mode == "device-only" and res.fault == "cloud-error" and res.device_tokens == 8
    assert "[bad_request]: refine: this model's prompts cannot be refined" in res.error


def test_model_summary_is_read_once_per_file_version(tiny, tmp_path, monkeypatch):
    """`relayinfer models` reads a file's metadata once (a 262k vocabulary takes ~20 s): the second
    summary comes from the cache without opening the file; a rewritten file is read again."""
    import json
    import os
    import shutil

    from relayinfer.protocol.model import model_file

    monkeypatch.setenv("RELAYINFER_CACHE", str(tmp_path / "cache"))
    path = shutil.copy(tiny("gemma3", "Q8_0"), tmp_path / "m.gguf")
    first = model_file.model_summary(path, "mine")
    assert first["arch"] == "gemma3" and first["name"] == "mine" and first["quantization"].count("Q8_0")
    real = model_file.open_gguf
    monkeypatch.setattr(model_file, "open_gguf", lambda p: (_ for _ in ()).throw(AssertionError("read again")))
    assert model_file.model_summary(path, "other") == {**first, "name": "other"}
    os.utime(path, ns=(1, 1))  # a new version of the file
    with pytest.raises(AssertionError, match="read again"):
        model_file.model_summary(path)
    monkeypatch.setattr(model_file, "open_gguf", real)
    assert model_file.model_summary(path)["n_layers"] == first["n_layers"]
    memo = tmp_path / "cache" / "model-summaries.json"
    key = next(iter(json.loads(memo.read_text())))
    for junk in ("[1, 2, 3]", "not json", json.dumps({key: {**first, "size_bytes": None, "n_layers": "thirty"}})):
        memo.write_text(junk)  # a damaged cache is ignored (and rewritten), never shown or fatal
        assert model_file.model_summary(path, "mine") == first
    with pytest.raises(model_file.ModelFileError, match="empty model name"):
        model_file.resolve_model_path("  ")
    with pytest.raises(model_file.ModelFileError, match="is a directory"):
        model_file.resolve_model_path(tmp_path)


@pytest.fixture(scope="module")
def gemma():
    """The real Gemma 3 270M GGUF (Q4_K_M) from its wheels (the default set-up installs them)."""
    from relayinfer.protocol.model.errors import ModelFileError
    from relayinfer.protocol.model.model_file import installed_model_path

    try:
        return installed_model_path("gemma3-270m")
    except ModelFileError as e:
        pytest.skip(f"Gemma 3 270M is not installed: {e}")


@pytest.fixture(scope="module")
def gemma_hf(gemma):
    pytest.importorskip("transformers")
    from hf_reference import hf_from_gguf

    return hf_from_gguf(gemma)


def _hf_greedy(model, ids, n):
    import torch

    with torch.inference_mode():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_gemma3_270m_reads_and_tokenizes(gemma):
    """The real file, fast: its description (18 layers, d 640, 4 query / 1 KV heads of 256, sliding
    window 512 on 5 of every 6 layers, RoPE bases 1e6 global / 1e4 local, tied 262k embedding), the
    summary `relayinfer models` prints, and its SentencePiece ids: the ids transformers gives for
    the first prompt (checked live against transformers by the slow test below), and a lossless
    round trip of real chitchat messages."""
    from relayinfer.protocol.model.model_file import model_summary, open_gguf, read_config
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import chitchat_prompt

    cfg = read_config(open_gguf(gemma))
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert [i for i in range(18) if not cfg.window(i)] == [5, 11, 17] and cfg.sliding_window == 512
    assert cfg.rope_thetas == (10000.0, 1e6) and cfg.tied_embeddings and cfg.vocab_size == 262144
    s = model_summary("gemma3-270m")
    assert s["quantization"].startswith("Q4_K_M") and "Q6_K" in s["quantization"] and s["size_bytes"] > 2e8
    tok = Tokenizer.from_gguf(gemma)
    assert tok.chat_template is None and tok.encode_chat(PROMPTS[0]) == [2, 818, 5279, 529, 7001, 563]
    for m in chitchat_prompt(0, max_turns=None):
        ids = tok.encode(m["content"], special=False)
        assert tok.decode(ids) == m["content"] and len(ids) < len(m["content"])


@pytest.mark.slow
def test_gemma3_270m_fidelity_torch_onnx_transformers(gemma, gemma_hf):
    """The first prompt's ids as the fast test expects them; 6 prompts x 48 greedy tokens: the torch
    engine equals transformers; the ONNX device model
    (the file's own Q5_0 / Q8_0 / Q4_K / Q6_K blocks) equals both, or its first divergence is an
    fp32 near-tie (top-2 logits of the torch model within 0.05 there). 2,000 chitchat messages
    tokenize as transformers does."""
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.datasets import chitchat_prompt
    from relayinfer.sdk.engines import load_engine

    hf_tok, hf = gemma_hf
    tok = Tokenizer.from_gguf(gemma)
    assert tok.encode_prompt(PROMPTS[0]) == hf_tok(PROMPTS[0]).input_ids == [2, 818, 5279, 529, 7001, 563]
    msgs, i = [], 0
    while len(msgs) < 2000:  # the first 2,000 messages of the conversations, in order
        msgs += [m["content"] for m in chitchat_prompt(i, max_turns=None)]
        i += 1
    msgs = msgs[:2000]
    assert all(tok.encode(m, special=False) == hf_tok(m, add_special_tokens=False).input_ids for m in msgs)
    torch_engine, onnx_engine = load_engine("torch", gemma, threads=1), load_engine("onnx", gemma)
    for p in PROMPTS:
        ids = tok.encode_prompt(p)
        ref = _hf_greedy(hf, ids, 48)
        ours, _ = _greedy(torch_engine, ids, 48)
        assert ours == ref, p
        dev, _ = _greedy(onnx_engine, ids, 48)
        k = next((i for i, (a, b) in enumerate(zip(dev, ours)) if a != b), None)
        if k is not None:  # an fp32 near-tie where the block matmuls round differently
            logits, kv = torch_engine.prefill(ids + ours[:k])
            top = np.sort(np.asarray(logits))[-2:]
            assert top[1] - top[0] < 0.05, (p, k, top)


@pytest.mark.slow
def test_gemma3_270m_split_equals_cloud_only_and_device_only(gemma, tmp_path, monkeypatch):
    """The main job on Gemma 3: a cloud service running the torch engine on the Gemma file; a device
    with no model of its own fetches the cloud's device model (hash-checked, cached under the model's
    fingerprint, not SmolLM2's) and the greedy split answer equals cloud-only and device-only, token
    for token, with the hand-off inside the cloud budget."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.device.profiles import DeviceProfile
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk import Client

    monkeypatch.setenv("RELAYINFER_CACHE", str(tmp_path))  # the device's cache starts empty
    engine = TorchEngine(gemma, device="cpu", threads=1)
    svc = CloudService(engine, engine.fingerprint, device_model_dir=ensure_device_model(gemma), step_delay_ms=20.0)
    tok = Tokenizer.from_gguf(gemma)
    with ServiceThread(svc) as cloud:
        c = CloudFirstClient(cloud_url=cloud.url, profile=DeviceProfile("test-slow", prefill_ms_per_token=40.0),
                   target_tpot_ms=30.0, cloud_budget=6)
        assert c.fingerprint == engine.fingerprint and str(tmp_path) in str(c.engine.model_dir)
        for p in PROMPTS[:3]:
            ids = tok.encode_prompt(p)
            split = c.complete(ids, max_new_tokens=16)
            cloud_only = c.complete(ids, max_new_tokens=16, mode="cloud-only")
            device_only = c.complete(ids, max_new_tokens=16, mode="device-only")
            assert split.token_ids == cloud_only.token_ids == device_only.token_ids, p
            assert split.mode == "split" and 0 < split.handoff_index <= 6 and split.device_tokens > 0, p


def test_fidelity_yardstick_on_a_tiny_file(tiny, tmp_path):
    """bench/fidelity.py end to end on a tiny file: the fp32 torch reference, the ONNX device model
    of the same blocks (exactly the file's weights: answers equal, gap ~0), the JSON and table."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import fidelity

    assert fidelity.first_divergence([1, 2, 3], [1, 2, 4]) == 2 and fidelity.first_divergence([1, 2], [1, 2, 5]) == 2
    out = tmp_path / "fid.json"
    assert fidelity.main(["--model", str(tiny("llama", "Q8_0")), "--prompts", "2", "--tokens", "6",
                          "--runtimes", "onnx-gguf", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    r = rep["runtimes"]["onnx-gguf"]
    assert rep["prompts"] == 2 and r["equal_answers"] == 2 and r["first_divergence"] == rep["reference_answer_lengths"]
    assert r["logprob_gap_abs_mean"] < 1e-3 and "| onnx-gguf | 2/2 |" in out.with_suffix(".md").read_text()
    assert fidelity.main(["--runtimes", "nope"]) == 2
