"""Tokenizer built from the GGUF file's own vocabulary, merges and chat template.

Torch-free (the `tokenizers` library plus jinja2), so the device tokenizes locally and only token
ids travel. Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the GGUF stores tokens already spelt
in GPT-2's byte-to-unicode alphabet, so vocabulary and merges load as they are.

Pre-tokenization follows `tokenizer.ggml.pre`. For `smollm` (SmolLM/SmolLM2) it is llama.cpp's
`LLAMA_VOCAB_PRE_TYPE_SMOLLM` and the original `tokenizer.json` of HuggingFaceTB/SmolLM2: digits
split one by one, then GPT-2's regex. The tests check ids against `transformers`' GGUF tokenizer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import json
from pathlib import Path

from .errors import UnsupportedModelError
from .model_file import field as gguf_field
from .model_file import model_cache_dir, open_gguf, resolve_model_path

_CONTROL = 3  # llama.cpp token type CONTROL
_USER_DEFINED = 4

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


class Tokenizer:
    """Byte-level BPE tokenizer + chat template from a GGUF file.

    Attributes:
        vocab_size: number of token ids.
        eos_id / bos_id: from `tokenizer.ggml.eos_token_id` / `bos_token_id`.
        special_ids: ids of CONTROL tokens (chat-template markers such as `<|im_start|>`).
    """

    def __init__(self, backend, chat_template: str | None, bos_id: int, eos_id: int):
        """Wrap a `tokenizers.Tokenizer` (`backend`) whose added special tokens are the GGUF's
        CONTROL tokens; use `from_gguf` or `load` rather than this."""
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(chat_template)

    @staticmethod
    def build_backend(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str):
        """A `tokenizers.Tokenizer`: byte-level BPE over `tokens`/`merges` with the pre-tokenizer
        named by `tokenizer.ggml.pre`, CONTROL tokens added as special, USER_DEFINED as added."""
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact"):  # llama.cpp: \p{N} isolated before GPT-2's regex
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        control = [t for t, ty in zip(tokens, token_types) if ty == _CONTROL]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        return tok

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None, use_cache: bool = True) -> "Tokenizer":
        """Build from a GGUF file (default model when None). Parsing a GGUF's 49k-entry vocabulary
        takes seconds, so the result is kept under `cache_dir()/models/<fingerprint>/` and later
        calls load it from there (`use_cache=False` always rebuilds).

        Raises:
            ModelFileError: missing/corrupt file. UnsupportedModelError: not byte-level BPE.
        """
        path = resolve_model_path(path)
        saved = model_cache_dir(path)
        if use_cache and (saved / "tokenizer.json").is_file():
            return cls.load(saved)
        r = open_gguf(path)
        kind = gguf_field(r, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"unsupported tokenizer {kind!r}: only byte-level BPE ('gpt2') is implemented")
        backend = cls.build_backend(gguf_field(r, "tokenizer.ggml.tokens"), gguf_field(r, "tokenizer.ggml.merges"),
                                    gguf_field(r, "tokenizer.ggml.token_type") or [],
                                    gguf_field(r, "tokenizer.ggml.pre", "default"))
        tok = cls(backend, gguf_field(r, "tokenizer.chat_template"),
                  int(gguf_field(r, "tokenizer.ggml.bos_token_id", 1)),
                  int(gguf_field(r, "tokenizer.ggml.eos_token_id", 2)))
        if use_cache:
            tok.save(saved)
        return tok

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` and `tokenizer_meta.json` (chat template, bos/eos ids) to
        `directory`: what a device needs besides the ONNX file."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"tokenizer.json.{os.getpid()}"
        self._tok.save(str(tmp))
        (d / "tokenizer_meta.json").write_text(json.dumps(
            {"chat_template": self.chat_template, "bos_id": self.bos_id, "eos_id": self.eos_id}))
        os.replace(tmp, d / "tokenizer.json")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Load what `save` wrote. Raises FileNotFoundError if it is not there."""
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        meta = json.loads((d / "tokenizer_meta.json").read_text())
        return cls(HFTokenizer.from_file(str(d / "tokenizer.json")), meta["chat_template"],
                   meta["bos_id"], meta["eos_id"])

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 byte sequences become U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template of the GGUF applied to `messages` (a list of {role, content} dicts).

        Raises:
            ValueError: the model file has no chat template, or a message lacks role/content.
        """
        if self._template is None:
            raise ValueError("the model file has no tokenizer.chat_template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message must be a dict with 'role' and 'content', got {m!r}")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token="", eos_token=self._tok.id_to_token(self.eos_id))

    def encode_chat(self, prompt: str | Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a plain user string (wrapped as one user turn) or a list of messages."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


@dataclass
class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the new text, holding back bytes of an
    incomplete UTF-8 character (an emoji split over byte tokens) until it completes."""

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    _emitted: int = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new
