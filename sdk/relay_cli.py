"""CLI of the GR relay: `relayinfer relay train|serve|bench` (mounted by sdk/cli.py; `relayinfer bench
relay` is `relay bench`). The cloud side is imported inside each command, so this module loads on
any install; `bench` loads its driver, bench/relay.py of a source checkout, with `bench_module`."""
from __future__ import annotations

from pathlib import Path

import typer

from relayinfer.sdk.cli_common import sigterm_stops_startup

relay_app = typer.Typer(help="RelayGR: HSTU ranking on ML-100K with pre-inferred user prefixes.")

BENCH_OUT = {"trained": "bench/results/relay.json", "production": "bench/results/relay_production.json"}
"""Default results JSON of `relay bench` per --shape, relative to the working directory (as every
`relayinfer bench` command's default)."""


@relay_app.command("bench")  # named: sdk/cli.py adds its own only when no command is named "bench"
def bench(out: Path = typer.Option(None, help="Results JSON (a P99 plot is written beside it); default "
                                              "bench/results/relay.json under the working directory, "
                                              "relay_production.json for --shape production."),
          quick: bool = typer.Option(False, help="Shorter sweep and fewer requests."),
          live: bool = typer.Option(True, help="Also run the live check through instance processes."),
          shape: str = typer.Option("trained", help="trained: the shipped ML-100K checkpoint; production: an "
                                                    "8-layer d=256 HSTU with random weights (timing study).")
          ) -> None:
    """Cascade benchmark: baseline vs relay under one ranking P99 budget (the driver is bench/relay.py
    of a source checkout; exit 2 naming it when it is not there). Ends with `wrote <absolute path>`."""
    from relayinfer.sdk.cli_common import bench_module, fail

    if shape not in BENCH_OUT:
        fail(ValueError(f"--shape {shape!r}: choose trained or production"))
    path = Path(out or BENCH_OUT[shape]).resolve()
    if path.is_dir():
        fail(ValueError(f"--out {out}: is a directory; name the results JSON file"))
    bench_module("relay").run(path, quick=quick, live=live, log=typer.echo, shape=shape)
    typer.echo(f"wrote {path}")


@relay_app.command()
def train(steps: int = typer.Option(500, min=1, help="training steps (64 users x 8 cut points x 31 negatives)"),
          quick: bool = typer.Option(False, help="150 steps instead of --steps"),
          attn_norm: int = typer.Option(None, min=1, help="attention normaliser n (default: the training window + 1 "
                                                          "= 101, sized to the data as the reference does; 8192 = the "
                                                          "model's max_len, the shipped checkpoint's)"),
          out: Path = typer.Option(None, help="checkpoint path (default: the user cache; the shipped default "
                                              "checkpoint is only replaced if you name it)")) -> None:
    """Train the HSTU ranker on ML-100K, print HR@10 / NDCG@10 vs popularity, save the checkpoint."""
    from relayinfer.cloud.relay.train import TrainConfig, train_and_save
    m = train_and_save(TrainConfig(steps=150 if quick else steps, attn_norm=attn_norm), path=out)
    typer.echo(f"HSTU        HR@10 {m['hr']:.4f}  NDCG@10 {m['ndcg']:.4f}")
    typer.echo(f"popularity  HR@10 {m['pop_hr']:.4f}  NDCG@10 {m['pop_ndcg']:.4f}")
    typer.echo(f"({m['users']} users, leave-last-out, full sort; trained in {m['train_s']:.0f} s) -> {m['path']}")


@relay_app.command()
@sigterm_stops_startup("the relay service")
def serve(port: int = typer.Option(0, min=0, max=65535, help="Listen port; 0 = any free port."),
          host: str = typer.Option("127.0.0.1", help="Listen address; beyond loopback it needs --token "
                                                     "(or --insecure-no-auth)."),
          baseline: bool = typer.Option(False, help="Disable the relay: every request runs full inference."),
          checkpoint: Path = typer.Option(None, help="HSTU checkpoint, e.g. one `relay train --out` wrote (default: "
                                                     "the shipped ML-100K one)."),
          token: str = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Bearer token every client must send "
                                                                          "(Hello and GET /stats)."),
          certfile: str = typer.Option(None, help="PEM certificate chain: serve wss:// and https:// (with --keyfile)."),
          keyfile: str = typer.Option(None, help="PEM private key of --certfile."),
          insecure_no_auth: bool = typer.Option(False, help="Allow a non-loopback --host without a token."),
          max_connections: int = typer.Option(512, min=1, help="Open connections at most; more get 503 + Retry-After."),
          max_connections_per_client: int = typer.Option(128, min=1, help="Open connections per client address at most."),
          header_timeout_s: float = typer.Option(10.0, min=0.001, help="Seconds for the opening handshake and the "
                                                                       "Hello, each.")) -> None:
    """Run one ranking instance in the foreground (prints READY <port> <fingerprint>; GET /healthz on
    the same port names the fingerprint too). Exit 2 with one line for a refused --host, a busy
    --port or a --checkpoint that is not an HSTU checkpoint, before anything listens."""
    from relayinfer.sdk.checks import check_ports_free
    from relayinfer.protocol.transport.security import check_exposure

    try:  # the policy and a busy port fail in one line before the model loads
        check_exposure(host, token, insecure_no_auth)
        check_ports_free(host, [("--port", port)])
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    if checkpoint is not None:
        _check_checkpoint(checkpoint)
    from relayinfer.cloud.relay.server import main
    args = ["--port", str(port), "--host", host, "--max-connections", str(max_connections),
            "--max-connections-per-client", str(max_connections_per_client), "--header-timeout-s", str(header_timeout_s)]
    args += ["--token", token] if token else []
    args += ["--certfile", certfile] if certfile else []
    args += ["--keyfile", keyfile] if keyfile else []
    args += ["--insecure-no-auth"] if insecure_no_auth else []
    args += ["--checkpoint", str(checkpoint)] if checkpoint is not None else []
    main(args + (["--baseline"] if baseline else []))


def _check_checkpoint(path: Path) -> None:
    """Exit 2 naming --checkpoint when `path` is not a file or does not load as an HSTU checkpoint."""
    if not path.is_file():
        typer.secho(f"error: --checkpoint {path}: no such file", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    from relayinfer.cloud.relay.train import load
    try:
        load(path)
    except Exception as e:  # torch.load's errors vary with what the file is (pickle, zip, keys)
        typer.secho(f"error: --checkpoint {path}: not an HSTU checkpoint ({type(e).__name__}: {e})"[:400], err=True,
                    fg=typer.colors.RED)
        raise typer.Exit(2)
