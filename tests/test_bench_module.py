"""Benchmark drivers are the `bench` package of a source checkout: `python -m bench.<driver>` from
the checkout root, `relayinfer bench <driver>` through `bench_module`; without a checkout (an
installed wheel) the CLI exits 2 saying so."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from relayinfer.sdk.cli import bench_module

ROOT = Path(__file__).resolve().parents[1]


def test_bench_module_imports_the_checkout_package():
    mod = bench_module("relay_sim")
    assert mod.__name__ == "bench.relay_sim" and Path(mod.__file__) == ROOT / "bench" / "relay_sim.py"
    assert sys.modules["bench"].RELAYINFER_BENCH is True


def test_unknown_driver_exits_2(capsys):
    with pytest.raises(typer.Exit) as e:
        bench_module("no_such_driver")
    assert e.value.exit_code == 2 and "bench/no_such_driver.py" in capsys.readouterr().err


def test_without_a_checkout_it_says_a_source_checkout_is_needed(tmp_path, monkeypatch, capsys):
    """`cli_common.py` as a wheel installs it: no bench/ beside it, none on sys.path."""
    (tmp_path / "sdk").mkdir()
    shutil.copy(ROOT / "sdk" / "cli_common.py", tmp_path / "sdk" / "cli_common.py")
    spec = importlib.util.spec_from_file_location("wheel_cli_common", tmp_path / "sdk" / "cli_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.delitem(sys.modules, "bench", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(typer.Exit) as e:
        mod.bench_module("split")
    assert e.value.exit_code == 2 and "needs a source checkout" in capsys.readouterr().err


def test_python_dash_m_runs_a_driver_from_the_checkout_root():
    r = subprocess.run([sys.executable, "-m", "bench.kv_handoff", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "--lengths" in r.stdout


def test_serve_compare_keeps_hand_written_notes_only_for_the_machine_they_describe(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the scripts import their neighbours
    import machine
    import serve_compare

    here = {"cpu": "CPU A", "isa": ["avx2", "fma"], "cores": 2}
    there = {"cpu": "CPU A", "isa": ["avx2", "fma", "avx512f", "amx_bf16"], "cores": 2}
    path = tmp_path / "serve_compare.md"
    header = lambda m: f"# Serving comparison\n\nCommand: `x` (today, {serve_compare.machine_line(m)}, 2 cores ...).\n\n| t |\n"
    path.write_text(header(here) + "\n## Notes\n\nabout CPU A with AVX2 only\n")
    assert serve_compare.kept_notes(path, serve_compare.machine_line(here)) == "\n## Notes\n\nabout CPU A with AVX2 only\n"
    # the same model name with other instruction sets is another machine: its notes are dropped, said on stderr
    assert serve_compare.kept_notes(path, serve_compare.machine_line(there)) == ""
    assert "written for another machine" in capsys.readouterr().err
    assert serve_compare.kept_notes(tmp_path / "absent.md", "x") == ""
    isa = machine.cpu_isa()
    if isa is not None:  # Linux: the flags read are the CPU's, in ISA_FLAGS order
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split())
        assert isa == [f for f in machine.ISA_FLAGS if f in flags]
        assert machine.describe().endswith("ISA " + (", ".join(isa) or "unknown"))
