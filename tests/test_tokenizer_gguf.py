"""The GGUF's tokenizer metadata: `add_bos_token` / `add_eos_token`, BOS/EOS in the
chat template, the supported `tokenizer.ggml.pre` types and a clear error for the others.

Model files are made by editing the metadata of the shipped one with `gguf` (tensors left out: the
tokenizer reads metadata only). The comparisons with transformers' GGUF tokenizer load a 49k-token
vocabulary per file and are marked slow; the refusals are cheap and run by default."""
from __future__ import annotations

import pytest

from relayinfer.protocol.model.errors import UnsupportedModelError
from relayinfer.protocol.model.tokenizer import SUPPORTED_PRE, Tokenizer

gguf = pytest.importorskip("gguf")
T = gguf.GGUFValueType

TEXTS = ["Hello 12345 world!\n\n  it's 3.14159 ok", "CJK 你好世界 and émojis 🤖👍🏽", "def f(x):\n\treturn x**2  # sq\r\n"]


def edited_copy(src, dst, changes: dict):
    """Write `dst`: the metadata of GGUF `src` with `changes` ({key: (value, GGUFValueType)}) applied;
    no tensors."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in changes:
            continue
        vt = T(f.types[0])
        w.add_key_value(k, f.contents(), vt, sub_type=T(f.types[-1]) if vt == T.ARRAY else None)
    for k, (v, vt) in changes.items():
        w.add_key_value(k, v, vt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unknown_pre_and_tokenizer_model_are_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'deepseek-llm'.*supported pre-tokenizers are .*llama-bpe"):
        Tokenizer.build_backend(["a", "b", "ab"], ["a b"], [1, 1, 1], "deepseek-llm")
    assert {"smollm", "llama-bpe", "qwen2", "gpt-2"} <= set(SUPPORTED_PRE)
    sp = tmp_path / "t5.gguf"  # a Unigram vocabulary (llama.cpp's tokenizer model "t5"): not implemented
    w = gguf.GGUFWriter(str(sp), arch="llama")
    w.add_key_value("tokenizer.ggml.model", "t5", T.STRING)
    w.add_key_value("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "▁a"], T.ARRAY, sub_type=T.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'t5'.*byte-level BPE.*SentencePiece"):
        Tokenizer.from_gguf(sp, use_cache=False)


def test_bos_eos_flags(tokenizer):
    import copy

    assert not tokenizer.add_bos and not tokenizer.add_eos  # SmolLM2's file says add_bos_token = false
    t = copy.copy(tokenizer)
    t.add_bos, t.add_eos, t.bos_id = True, True, 0
    assert t.encode_prompt("hi") == [0] + tokenizer.encode("hi") + [tokenizer.eos_id]
    t.add_eos = False
    # the chat template starts with <|im_start|>, which is not this BOS: one BOS is added
    assert t.encode_chat("hi") == [0] + tokenizer.encode_chat("hi")


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_pre_types_match_transformers(model_path, tmp_path, transformers_mod, pre):
    f = edited_copy(model_path, tmp_path / f"{pre}.gguf", {"tokenizer.ggml.pre": (pre, T.STRING)})
    ours = Tokenizer.from_gguf(f, use_cache=False)
    hf = transformers_mod.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), (pre, text)


@pytest.mark.slow
def test_add_bos_and_bos_in_template_match_transformers(model_path, tmp_path, transformers_mod, tokenizer):
    template = "{{ bos_token }}" + tokenizer.chat_template
    f = edited_copy(model_path, tmp_path / "bos.gguf", {
        "tokenizer.ggml.add_bos_token": (True, T.BOOL), "tokenizer.ggml.bos_token_id": (0, T.UINT32),
        "tokenizer.chat_template": (template, T.STRING)})
    ours = Tokenizer.from_gguf(f, use_cache=False)
    hf = transformers_mod.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    for text in TEXTS:
        assert ours.encode_prompt(text) == hf.encode(text) == [0] + tokenizer.encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(msgs) == rendered and rendered.startswith("<|endoftext|><|im_start|>")
    ids = ours.encode_chat(msgs)
    assert ids == hf.encode(rendered, add_special_tokens=False) and ids[:2] == [0, 1]  # no second BOS
