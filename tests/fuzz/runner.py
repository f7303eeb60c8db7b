"""Run one atheris target in a subprocess and read libFuzzer's output (used by tests/test_fuzz.py and
bench/fuzz.py).

:func:`run_target` copies the committed seed corpus to a work folder, runs
``python tests/fuzz/fuzz_<target>.py <libFuzzer args> <work corpus>`` and, when libFuzzer stops on a
crash, timeout or out-of-memory before the time budget is spent, records the reproducer and starts
again from the grown corpus (a bounded number of times), so one call reports every finding of the
budget rather than only the first.
"""

from __future__ import annotations

import os
import resource
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

FUZZ_DIR = os.path.dirname(os.path.abspath(__file__))
TARGETS = ("decode", "server", "client")
"""Target names: ``tests/fuzz/fuzz_<name>.py`` with seeds in ``tests/fuzz/corpus/<name>/``."""


@dataclass
class Finding:
    """One libFuzzer stop: ``kind`` is "crash", "timeout" or "oom"; ``artifact`` the reproducer path;
    ``data`` its first bytes (repr); ``detail`` the end of the log before the stop."""

    kind: str
    artifact: str | None
    data: str
    detail: str


@dataclass
class SegmentStats:
    """What libFuzzer printed for one process: executed inputs, ``cov:``/``ft:`` of its last status
    line, corpus size, peak RSS (MB), wall seconds."""

    executed: int = 0
    cov: int | None = None
    ft: int | None = None
    corpus_units: int | None = None
    peak_rss_mb: int | None = None
    seconds: float = 0.0
    finding: Finding | None = None


@dataclass
class TargetResult:
    """One target's totals over all its segments. ``exec_per_s`` is executed / wall seconds."""

    target: str
    executed: int
    seconds: float
    exec_per_s: float
    cov: int | None
    ft: int | None
    corpus_units: int | None
    peak_rss_mb: int | None
    crashes: int
    timeouts: int
    ooms: int
    segments: int
    command: list[str]
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict:
        """Plain dict for ``json.dump``."""
        return asdict(self)


_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)(?: corp: (\d+)/)?.*?(?:rss: (\d+)Mb)?$", re.M)
_DONE = re.compile(r"^Done (\d+) runs in", re.M)
_UNITS = re.compile(r"^stat::number_of_executed_units:\s+(\d+)", re.M)
_PEAK = re.compile(r"^stat::peak_rss_mb:\s+(\d+)", re.M)
_ARTIFACT = re.compile(r"Test unit written to (\S+)")


def parse_output(log: str) -> SegmentStats:
    """Read executed inputs, coverage and any stop reason from one libFuzzer log."""
    stats = SegmentStats()
    statuses = _STATUS.findall(log)
    executed = [int(n) for n, *_ in statuses]
    for regex in (_UNITS, _DONE):
        executed += [int(n) for n in regex.findall(log)]
    stats.executed = max(executed, default=0)
    if statuses:
        _, cov, ft, corp, rss = statuses[-1]
        stats.cov, stats.ft = int(cov), int(ft)
        stats.corpus_units = int(corp) if corp else None
        stats.peak_rss_mb = int(rss) if rss else None
    peak = _PEAK.findall(log)
    if peak:
        stats.peak_rss_mb = int(peak[-1])
    kind = None
    if "ERROR: libFuzzer: timeout" in log:
        kind = "timeout"
    elif "out-of-memory" in log and "ERROR: libFuzzer" in log:
        kind = "oom"
    elif "Uncaught Python exception" in log or "ERROR: libFuzzer: deadly signal" in log or "ERROR: libFuzzer" in log:
        kind = "crash"
    if kind:
        art = _ARTIFACT.findall(log)
        path = art[-1] if art else None
        data = ""
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                data = repr(f.read(400))
        cut = log.find("=== Uncaught Python exception")
        detail = log[cut:cut + 4000] if cut >= 0 else log[-4000:]
        stats.finding = Finding(kind, path, data, detail)
    return stats


def run_target(target: str, workdir: str, *, seconds: float, runs: int | None = None, timeout_s: int = 2,
               rss_limit_mb: int = 2048, max_segments: int = 20, nice: int = 0,
               extra_args: tuple[str, ...] = ()) -> TargetResult:
    """Fuzz ``target`` for about ``seconds`` of wall time (and at most ``runs`` inputs per segment).

    ``timeout_s``: libFuzzer's per-input hang limit (seconds); ``rss_limit_mb``: its memory limit;
    ``nice``: niceness added to the child. Seeds are copied from ``corpus/<target>`` into
    ``workdir/corpus`` (which libFuzzer grows); reproducers land in ``workdir/``. Restarts after a
    finding until the budget is spent, at most ``max_segments`` processes. Raises ``ValueError`` for
    an unknown target; a child killed past ``seconds + 60`` s counts as a timeout finding.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown fuzz target {target!r}; one of {TARGETS}")
    corpus = os.path.join(workdir, "corpus")
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.copytree(os.path.join(FUZZ_DIR, "corpus", target), corpus)
    script = os.path.join(FUZZ_DIR, f"fuzz_{target}.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    # Linux keeps a process's peak RSS across fork + exec, and libFuzzer's RSS limit reads that peak:
    # a child of a test worker that holds models starts "at" the worker's peak. Limit the child's own.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    rss_limit_mb += inherited_mb
    start = time.monotonic()
    segments: list[SegmentStats] = []
    command: list[str] = []
    for seg in range(max_segments):
        left = seconds - (time.monotonic() - start)
        if left < 1 and segments:
            break
        args = [f"-max_total_time={max(1, round(left))}", f"-timeout={timeout_s}", f"-rss_limit_mb={rss_limit_mb}",
                f"-artifact_prefix={workdir}/", "-print_final_stats=1", f"-seed={seg + 1}", *extra_args]
        if runs is not None:
            args.append(f"-runs={runs}")
        command = (["nice", "-n", str(nice)] if nice else []) + [sys.executable, script, *args, corpus]
        log_path = os.path.join(workdir, f"log-{seg}.txt")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            try:
                subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                               timeout=max(1, left) + 60, check=False)
                killed = False
            except subprocess.TimeoutExpired:
                killed = True
        with open(log_path, errors="replace") as f:
            stats = parse_output(f.read())
        stats.seconds = time.monotonic() - t0
        if killed and stats.finding is None:
            stats.finding = Finding("timeout", None, "", f"killed after {stats.seconds:.0f} s (libFuzzer did not stop)")
        segments.append(stats)
        if stats.finding is None or runs is not None and stats.executed >= runs:
            break
    elapsed = time.monotonic() - start
    executed = sum(s.executed for s in segments)
    last = segments[-1]
    findings = [s.finding for s in segments if s.finding]
    return TargetResult(
        target=target, executed=executed, seconds=round(elapsed, 1),
        exec_per_s=round(executed / elapsed, 1) if elapsed else 0.0,
        cov=last.cov, ft=last.ft, corpus_units=last.corpus_units,
        peak_rss_mb=max((s.peak_rss_mb or 0) for s in segments) or None,
        crashes=sum(f.kind == "crash" for f in findings), timeouts=sum(f.kind == "timeout" for f in findings),
        ooms=sum(f.kind == "oom" for f in findings), segments=len(segments), command=command, findings=findings,
    )
