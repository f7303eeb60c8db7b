"""`relayinfer patho ...` and `relayinfer bench patho`: pathology split screening from the command line.

`screen` is the device (torch-free unless it must export the coarse model once); `serve` and
`export` are the cloud / torch side. Every error that names bad input exits with status 2.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from relayinfer.protocol.errors import RelayInferError
from relayinfer.sdk.server_opts import OPT_HEADER_TIMEOUT, OPT_INSECURE_NO_AUTH, OPT_MAX_CONNECTIONS, OPT_MAX_PER_CLIENT
from relayinfer.sdk.cli_common import bench_module, serve_for, sigterm_stops_startup

patho_app = typer.Typer(help="Pathology split screening: WSI coarse screen on the device, fine screen in the cloud.",
                        no_args_is_help=True)

ARCHS = ("vit-large", "vit-tiny-test")


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _coarse_model(path: Optional[str]) -> Path:
    """--coarse-model, else the cached export (needs torch once)."""
    if path:
        return Path(path)
    try:
        from relayinfer.cloud.patho.effnet import ensure_coarse_model
    except ImportError:
        _fail(ValueError("no --coarse-model given and torch is not installed to export one; run "
                         "`relayinfer patho export` where torch is, and pass the .onnx file"))
    return ensure_coarse_model()


@patho_app.command("screen")
def screen(
    slide: str = typer.Argument(..., help="Whole-slide image: SVS, tiled TIFF, NDPI, MRXS, DICOM (OpenSlide)."),
    cloud: str = typer.Option(..., help="ws:// or wss:// URL of a running `relayinfer patho serve`."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Bearer token of the service."),
    coarse_model: Optional[str] = typer.Option(None, help="Coarse-screen ONNX file; default: the cached export."),
    slide_mpp: Optional[float] = typer.Option(None, help="µm/px of level 0 when the file does not say."),
    keep: float = typer.Option(0.5, min=0.0, max=1.0, help="Top fraction of tissue regions sent at least."),
    device_threshold: float = typer.Option(0.5, help="Regions scoring at least this on the device are sent too."),
    blur_var: float = typer.Option(50.0, help="Candidate tiles with a Laplacian variance below this are dropped."),
    payload: str = typer.Option("jpeg", help="jpeg, raw, features, or auto (chosen by --link-mbps)."),
    link_mbps: Optional[float] = typer.Option(None, help="Uplink speed for --payload auto (Mbit/s)."),
    threshold: Optional[float] = typer.Option(None, help="Decision threshold on the slide score."),
    calibration: Optional[str] = typer.Option(None, help="JSON from `relayinfer patho calibrate` (its threshold)."),
    out_dir: str = typer.Option(".", help="Folder for <slide>.heatmap.png and <slide>.report.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ca: Optional[str] = typer.Option(None, help="PEM CA file trusted for a wss:// cloud."),
    insecure: bool = typer.Option(False, "--insecure", help="Do not verify the cloud's TLS certificate."),
    timeout_s: float = typer.Option(900.0, help="Bound on the whole exchange with the cloud (s)."),
):
    """Screen one slide: tissue detection and coarse screen here, candidate tiles to the cloud, heatmap + JSON report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from relayinfer.sdk.patho import PAYLOADS, screen_slide, write_heatmap

    if payload not in PAYLOADS:
        _fail(ValueError(f"unknown --payload {payload!r}; choose from {', '.join(PAYLOADS)}"))
    if threshold is not None and calibration is not None:
        _fail(ValueError("give --threshold or --calibration, not both"))
    cal = None
    if calibration is not None:
        try:
            cal = json.loads(Path(calibration).read_text())
            threshold = float(cal["threshold"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            _fail(ValueError(f"--calibration {calibration}: not a calibration JSON with a threshold ({e})"))
    model = _coarse_model(coarse_model)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=as_json, disable=as_json and not sys.stderr.isatty(),
                  console=__import__("rich.console").console.Console(stderr=True)) as bar:
        tasks = {}

        def progress(stage, done, total):
            if stage not in tasks:
                tasks[stage] = bar.add_task("device coarse screen (regions)" if stage == "screen"
                                            else "cloud fine screen (tiles)", total=total)
            bar.update(tasks[stage], completed=done)

        try:
            report = screen_slide(slide, cloud, model, token=token, slide_mpp=slide_mpp, keep=keep,
                                  device_threshold=device_threshold, blur_var=blur_var, payload=payload,
                                  link_mbps=link_mbps, threshold=threshold, calibration=cal, ca=ca, verify=not insecure,
                                  timeout_s=timeout_s, progress=progress)
        except (RelayInferError, ValueError, OSError, TimeoutError) as e:
            _fail(e)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(slide).name
    heat, rep = out / f"{stem}.heatmap.png", out / f"{stem}.report.json"
    write_heatmap(report, heat)
    report.save(rep)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    dec = f"  decision {report.decision} (threshold {report.threshold:.4f})" if report.threshold is not None else ""
    typer.echo(f"slide score {report.slide_score:.4f}{dec}\n"
               f"tissue tiles {report.tissue_tiles}, regions {report.regions}, candidate regions "
               f"{report.candidate_regions}, tiles sent {report.tiles_sent} ({report.payload}, {report.bytes_sent:,} bytes; "
               f"slide file {report.slide_bytes:,} bytes), {report.times['total_s']:.1f} s\n"
               f"encoder {report.encoder}, weights {report.weights}, device head {report.device_head}"
               + ("\nRANDOM WEIGHTS: this score exercises the pipeline and is not a diagnosis" if report.random_weights else "")
               + f"\nheatmap {heat}\nreport  {rep}")


@patho_app.command("serve")
@sigterm_stops_startup("the patho service")
def serve(
    host: str = typer.Option("127.0.0.1", help="Listen address."),
    port: int = typer.Option(8770, help="Websocket port (0 = a free one)."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Token every device must send."),
    weights: Optional[str] = typer.Option(None, help="Encoder weights: a timm-layout ViT state dict (Digepath, UNI, ...); "
                                          "default: RANDOM initialisation."),
    arch: str = typer.Option("vit-large", help="Encoder shape without --weights: vit-large (ViT-L/16) or vit-tiny-test."),
    heads: Optional[int] = typer.Option(None, help="Attention heads of --weights (default from the width)."),
    norm: str = typer.Option("imagenet", help="Input normalisation: imagenet (UNI, Digepath, DINOv2) or inception."),
    mil_weights: Optional[str] = typer.Option(None, help="ABMIL head state dict over encoder embeddings."),
    feature_mil_weights: Optional[str] = typer.Option(None, help="ABMIL head state dict over device features."),
    bf16: bool = typer.Option(False, help="Run the encoder in bfloat16."),
    batch_size: int = typer.Option(8, min=1, help="Tiles per encoder forward."),
    threads: int = typer.Option(1, min=1, help="torch threads of the compute thread."),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda."),
    max_tiles_per_slide: int = typer.Option(20000, min=1), max_slides_per_session: int = typer.Option(4, min=1),
    duration_s: Optional[float] = typer.Option(None, min=0.0, help="Stop by itself after this many seconds."),
    certfile: Optional[str] = typer.Option(None, help="PEM certificate chain: serve wss:// (with --keyfile)."),
    keyfile: Optional[str] = typer.Option(None, help="PEM private key of --certfile."),
    max_sessions: int = typer.Option(16, min=1, help="Open device connections at most (counted at the websocket "
                                     "upgrade); more get OVERLOADED + retry-after."),
    memory_mb: int = typer.Option(1024, min=1, help="Memory budget of received tile frames, decoded tiles and "
                                  "kept embeddings (MiB); a batch beyond it gets OVERLOADED + retry-after."),
    insecure_no_auth: bool = OPT_INSECURE_NO_AUTH,
    max_connections: int = OPT_MAX_CONNECTIONS,
    max_connections_per_client: int = OPT_MAX_PER_CLIENT,
    header_timeout_s: float = OPT_HEADER_TIMEOUT,
):
    """Run the cloud fine screen (tile encoder + ABMIL) until Ctrl-C or --duration-s."""
    from relayinfer.sdk.server_opts import connection_limits, server_policy

    from relayinfer.cloud.patho.encoder import NORMS, ViTEncoder
    from relayinfer.cloud.patho.service import PathoService, SlideScreener
    from relayinfer.cloud.patho.vit import VIT_LARGE_16, VIT_TINY_TEST

    if arch not in ARCHS:
        _fail(ValueError(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}"))
    if norm not in NORMS:
        _fail(ValueError(f"unknown --norm {norm!r}; choose from {', '.join(NORMS)}"))
    if (certfile is None) != (keyfile is None):
        _fail(ValueError("--certfile and --keyfile go together: give both (TLS) or neither"))
    tls = server_policy(host, token, insecure_no_auth, certfile, keyfile)  # exit 2 before the encoder loads
    limits = connection_limits(max_connections, max_connections_per_client, header_timeout_s, 60.0)
    from relayinfer.sdk.checks import check_ports_free

    try:  # a busy port fails in one line before the encoder loads
        check_ports_free(host, [("--port", port)])
    except ValueError as e:
        _fail(e)
    try:
        enc = ViTEncoder(weights, VIT_LARGE_16 if arch == "vit-large" else VIT_TINY_TEST, norm, batch_size, bf16,
                         device, heads=heads)
        svc = PathoService(SlideScreener(enc, mil_weights, feature_mil_weights), auth_token=token,
                           max_tiles_per_slide=max_tiles_per_slide, max_slides_per_session=max_slides_per_session,
                           threads=threads, max_sessions=max_sessions, memory_bytes=memory_mb << 20, limits=limits)
    except (RelayInferError, ValueError, OSError) as e:
        _fail(e)

    async def up():
        await svc.start(host, port, ssl=tls)
        rnd = svc.screener.weights(False) == "random-init"
        typer.echo(f"patho service: {svc.url}  encoder {enc.name}  weights {svc.screener.weights(False)}"
                   + ("  (RANDOM WEIGHTS: scores are not diagnoses)" if rnd else "")
                   + ("" if token else "  (no --token: open to anyone who can connect)"), err=True)

    serve_for(svc, duration_s, up)


@patho_app.command("export")
def export(
    head: Optional[str] = typer.Option(None, help="Trained head state dict {weight (1, 1280), bias (1,)}; default random init."),
    seed: int = typer.Option(0, help="Seed of the random head."),
    out: Optional[str] = typer.Option(None, help="Output .onnx; default the cache (reused by `patho screen`)."),
):
    """Export the device coarse-screen model (EfficientNet-Lite0 ImageNet features + head) to ONNX (torch side)."""
    from relayinfer.cloud.patho.effnet import ensure_coarse_model, export_coarse_model

    try:
        path = Path(out) if out else None
        if path is not None:
            export_coarse_model(path, head, seed)
        else:
            path = ensure_coarse_model(head, seed)
    except (ValueError, OSError, RuntimeError) as e:
        _fail(e)
    print(path)


@patho_app.command("calibrate")
def calibrate(
    scores_csv: str = typer.Argument(..., help="CSV of slide scores: columns score,label (label 1 = lesion); header optional."),
    target: float = typer.Option(0.996, help="Sensitivity to reach (0.996: the Digepath paper's figure, a target here)."),
    alpha: float = typer.Option(0.05, help="1 - confidence of the Clopper-Pearson bounds."),
    one_sided: bool = typer.Option(False, help="One-sided lower bounds instead of the two-sided interval's."),
    out: Optional[str] = typer.Option(None, help="Write the calibration JSON here (for `patho screen --calibration`)."),
):
    """The largest threshold whose sensitivity on a labelled calibration set is >= the target, with the
    exact Clopper-Pearson lower bound on sensitivity and the specificity at that threshold."""
    import csv

    from relayinfer.sdk.patho_calibration import calibrate_threshold

    try:
        rows = [r for r in csv.reader(Path(scores_csv).read_text().splitlines()) if r]
        if rows and rows[0][0].strip().lower() == "score":
            rows = rows[1:]
        scores = [float(r[0]) for r in rows]
        labels = [int(float(r[1])) for r in rows]
        cal = calibrate_threshold(scores, labels, target, alpha, two_sided=not one_sided)
    except (OSError, ValueError, IndexError) as e:
        _fail(ValueError(f"{scores_csv}: {e}"))
    d = dict(cal.to_dict(), source=str(scores_csv))
    if out:
        Path(out).write_text(json.dumps(d, indent=1))
    print(json.dumps(d, indent=1))


def bench_patho(
    out: str = typer.Option("bench/results/patho.json", help="Results JSON (plots beside it)."),
    encoder_tiles: int = typer.Option(8, min=1, help="Tiles timed through ViT-L/16 for the all-cloud estimate."),
    quick: bool = typer.Option(False, help="Smoke run: the 2-block test ViT instead of ViT-L/16."),
):
    """Pathology split screening on the real SVS: tiles/s read, screened and encoded; bytes sent; split vs
    all-cloud vs all-device. The summary goes to stdout as JSON; progress and, at the end,
    `wrote <absolute path>` to stderr. --out is relative to the working directory."""
    path = Path(out).resolve()
    if path.is_dir():
        _fail(ValueError(f"--out {out}: is a directory; name the results JSON file"))
    run = bench_module("patho").run
    try:
        res = run(out=str(path), encoder_tiles=encoder_tiles, quick=quick,
                  command=shlex.join(["relayinfer", *sys.argv[1:]]), log=lambda m: typer.echo(m, err=True))
    except (RelayInferError, ValueError, OSError) as e:
        _fail(e)
    print(json.dumps(res["summary"], indent=1))
    typer.echo(f"wrote {path}", err=True)
