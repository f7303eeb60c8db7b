"""Tokenizer built from the GGUF file's own vocabulary, merges and chat template.

Torch-free (the `tokenizers` library plus jinja2), so the device tokenizes locally and only token
ids travel. Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the GGUF stores tokens already spelt
in GPT-2's byte-to-unicode alphabet, so vocabulary and merges load as they are. SentencePiece
(`"llama"`, e.g. Gemma 3): BPE with byte fallback over merges recovered from the vocabulary, as
transformers' GGUF loader does (`Tokenizer.build_spm_backend`).

Pre-tokenization follows `tokenizer.ggml.pre` (`SUPPORTED_PRE`; any other value is refused at load
with `UnsupportedModelError` rather than silently split the GPT-2 way). For `smollm` (SmolLM/SmolLM2)
it is llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM` and the original `tokenizer.json` of
HuggingFaceTB/SmolLM2: digits split one by one, then GPT-2's regex; `llama-bpe` and `qwen2` use
llama.cpp's regexes (the same as transformers' GGUF loader). The tests check ids against
`transformers`' GGUF tokenizer.

Control tokens come only from the chat template: `encode_chat` encodes what the template wrote with
special tokens matched and what the messages hold as plain text (a user writing `<|im_end|>` gets the
text, never the control id). `tokenizer.ggml.add_bos_token` / `add_eos_token` are honoured by
`encode_prompt` / `encode_chat` (no second BOS when the template already wrote one), and the
template sees `bos_token` / `eos_token`.
"""
from __future__ import annotations

import codecs
import os
import re
import uuid
from typing import Iterable, Sequence

import json
from pathlib import Path

from relayinfer.protocol.model.errors import UnsupportedModelError
from relayinfer.protocol.model.model_file import field as gguf_field
from relayinfer.protocol.model.model_file import model_cache_dir, open_gguf, resolve_model_path

_CONTROL = 3  # llama.cpp token type CONTROL
_USER_DEFINED = 4

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), as transformers' GGUF loader spells them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before BPE ("gpt2": GPT-2's regex; "digits": each digit
# alone, then GPT-2's regex; otherwise a regex applied before byte-level BPE without GPT-2's)
SUPPORTED_PRE = {"default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "smollm": "digits", "starcoder": "digits",
                 "refact": "digits", "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                 "qwen2": _QWEN2_SPLIT}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: the char a vocabulary entry uses -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


PLAIN_CHAT_TEMPLATE = (
    "{% if messages | length == 1 and messages[0]['role'] == 'user' %}{{ messages[0]['content'] }}"
    "{% else %}{% for m in messages %}{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{{ m['role'] | capitalize }}: {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n\nAssistant:' }}{% endif %}{% endif %}")
"""The chat format of a model file without a chat template (`Tokenizer.render_chat`)."""


def _add_marked(tok, tokens: Sequence[str], token_types: Sequence[int]):
    """`tok` with the vocabulary's CONTROL tokens added as special and USER_DEFINED ones as added
    tokens (matched whole in text, as llama.cpp does); returns it."""
    from tokenizers import AddedToken

    control = [t for t, ty in zip(tokens, token_types) if ty == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


class Tokenizer:
    """Byte-level BPE tokenizer + chat template from a GGUF file.

    Attributes:
        vocab_size: number of token ids.
        eos_id / bos_id: from `tokenizer.ggml.eos_token_id` / `bos_token_id`.
        special_ids: ids of CONTROL tokens (chat-template markers such as `<|im_start|>`).
    """

    def __init__(self, backend, chat_template: str | None, bos_id: int, eos_id: int,
                 add_bos: bool = False, add_eos: bool = False):
        """Wrap a `tokenizers.Tokenizer` (`backend`) whose added special tokens are the GGUF's
        CONTROL tokens; use `from_gguf` or `load` rather than this. `add_bos` / `add_eos`:
        `tokenizer.ggml.add_bos_token` / `add_eos_token` (used by `encode_prompt`, `encode_chat`)."""
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.added_ids = frozenset(added)
        self._plain_backend = None
        names = sorted((t.content for t in added.values()), key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._added_id = {t.content: i for i, t in added.items()}
        self._bytes: list[bytes] | None = None
        self.chat_template = chat_template
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(chat_template or PLAIN_CHAT_TEMPLATE)

    @staticmethod
    def build_backend(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str):
        """A `tokenizers.Tokenizer`: byte-level BPE over `tokens`/`merges` with the pre-tokenizer
        named by `tokenizer.ggml.pre`, CONTROL tokens added as special, USER_DEFINED as added."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        from tokenizers import Regex

        split = SUPPORTED_PRE.get(pre)
        if split is None:
            raise UnsupportedModelError(
                f"unsupported tokenizer.ggml.pre {pre!r}: supported pre-tokenizers are "
                f"{', '.join(sorted(SUPPORTED_PRE))}")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split == "digits":  # llama.cpp: \p{N} isolated before GPT-2's regex
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif split == "gpt2":
            tok.pre_tokenizer = byte_level
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        return _add_marked(tok, tokens, token_types)

    @staticmethod
    def build_spm_backend(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                          arch: str, add_space_prefix: bool):
        """A `tokenizers.Tokenizer` for a SentencePiece vocabulary (`tokenizer.ggml.model` 'llama'):
        BPE with byte fallback (`<0xNN>` tokens) over merges recovered from the vocabulary (a GGUF
        stores none): every split of a token into two tokens, ranked by the merged token's score,
        or for Gemma by its position in the file (Gemma's scores do not follow its merge order),
        as transformers' GGUF loader (`gguf_tokenizer_mapping.gemma_tokenizer`, `generate_merges`)
        and `GemmaTokenizer` build it. Spaces become U+2581 and text is split after each one;
        `add_space_prefix` (Llama 2 style) prepends one U+2581. Gemma stores a token of two or more
        spaces as real spaces: respelled as U+2581s. CONTROL tokens are added as special,
        USER_DEFINED as added."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

        gemma = arch.startswith("gemma")
        tokens = ["\u2581" * len(t) if gemma and " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        rank = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores))
        merges = []
        for tok, score in rank.items():
            local = [(tok[:k], tok[k:], score) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
            merges.extend(local)
        merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        unk = next((t for t, ty in zip(tokens, token_types) if ty == 2), None)  # llama.cpp type UNKNOWN
        bpe = models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True, unk_token=unk,
                         byte_fallback=True)
        tok = HFTokenizer(bpe)
        if gemma:  # GemmaTokenizer: spaces -> U+2581 by the normalizer, no prefix space
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        else:  # LlamaTokenizer: Metaspace, one U+2581 before the first word when the file asks for it
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix and not gemma else []))
        return _add_marked(tok, tokens, token_types)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None, use_cache: bool = True) -> "Tokenizer":
        """Build from a GGUF file (default model when None). Parsing a GGUF's 49k-entry vocabulary
        takes seconds, so the result is kept under `cache_dir()/models/<fingerprint>/` and later
        calls load it from there (`use_cache=False` always rebuilds).

        Raises:
            ModelFileError: missing/corrupt file. UnsupportedModelError: not byte-level BPE (e.g. a
                SentencePiece `llama` vocabulary), or a `tokenizer.ggml.pre` not in `SUPPORTED_PRE`.
        """
        path = resolve_model_path(path)
        saved = model_cache_dir(path)
        if use_cache and (saved / "tokenizer.json").is_file():
            return cls.load(saved)
        r = open_gguf(path)
        kind = gguf_field(r, "tokenizer.ggml.model")
        types = gguf_field(r, "tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            backend = cls.build_backend(gguf_field(r, "tokenizer.ggml.tokens"), gguf_field(r, "tokenizer.ggml.merges"),
                                        types, gguf_field(r, "tokenizer.ggml.pre", "default"))
        elif kind == "llama":
            backend = cls.build_spm_backend(gguf_field(r, "tokenizer.ggml.tokens"),
                                            gguf_field(r, "tokenizer.ggml.scores") or [], types,
                                            str(gguf_field(r, "general.architecture", "")),
                                            bool(gguf_field(r, "tokenizer.ggml.add_space_prefix", True)))
        else:
            raise UnsupportedModelError(
                f"unsupported tokenizer.ggml.model {kind!r}: byte-level BPE ('gpt2') and SentencePiece "
                f"('llama') vocabularies are implemented")
        add_bos_default = kind == "llama"  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
        tok = cls(backend, gguf_field(r, "tokenizer.chat_template"),
                  int(gguf_field(r, "tokenizer.ggml.bos_token_id", 1)),
                  int(gguf_field(r, "tokenizer.ggml.eos_token_id", 2)),
                  bool(gguf_field(r, "tokenizer.ggml.add_bos_token", add_bos_default)),
                  bool(gguf_field(r, "tokenizer.ggml.add_eos_token", False)))
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
            {"chat_template": self.chat_template, "bos_id": self.bos_id, "eos_id": self.eos_id,
             "add_bos": self.add_bos, "add_eos": self.add_eos}))
        os.replace(tmp, d / "tokenizer.json")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Load what `save` wrote. Raises FileNotFoundError if it is not there."""
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        meta = json.loads((d / "tokenizer_meta.json").read_text())
        return cls(HFTokenizer.from_file(str(d / "tokenizer.json")), meta["chat_template"],
                   meta["bos_id"], meta["eos_id"], meta.get("add_bos", False), meta.get("add_eos", False))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`, no BOS/EOS added. `special`: added/control tokens written in the
        text are matched whole (a raw prompt); False encodes every character as plain text.

        Raises:
            TypeError: `text` is not a str or holds a lone surrogate (not encodable as UTF-8).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TypeError(f"text is not valid Unicode ({e.reason} at index {e.start})") from None
        return (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids

    @property
    def _plain(self):
        """The same model without added tokens (built on first use): user text is encoded with it,
        so it never matches a control/added token (transformers splits at added tokens, then encodes
        the pieces the same way)."""
        if self._plain_backend is None:
            from tokenizers import Tokenizer as HFTokenizer

            spec = json.loads(self._tok.to_str())
            spec["added_tokens"] = []
            self._plain_backend = HFTokenizer.from_str(json.dumps(spec))
        return self._plain_backend

    def _with_bos_eos(self, ids: list[int]) -> list[int]:
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        if self.add_eos and (not ids or ids[-1] != self.eos_id):
            ids = ids + [self.eos_id]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """`encode(text)` plus BOS/EOS as the GGUF's `add_bos_token`/`add_eos_token` ask (a raw
        completion prompt, as llama.cpp's server tokenizes it)."""
        return self._with_bos_eos(self.encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for (b"" for a control token: never shown).
        Byte-level BPE: the GPT-2 alphabet mapped back to bytes; SentencePiece (byte fallback):
        U+2581 is a space and `<0xNN>` the byte NN."""
        if self._bytes is None:
            bd = _byte_decoder()
            spm = bool(getattr(self._tok.model, "byte_fallback", False))
            added = self._tok.get_added_tokens_decoder()
            table = []
            for i in range(self.vocab_size):
                t = added.get(i)
                if t is not None:
                    table.append(b"" if t.special else t.content.encode("utf-8"))
                    continue
                s = self._tok.id_to_token(i) or ""
                if spm:
                    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", s)
                    table.append(bytes([int(byte.group(1), 16)]) if byte else s.replace("\u2581", " ").encode("utf-8"))
                else:
                    table.append(bytes(bd[c] for c in s) if all(c in bd for c in s) else s.encode("utf-8"))
            self._bytes = table
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 byte sequences become U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template of the GGUF applied to `messages` (a list of {role, content} dicts).

        A file without `tokenizer.chat_template` (a base model such as Gemma 3 270M) gets
        `PLAIN_CHAT_TEMPLATE`: one user message is the text itself (a completion prompt); several
        messages are a "Role: content" transcript, blank-line separated, ending "Assistant:" when
        `add_generation_prompt`. No model's own markup is guessed.

        Raises:
            ValueError: a message lacks role/content.
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message must be a dict with 'role' and 'content', got {m!r}")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self._tok.id_to_token(self.bos_id) or "",
                                     eos_token=self._tok.id_to_token(self.eos_id) or "")

    def encode_chat(self, prompt: str | Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a plain user string (wrapped as one user turn) or a list of messages.

        Only the template's own markup can produce control/added token ids: each message's content
        is rendered between two random markers, and the rendered text is split into what the
        template wrote (added tokens matched) and what the messages hold (plain text). The pieces
        between two matched added tokens are encoded as one string, as transformers does, so ordinary
        messages get exactly `encode(render_chat(messages))`. BOS/EOS follow `add_bos`/`add_eos`.

        Raises:
            ValueError: no chat template, a malformed message, or a template that changes the
                content it is given (the markers would not survive).
            TypeError: content that is not valid Unicode (a lone surrogate).
        """
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat message must be a dict with a string 'content', got {m!r}")
            try:
                m["content"].encode("utf-8")
            except UnicodeEncodeError as e:
                raise TypeError(f"message content is not valid Unicode ({e.reason} at index {e.start})") from None
        if self._added_re is None:
            return self._with_bos_eos(self.encode(self.render_chat(messages, add_generation_prompt)))
        nonce = uuid.uuid4().hex
        open_, close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked = self.render_chat([{**m, "content": open_ + m["content"] + close} for m in messages],
                                  add_generation_prompt)
        plain = self.render_chat(messages, add_generation_prompt)
        if marked.replace(open_, "").replace(close, "") != plain:
            raise ValueError("the chat template transforms message contents; cannot keep them apart from its markup")
        ids: list[int] = []
        text: list[str] = []  # plain text since the last control/added token
        pos = 0
        while pos < len(marked):
            start = marked.find(open_, pos)
            template = marked[pos:] if start < 0 else marked[pos:start]
            last = 0
            for hit in self._added_re.finditer(template):  # the template's own markup
                text.append(template[last:hit.start()])
                if "".join(text):
                    ids += self._plain.encode("".join(text), add_special_tokens=False).ids
                text = []
                ids.append(self._added_id[hit.group()])
                last = hit.end()
            text.append(template[last:])
            if start < 0:
                break
            end = marked.index(close, start)
            text.append(marked[start + len(open_):end])  # message content: never matched
            pos = end + len(close)
        if "".join(text):
            ids += self._plain.encode("".join(text), add_special_tokens=False).ids
        return self._with_bos_eos(ids)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer, O(1) per token: `push(id)` returns the text the token adds.

    Each token's bytes (`Tokenizer.token_bytes`) go through an incremental UTF-8 decoder, which
    holds back the bytes of an incomplete character (an emoji split over byte tokens) until it
    completes and turns invalid sequences into U+FFFD. Control tokens (`<|im_end|>`, EOS) add no
    text: their ids stay in the answer's token ids. A character still incomplete when the answer
    ends is dropped (never shown), so the joined pushes are the answer's text in every mode;
    `text` holds that join.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        new = self._utf8.decode(self.tokenizer.token_bytes(token_id))
        if new:
            self._parts.append(new)
        return new

    @property
    def text(self) -> str:
        """Everything `push` returned so far, joined."""
        return "".join(self._parts)
