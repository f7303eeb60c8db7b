"""Calibration: measure this device's prefill fit and decode TPOT, cache it per model and thread count.

Prefill time is fitted as `a + b*n` ms (least squares over a few prompt lengths), decode TPOT is the
median of a few steps. Takes about 3-10 s on one CPU thread; cached as JSON under
`cache_dir()/profiles/`, keyed by the device model's fingerprint and ONNX file, so later clients
start at once. `relayinfer calibrate` runs it and prints the result.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from relayinfer.protocol.model.model_file import cache_dir

from .profiles import DeviceProfile
from .settings import cost_line

LENGTHS = (32, 128, 256)


def measure(engine, lengths=LENGTHS, decode_steps: int = 8, repeats: int = 2) -> DeviceProfile:
    """Time `engine` (anything with prefill/decode) and return a 'local' DeviceProfile."""
    engine.warmup()
    xs, ys = [], []
    for n in lengths:
        ids = [(7 * i) % 1000 + 100 for i in range(n)]
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            _, kv = engine.prefill(ids)
            best = min(best, (time.perf_counter() - t) * 1e3)
        xs.append(n)
        ys.append(best)
    a, b = cost_line(xs, ys)
    steps = []
    for i in range(decode_steps):
        t = time.perf_counter()
        _, kv = engine.decode(100 + i, kv)
        steps.append((time.perf_counter() - t) * 1e3)
    return DeviceProfile("local", prefill_ms_base=a, prefill_ms_per_token=b,
                         decode_ms_per_token=float(np.median(steps)), description="measured by device.calibrate",
                         source="calibration run")


MAX_AGE_S = 24 * 3600


def calibrated(engine, refresh: bool = False, max_age_s: float = MAX_AGE_S) -> DeviceProfile:
    """The cached calibration of `engine` (an OnnxEngine), measured again when absent, older than
    `max_age_s` seconds (a device's load changes), or when `refresh` is set."""
    key = f"{getattr(engine, 'fingerprint', '')[:16]}-{getattr(engine, 'onnx_file', 'x').name}-t{engine.threads}"
    path = cache_dir() / "profiles" / f"local-{key}.json"
    if path.is_file() and not refresh and time.time() - path.stat().st_mtime < max_age_s:
        return DeviceProfile(**json.loads(path.read_text()))
    prof = measure(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # atomic: a parallel reader never sees half a file
    tmp.write_text(json.dumps(prof.__dict__))
    os.replace(tmp, path)
    return prof
