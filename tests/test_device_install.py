"""The torch-free device side: with torch and relayinfer.cloud made unimportable,
the SDK, the CLI module and every device module import, `Client(cloud_url=...)` alone (the Welcome
names the cloud's /v1/device-model) fetches the device model from a real cloud (no local export) and runs a split generation; the CLI's
cloud sub-commands exit 2 naming the extra to install. Also: an interrupted download resumes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.protocol.model.device_model import FORMAT_VERSION

TOKEN = "device-install-token"

# A meta-path finder that makes torch, transformers, gguf and relayinfer.cloud unimportable, as on a
# device that installed only `relayinfer[device]`.
BLOCK = r'''
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "gguf") or name == "relayinfer.cloud" \
                or name.startswith("relayinfer.cloud."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Block())
'''

DEVICE_RUN = BLOCK + r'''
import importlib, json, pkgutil
import relayinfer.sdk, relayinfer.sdk.cli, relayinfer.device, relayinfer.device.profiles
for m in pkgutil.iter_modules(relayinfer.device.__path__):
    importlib.import_module("relayinfer.device." + m.name)
from relayinfer.sdk import Client
from relayinfer.device.profiles import DeviceProfile
cloud_url, http_url, token = sys.argv[1:4]
seen = []
slow = DeviceProfile("test-slow", prefill_ms_per_token=100.0)  # the cloud answers first, however loaded the machine
client = Client(cloud_url=cloud_url, cloud_http_url=http_url or None, token=token, cloud_budget=3, target_tpot_ms=30.0,
                profile=slow,
                progress=lambda name, done, total: seen.append((name, done, total)))
ids = client.prompt_ids("Write a haiku about the sea.")
res = client.complete(ids, max_new_tokens=8)
print(json.dumps({"prompt_ids": ids, "plan": res.plan_reason, "token_ids": res.token_ids, "mode": res.mode, "fault": res.fault,
                  "cloud_tokens": res.cloud_tokens, "device_tokens": res.device_tokens,
                  "fetched": sorted({n for n, _, _ in seen}), "model_dir": str(client.engine.model_dir),
                  "fingerprint": client.fingerprint,
                  "torch": "torch" in sys.modules,
                  "cloud": sorted(m for m in sys.modules if m.startswith("relayinfer.cloud"))}))
'''


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    svc = CloudService(torch_engine, torch_engine.fingerprint, auth_token=TOKEN, device_model_dir=device_model_dir)
    with ServiceThread(svc) as running:
        yield running


def _run(code: str, *args: str, cache, timeout: float = 240.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "RELAYINFER_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_torch_free_device_fetches_the_model_and_splits(cloud, onnx_engine, tmp_path):
    from relayinfer.protocol.model.decoding import SamplingParams

    # no cloud_http_url: the Welcome names where the device model is (Client(cloud_url=...) alone)
    p = _run(DEVICE_RUN, cloud.url, "", TOKEN, cache=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["torch"] is False and out["cloud"] == []
    # the model came from the cloud into the cache keyed by its fingerprint
    assert out["fetched"] == ["config.json", "model.gguf.onnx", "tokenizer.json", "tokenizer_meta.json"]
    assert out["fingerprint"] == cloud.fingerprint
    assert out["model_dir"] == str(tmp_path / "models" / cloud.fingerprint[:16] / f"onnx-v{FORMAT_VERSION}")
    # a real split: the cloud streamed its budget, the device took over, greedy tokens as the device alone
    assert out["mode"] == "split" and out["fault"] is None, out
    assert out["cloud_tokens"] == 3 and out["device_tokens"] == 5
    ref = onnx_engine.generate(out["prompt_ids"], SamplingParams(max_new_tokens=8))
    assert out["token_ids"] == ref.token_ids


def test_cloud_subcommands_name_the_extra_without_torch(tmp_path):
    for argv in (["export"], ["cloud", "serve", "--port", "0", "--http-port", "0"], ["relay", "bench"]):
        code = BLOCK + f"from relayinfer.sdk.cli import app\napp({argv!r}, prog_name='relayinfer')\n"
        p = _run(code, cache=tmp_path, timeout=60)
        assert p.returncode == 2, (argv, p.stderr)
        assert "Traceback" not in p.stderr
        assert "pip install torch==2.13.0, then pip install 'relayinfer[cloud]'" in p.stderr, p.stderr


def test_interrupted_download_resumes_with_a_range_request(cloud, device_model_dir, tmp_path):
    from relayinfer.device.fetch import download_device_model
    from relayinfer.protocol.model.errors import ModelFileError

    name, dest = "tokenizer.json", tmp_path / "dl"
    full = (device_model_dir / name).read_bytes()
    assert len(full) > 2 << 20  # more than two 1 MiB chunks, so the first download stops part-way

    class Cut(Exception):
        pass

    def cut(n, done, total):
        if done >= 1 << 20:
            raise Cut  # the link drops after the first MiB

    with pytest.raises(Cut):
        download_device_model(cloud.http_url, dest, files=(name,), token=TOKEN, progress=cut, timeout_s=30)
    part = dest / f".{name}.part"
    assert part.stat().st_size == 1 << 20 and not (dest / name).exists()
    seen = []
    download_device_model(cloud.http_url, dest, files=(name,), token=TOKEN, timeout_s=30,
                          progress=lambda n, done, total: seen.append((done, total)))
    assert seen[0][0] == (1 << 20) + min(1 << 20, len(full) - (1 << 20))  # resumed: the first MiB was not sent again
    assert seen[-1] == (len(full), len(full))
    assert (dest / name).read_bytes() == full and not part.exists()
    # a part that does not match the file fails the sha256 check and is deleted
    (dest / name).unlink()
    part.write_bytes(b"x" * 1000)
    with pytest.raises(ModelFileError, match="sha256 mismatch for tokenizer.json"):
        download_device_model(cloud.http_url, dest, files=(name,), token=TOKEN, timeout_s=30)
    assert not part.exists()
    assert hashlib.sha256(full).hexdigest() == json.loads((device_model_dir / "manifest.json").read_text())["files"][name]
