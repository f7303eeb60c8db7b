"""RelayGR cascade benchmark (same as `relayinfer bench relay`).

    .venv/bin/python bench/relay.py [--quick] [--no-live] [--shape trained|production] [--out PATH] [--reuse-timings]

--shape trained (default): the shipped ML-100K checkpoint -> bench/results/relay.json.
--shape production: an 8-layer, d=256 HSTU with RANDOM weights (timing study only)
-> bench/results/relay_production.json; its live part runs real instance processes beside the
simulator's prediction for the same requests.
"""
import argparse
from pathlib import Path

from relayinfer.cloud.relay.bench import run

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-live", action="store_true")
    p.add_argument("--shape", choices=("trained", "production"), default="trained")
    p.add_argument("--reuse-timings", action="store_true", help="reuse the latency samples of the existing --out JSON")
    a = p.parse_args()
    out = a.out or Path(__file__).parent / "results" / ("relay.json" if a.shape == "trained" else "relay_production.json")
    prev = None
    if a.reuse_timings:
        prev = out.with_name(out.stem + ".timings.json")
        prev.write_text(out.read_text())
    run(out, quick=a.quick, live=not a.no_live, shape=a.shape, timings=prev)
