"""CLI of the GR relay: `relayinfer relay train|serve` (mounted by sdk/cli.py, which adds `relay bench`:
its driver, bench/relay.py, lives outside the library). The cloud side is imported inside each
command, so this module loads on any install."""
from __future__ import annotations

from pathlib import Path

import typer

relay_app = typer.Typer(help="RelayGR: HSTU ranking on ML-100K with pre-inferred user prefixes.")


@relay_app.command()
def train(steps: int = typer.Option(500, help="training steps (64 users x 8 cut points x 31 negatives)"),
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
def serve(port: int = typer.Option(0, min=0, max=65535, help="Listen port; 0 = any free port."),
          host: str = typer.Option("127.0.0.1", help="Listen address; beyond loopback it needs --token "
                                                     "(or --insecure-no-auth)."),
          baseline: bool = typer.Option(False),
          token: str = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Bearer token every client must send "
                                                                          "(Hello and GET /stats)."),
          certfile: str = typer.Option(None, help="PEM certificate chain: serve wss:// and https:// (with --keyfile)."),
          keyfile: str = typer.Option(None, help="PEM private key of --certfile."),
          insecure_no_auth: bool = typer.Option(False, help="Allow a non-loopback --host without a token."),
          max_connections: int = typer.Option(512, min=1, help="Open connections at most; more get 503 + Retry-After."),
          max_connections_per_client: int = typer.Option(128, min=1, help="Open connections per client address at most."),
          header_timeout_s: float = typer.Option(10.0, min=0.001, help="Seconds for the opening handshake and the "
                                                                       "Hello, each.")) -> None:
    """Run one ranking instance in the foreground (prints READY <port> <fingerprint>)."""
    from relayinfer.sdk.checks import check_ports_free
    from relayinfer.protocol.transport.security import check_exposure

    try:  # the policy and a busy port fail in one line before the model loads
        check_exposure(host, token, insecure_no_auth)
        check_ports_free(host, [("--port", port)])
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    from relayinfer.cloud.relay.server import main
    args = ["--port", str(port), "--host", host, "--max-connections", str(max_connections),
            "--max-connections-per-client", str(max_connections_per_client), "--header-timeout-s", str(header_timeout_s)]
    args += ["--token", token] if token else []
    args += ["--certfile", certfile] if certfile else []
    args += ["--keyfile", keyfile] if keyfile else []
    args += ["--insecure-no-auth"] if insecure_no_auth else []
    main(args + (["--baseline"] if baseline else []))
