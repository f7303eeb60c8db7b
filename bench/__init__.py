"""Benchmark drivers of relayinfer (not part of the installed library). From a source checkout run
one as a module, `python -m bench.split ...`, or through the CLI, `relayinfer bench split ...`
(`sdk.cli_common.bench_module` imports it); results go to bench/results/."""

RELAYINFER_BENCH = True  # marks this package as relayinfer's drivers (not another `bench` on sys.path)
