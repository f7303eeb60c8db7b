"""Long fuzzing run of the protocol layer: every atheris target for N seconds, results as JSON.

    nice -n 10 .venv/bin/python bench/fuzz.py --seconds-per-target 240

Targets (tests/fuzz/fuzz_<name>.py): ``decode`` (messages.decode + FrameBuffer), ``server``
(ServerSession, frame and stream mode, before and after the handshake), ``client`` (ClientSession
answering arbitrary Welcome bytes). Each runs under libFuzzer with ``-max_total_time=N``,
``-timeout=2`` (an input taking over 2 s is a hang) and ``-rss_limit_mb=2048``, from a copy of the
committed seed corpus; after a crash / hang / OOM it restarts from the grown corpus until its time is
spent. Writes ``bench/results/fuzz.json``: per target the inputs executed, exec/s, libFuzzer's
``cov:`` and ``ft:``, crashes, timeouts, ooms (with reproducers), the command line; plus the date.
Exit status 1 if any target had a finding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fuzz"))

import runner  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the targets and write the JSON report; return 0 if nothing was found, else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds-per-target", type=float, default=240.0, help="wall seconds per target (default 240)")
    p.add_argument("--targets", nargs="+", default=list(runner.TARGETS), choices=runner.TARGETS)
    p.add_argument("--timeout", type=int, default=2, help="libFuzzer -timeout: seconds before an input is a hang")
    p.add_argument("--rss-limit-mb", type=int, default=2048, help="libFuzzer -rss_limit_mb")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz.json"))
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="relayinfer-fuzz-") as tmp:
        for target in args.targets:
            work = os.path.join(tmp, target)
            os.makedirs(work)
            res = runner.run_target(target, work, seconds=args.seconds_per_target, timeout_s=args.timeout,
                                    rss_limit_mb=args.rss_limit_mb)
            for f in res.findings:  # keep reproducers next to the report, the temp folder goes away
                if f.artifact and os.path.exists(f.artifact):
                    keep = os.path.join(os.path.dirname(args.out), "fuzz-artifacts", target)
                    os.makedirs(keep, exist_ok=True)
                    dest = os.path.join(keep, os.path.basename(f.artifact))
                    with open(f.artifact, "rb") as src, open(dest, "wb") as dst:
                        dst.write(src.read())
                    f.artifact = os.path.relpath(dest, ROOT)
            res.command = [c.replace(tmp, "$WORK").replace(ROOT + os.sep, "") for c in res.command]
            results[target] = res.to_json()
            print(f"{target}: {res.executed} inputs in {res.seconds} s ({res.exec_per_s}/s), cov {res.cov}, "
                  f"ft {res.ft}, crashes {res.crashes}, timeouts {res.timeouts}, ooms {res.ooms}", flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "nice -n 10 .venv/bin/python bench/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds_per_target": args.seconds_per_target,
        "libfuzzer": {"timeout_s": args.timeout, "rss_limit_mb": args.rss_limit_mb},
        "python": platform.python_version(),
        "atheris": _version("atheris"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "total_inputs": sum(r["executed"] for r in results.values()),
        "targets": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return 1 if any(r["crashes"] or r["timeouts"] or r["ooms"] for r in results.values()) else 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
