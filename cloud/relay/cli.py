"""CLI of the GR relay: `relayinfer relay train|serve` (mounted by sdk/cli.py, which adds `relay bench`:
its driver, bench/relay.py, lives outside the library)."""
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
def serve(port: int = typer.Option(0, min=0, max=65535, help="Listen port on 127.0.0.1; 0 = any free port."),
          baseline: bool = typer.Option(False)) -> None:
    """Run one ranking instance in the foreground (prints READY <port> <fingerprint>)."""
    from relayinfer.protocol.checks import check_ports_free

    try:  # a busy port fails in one line before the model loads
        check_ports_free("127.0.0.1", [("--port", port)])
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    from relayinfer.cloud.relay.server import main
    main(["--port", str(port)] + (["--baseline"] if baseline else []))
