"""Device profiles: timing of a class of device, as data files beside this module.

A profile gives the device's prefill time as a linear fit `prefill_ms_base + prefill_ms_per_token * n`
for n tokens, its decode TPOT and the round-trip time to the cloud. `PacedEngine` makes the real
device engine no faster than the profile: it computes every token for real and only adds waiting.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_DIR = Path(__file__).parent


@dataclass(frozen=True)
class DeviceProfile:
    """Timing of a device class (ms). Zeros mean: no pacing, run at the engine's own speed."""

    name: str
    prefill_ms_base: float = 0.0
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    rtt_ms: float = 0.0
    description: str = ""
    source: str = ""

    def prefill_ms(self, n_tokens: int) -> float:
        """Profile prefill time of `n_tokens` tokens after a cache, ms (a decode step for n = 1)."""
        if n_tokens == 1 and self.decode_ms_per_token:
            return self.decode_ms_per_token
        return self.prefill_ms_base + self.prefill_ms_per_token * n_tokens


def available() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def load_profile(name: str) -> DeviceProfile:
    """The profile `name` (a file `<name>.json` here, or a path to a JSON file).

    Raises:
        ValueError: no such profile.
    """
    path = Path(name) if name.endswith(".json") else _DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown device profile {name!r}; available: {', '.join(available())}")
    return DeviceProfile(**json.loads(path.read_text()))


class PacedEngine:
    """Wraps a device engine so that each call lasts at least the profile's time for it.

    Same interface as the wrapped engine (`prefill`, `decode`, `eos_id`, `context_length`, ...).
    Calls run on the device's worker thread, so the added wait is a plain `time.sleep`.
    """

    def __init__(self, engine, profile: DeviceProfile):
        self.engine, self.profile = engine, profile

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _paced(self, n: int, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        wait = self.profile.prefill_ms(n) / 1e3 - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        return out

    def prefill(self, ids: Sequence[int], kv=None, positions=None):
        if positions is None:
            return self._paced(len(ids), self.engine.prefill, ids, kv)
        return self._paced(len(ids), lambda i, k: self.engine.prefill(i, k, positions=positions), ids, kv)

    def decode(self, token_id: int, kv):
        return self._paced(1, self.engine.decode, token_id, kv)
