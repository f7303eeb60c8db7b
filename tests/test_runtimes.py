"""The real SmolLM2-135M-Instruct on both sides of the split, checked against transformers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from relayinfer.protocol.model.decoding import SamplingParams, generate, sample
from relayinfer.protocol.model.errors import (ModelFileError, PromptTooLongError, UnknownEngineError,
    UnsupportedModelError)
from relayinfer.protocol.model.model_file import open_gguf, read_config
from relayinfer.protocol.model.tokenizer import Tokenizer

TOKENIZER_CASES = [
    "hello  world   three spaces",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF",
    "accents: héllo ça va, naïve façade, Ångström",
    "CJK: 你好世界, 日本語のテキスト, 한국어",
    "emoji: 🤖 👍🏽 👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12345), 3.14159)",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]


@pytest.fixture(scope="module")
def hf(model_path):
    pytest.importorskip("transformers")
    from hf_reference import hf_from_gguf

    return hf_from_gguf(model_path)


def test_config_matches_smollm2(model_path):
    cfg = read_config(open_gguf(model_path))
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tied_embeddings and cfg.vocab_size == 49152
    assert cfg.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # 46,080 bytes per token in fp32


@pytest.mark.parametrize("text", TOKENIZER_CASES)
def test_tokenizer_matches_transformers(hf, tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf[0].encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_chat_template_matches_transformers(hf, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋, 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    text = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.render_chat(messages) == text
    assert tokenizer.encode_chat(messages) == hf[0].encode(text, add_special_tokens=False)
    assert tokenizer.encode_chat("hi")[:3] == [1, 9690, 198]  # <|im_start|>system\n default system turn


def test_tokenizer_cache_roundtrip(tokenizer, model_path, tmp_path):
    tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    rebuilt = Tokenizer.from_gguf(model_path, use_cache=False)
    for text in TOKENIZER_CASES:
        assert loaded.encode(text) == rebuilt.encode(text) == tokenizer.encode(text)


def test_stream_decoder_holds_partial_utf8(tokenizer):
    ids = tokenizer.encode("ok 🤖 done")
    dec = tokenizer.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == "ok 🤖 done"
    assert all("\ufffd" not in p for p in pieces)


def test_torch_greedy_equals_transformers(hf, torch_engine, chat_prompt_ids):
    model = hf[1]
    for ids in chat_prompt_ids:
        ours = torch_engine.generate(ids, SamplingParams(max_new_tokens=32)).token_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=torch_engine.eos_id, pad_token_id=torch_engine.eos_id)
        ref = ref[0, len(ids):].tolist()
        assert len(ours) >= 8
        assert ours == ref[: len(ours)]


def test_torch_logits_match_transformers(hf, torch_engine, chat_prompt_ids):
    ids = chat_prompt_ids[0]
    with torch.no_grad():
        ref = hf[1](torch.tensor([ids])).logits[0, -1].numpy()
    ours, _ = torch_engine.prefill(ids)
    assert np.abs(ours - ref).max() < 1e-3


def test_onnx_equals_torch(onnx_engine, torch_engine, chat_prompt_ids):
    """The default device model (MatMulNBits over the GGUF's own blocks, accuracy_level 0): logits
    within 1e-3 of the fp32 torch reference and the same 32 greedy tokens on every chat prompt."""
    assert onnx_engine.weights == "gguf"
    for ids in chat_prompt_ids:
        a, _ = onnx_engine.prefill(ids)
        b, _ = torch_engine.prefill(ids)
        assert a.shape == b.shape == (49152,)
        assert np.abs(a - b).max() < 1e-3
        params = SamplingParams(max_new_tokens=32)
        assert onnx_engine.generate(ids, params).token_ids == torch_engine.generate(ids, params).token_ids


@pytest.mark.parametrize("engine_name", ["torch_engine", "onnx_engine"])
def test_prefill_then_decode_equals_full_forward(request, engine_name, chat_prompt_ids):
    eng = request.getfixturevalue(engine_name)
    ids = chat_prompt_ids[1]
    logits, kv = eng.prefill(ids[:-6])
    seq = list(ids[:-6])
    for tok in ids[-6:]:  # step by step, then compare each with one full forward over the prefix
        logits, kv = eng.decode(tok, kv)
        seq.append(tok)
        full, _ = eng.prefill(seq)
        assert np.abs(logits - full).max() < 1e-4 * max(1.0, np.abs(full).max())  # fp32 rounding scales with |logit|
    # chunked prefill (as the device does during hand-off) equals one prefill too
    a, kv = eng.prefill(ids[:10])
    a, kv = eng.prefill(ids[10:25], kv)
    a, kv = eng.prefill(ids[25:], kv)
    b, _ = eng.prefill(ids)
    assert np.abs(a - b).max() < 1e-4 * max(1.0, np.abs(b).max())  # fp32 rounding scales with |logit|


def test_seeded_sampling_is_reproducible_and_filters():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_k=5, seed=7)
    draws = [sample(logits, p, i) for i in range(50)]
    assert draws == [sample(logits, p, i) for i in range(50)]
    assert set(draws) <= set(np.argsort(-logits)[:5].tolist()) and len(set(draws)) > 1
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert {sample(logits, nucleus, i) for i in range(20)} == {int(np.argmax(logits))}


def test_seeded_generation_same_on_both_engines(onnx_engine, torch_engine, chat_prompt_ids):
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1234, max_new_tokens=16)
    a = torch_engine.generate(chat_prompt_ids[2], params).token_ids
    assert a == onnx_engine.generate(chat_prompt_ids[2], params).token_ids


# --- bad input -------------------------------------------------------------------------------

def test_missing_model_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        open_gguf(tmp_path / "nope.gguf")


def test_corrupt_model_files(tmp_path, model_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        open_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        from relayinfer.cloud.models.llama import load_llama
        load_llama(truncated)


def test_non_llama_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        read_config(open_gguf(path))


def test_prompt_too_long(torch_engine):
    with pytest.raises(PromptTooLongError, match="exceed the context length of 8192"):
        generate(torch_engine, [1] * 8190, SamplingParams(max_new_tokens=8))


def test_unknown_engine():
    from relayinfer.sdk.engines import load_engine

    with pytest.raises(UnknownEngineError, match="unknown engine 'tensorflow'"):
        load_engine("tensorflow")


def test_cli_generate_json_and_errors(tmp_path):
    exe = shutil.which("relayinfer") or f"{sys.prefix}/bin/relayinfer"
    out = subprocess.run([exe, "generate", "--engine", "onnx", "--json", "--max-new-tokens", "8", "--temperature", "0",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert {"prompt_ids", "token_ids", "text", "prefill_ms", "decode_ms_per_token"} <= res.keys()
    assert len(res["token_ids"]) <= 8 and "Paris" in res["text"]
    bad = subprocess.run([exe, "generate", "--engine", "tensorflow", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown engine 'tensorflow'" in bad.stderr
    missing = subprocess.run([exe, "generate", "--model", str(tmp_path / "x.gguf"), "x"], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "model file not found" in missing.stderr


def test_open_gguf_reads_what_gguf_reads(model_path):
    """`open_gguf`'s reader (a plain view of the memory map, parsed 3x faster) gives gguf's own
    reader's fields and tensors, byte for byte, on the real file."""
    import gguf

    ours, theirs = open_gguf(model_path), gguf.GGUFReader(model_path)
    assert isinstance(ours, gguf.GGUFReader) and list(ours.fields) == list(theirs.fields)
    for k, f in theirs.fields.items():
        assert ours.fields[k].contents() == f.contents(), k
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
