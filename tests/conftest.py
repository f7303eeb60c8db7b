"""Shared fixtures: the real default model on both runtimes, built once per test session."""
from __future__ import annotations

import os
import threading
import time

import pytest

from relayinfer.sdk import Client

# Tests share 2 cores with the servers they start; one intra-op thread each avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

CHAT_PROMPTS = [
    "Tell me a short story about a robot who learns to paint.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="session")
def model_path():
    from relayinfer.protocol.model.model_file import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from relayinfer.protocol.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="session")
def torch_engine(model_path):
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.protocol.model.decoding import SamplingParams

    engine = TorchEngine(model_path, device="cpu", threads=1)
    # a warm engine: the first forward's one-off costs (allocator, kernel selection) do not land in
    # the first test's cloud TTFT, which split tests race against a paced device prefill
    assert len(engine.generate([1, 9690, 198], SamplingParams(max_new_tokens=2)).token_ids) == 2
    return engine


@pytest.fixture(scope="session")
def device_model_dir(model_path):
    """The exported ONNX device model (exported on first use: about 1-2 minutes on 2 cores)."""
    from relayinfer.cloud.export import ensure_device_model

    return ensure_device_model(model_path)


@pytest.fixture(scope="session")
def onnx_engine(device_model_dir):
    from relayinfer.device.onnx_engine import OnnxEngine

    return OnnxEngine(device_model_dir, threads=1)


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer):
    return [tokenizer.encode_chat(p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def data():
    """MovieLens-100K from the recbole wheel (GR relay tests)."""
    from relayinfer.cloud.relay.data import load_ml100k

    return load_ml100k()


def inner_prefill(engine, ids, kv, positions):
    """`engine.prefill`, passing `positions` only when given: a test wrapper's prefill (which takes
    positions, so `split.takes_positions` asks the engine it wraps) calling the engine it wraps."""
    return engine.prefill(ids, kv) if positions is None else engine.prefill(ids, kv, positions=positions)


class BackgroundSlow:
    """The device engine, at least `ms_per_token` a prefill token on the background (low-priority)
    thread the plan holds it on, at its own speed on the foreground one. The device re-plans with
    the prefill rate it measures on its background chunks: one slower than any display interval
    keeps it held (at its own speed it would measure a hand-off as feasible and go)."""

    def __init__(self, engine, ms_per_token: float):
        self.engine, self.ms_per_token = engine, ms_per_token

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, ids, kv=None, positions=None):
        t0 = time.perf_counter()
        out = inner_prefill(self.engine, ids, kv, positions)
        if threading.current_thread().name.startswith("device-background"):
            time.sleep(max(0.0, len(ids) * self.ms_per_token / 1e3 - (time.perf_counter() - t0)))
        return out


class _CloudGate:
    """The device engine, its prefill calls returning only once `open` is set (bounded by
    `CloudFirstClient.GATE_S`); decode steps untouched."""

    def __init__(self, engine):
        self.engine, self.open = engine, threading.Event()
        self.open.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, ids, kv=None, positions=None):
        out = inner_prefill(self.engine, ids, kv, positions)
        self.open.wait(CloudFirstClient.GATE_S)
        return out


class CloudFirstClient(Client):
    """A `Client` whose device is never ready before the cloud's first token is shown: in a split
    request its prefill calls return only after the first cloud `TokenEvent` (or the request's end,
    or GATE_S). A device ready first rightly answers device-only; on a loaded machine a slow cloud
    TTFT would make a test of the split path depend on the load, so tests of that path use this.
    One request at a time (the gate is the client's)."""

    GATE_S = 60.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.engine = self.gate = _CloudGate(self.engine)

    def _runner(self, prompt, sampling, *a, **kw):
        split = sampling.get("mode", self.options.mode) == "split"
        run = super()._runner(prompt, sampling, *a, **kw)

        async def gated(on_token):
            def seen(ev):
                if ev.source == "cloud":
                    self.gate.open.set()
                if on_token is not None:
                    on_token(ev)

            if split:
                self.gate.open.clear()
            try:
                return await run(seen)
            finally:
                self.gate.open.set()
        return gated
