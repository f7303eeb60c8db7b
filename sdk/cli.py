"""The `relayinfer` command line."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from relayinfer.protocol.errors import RelayInferError

app = typer.Typer(help="relayinfer: split inference between cloud and devices.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


def fail(e: Exception) -> None:
    """Print a one-line error naming what was wrong and exit 2."""
    typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="User message (chat template applied) or raw text with --raw."),
    engine: str = typer.Option("torch", help="torch (cloud runtime) or onnx (device runtime)."),
    model: Optional[str] = typer.Option(None, help="Llama-family GGUF file; default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="int8 weights (onnx engine only)."),
    max_new_tokens: int = typer.Option(128, help="Generated tokens at most (EOS included)."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_p: float = typer.Option(1.0), top_k: int = typer.Option(0), seed: Optional[int] = typer.Option(None),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads (onnx default 1)."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Generate an answer on one runtime (no split)."""
    from relayinfer.protocol.decoding import SamplingParams
    from relayinfer.protocol.tokenizer import Tokenizer
    from relayinfer.sdk.engines import load_engine

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_new_tokens=max_new_tokens)
        eng = load_engine(engine, model, quantize, threads)
        tok = Tokenizer.from_gguf(model)
        ids = tok.encode(prompt) if raw else tok.encode_chat(prompt)
        out = eng.generate(ids, params)
    except (RelayInferError, ValueError) as e:
        fail(e)
    text = tok.decode(out.token_ids, skip_special=True)
    if as_json:
        print(json.dumps({"engine": engine, "quantize": quantize, "prompt_ids": ids, "token_ids": out.token_ids,
                          "text": text, "finish_reason": out.finish_reason, "prefill_ms": round(out.prefill_ms, 3),
                          "decode_ms_per_token": round(out.decode_ms_per_token, 3)}))
    else:
        print(text)


@app.command("export")
def export_cmd(
    model: Optional[str] = typer.Option(None, help="Llama-family GGUF file; default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="Also write int8 weights."),
):
    """Export the device model (ONNX + tokenizer + config) into the user cache, once per model hash."""
    from rich.console import Console

    from relayinfer.cloud.export import ensure_device_model

    console = Console(stderr=True)
    try:
        with console.status("exporting") as status:
            d = ensure_device_model(model, quantize, progress=lambda m: (status.update(m), console.log(m)))
    except (RelayInferError, ValueError) as e:
        fail(e)
    print(d)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
