"""transformers' reading of a GGUF file (its own GGUF loader, dequantization and model code): the
reference the tests hold our runtimes to, converted once per file and kept on disk.

transformers converts a GGUF in ~30-40 s (the tokenizer and the tensors, in Python), and several
test files need the same reference. The first conversion's result (config, state dict and
tokenizer files, exactly what transformers' loader produced) is kept under
`model_file.cache_dir()/tests-hf/`, keyed by the file's path, size and modification time and
transformers' version; later loads read it back in ~2 s. A file lock makes a second pytest-xdist
worker wait for the first's conversion instead of repeating it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def _key(path: Path) -> str:
    import transformers

    st = path.stat()
    text = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hf_from_gguf(path) -> tuple:
    """(tokenizer, float32 model in eval mode) of transformers for the GGUF file `path`."""
    import torch
    import transformers

    from relayinfer.protocol.model.model_file import cache_dir

    path = Path(path)
    d = cache_dir() / "tests-hf" / _key(path)
    if not (d / "done").exists():
        d.parent.mkdir(parents=True, exist_ok=True)
        with open(d.parent / f"{d.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (d / "done").exists():
                tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                          dtype=torch.float32)
                for old in d.parent.glob("tmp*"):  # a conversion killed half-way (we hold the lock)
                    shutil.rmtree(old, ignore_errors=True)
                tmp = Path(tempfile.mkdtemp(dir=d.parent))
                try:
                    tok.save_pretrained(tmp)
                    model.config.save_pretrained(tmp)
                    model.generation_config.save_pretrained(tmp)
                    torch.save(model.state_dict(), tmp / "state.pt")
                    (tmp / "done").touch()
                    shutil.rmtree(d, ignore_errors=True)
                    os.rename(tmp, d)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                return tok, model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(d)),
                                                          dtype=torch.float32)
    model.load_state_dict(torch.load(d / "state.pt"))
    model.generation_config = transformers.GenerationConfig.from_pretrained(str(d))
    return tok, model.eval()
