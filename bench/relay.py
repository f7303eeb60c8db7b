"""RelayGR cascade benchmark (same as `relayinfer bench relay`).

    .venv/bin/python bench/relay.py [--quick] [--no-live] [--out bench/results/relay.json]
"""
import argparse
from pathlib import Path

from relayinfer.cloud.relay.bench import run

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "relay.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-live", action="store_true")
    a = p.parse_args()
    run(a.out, quick=a.quick, live=not a.no_live)
