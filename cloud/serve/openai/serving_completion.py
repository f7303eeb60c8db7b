"""`OpenAIServingCompletion`: `/v1/completions` without HTTP. Up to 64 prompts (strings or token
ids), `n` choices each; `echo` puts the prompt first (with `logprobs`: its tokens' logprobs too,
from one full forward per prompt outside the batch, charged to the memory budget)."""
from __future__ import annotations

import asyncio

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine
from relayinfer.cloud.serve.openai.protocol import APIError, CompletionRequest
from relayinfer.cloud.serve.openai.serving_engine import ChoiceFormat, Entry, OpenAIServing, SSEStream, token_str
from relayinfer.cloud.serve.openai.serving_models import OpenAIServingModels
from relayinfer.protocol.model.decoding import token_logprobs

# one prompt token's (logprob, [(id, logprob)] of the top alternatives), None for the first token
PromptLogprob = tuple[float, list[tuple[int, float]]] | None


class OpenAIServingCompletion(OpenAIServing):
    """Text completions over the engine (see `OpenAIServing` for the first three arguments).

    Args:
        budget: the server's `protocol.transport.limits.MemoryBudget` (None: not charged); `echo` with
            `logprobs` is charged its float32 logits and hidden states while it runs, and answered
            503 with `Retry-After` (`retry_after_s`, seconds) when they do not fit.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer, models: OpenAIServingModels, budget=None,
                 retry_after_s: float = 5.0):
        super().__init__(engine, tokenizer, models)
        self.budget, self.retry_after_s = budget, retry_after_s

    async def create_completion(self, req: CompletionRequest) -> dict | SSEStream:
        """The answer to `req`: the `text_completion` dict, or for `req.stream` the `SSEStream` of
        `text_completion` chunk events (the caller must `aclose()` it). Choice index = prompt * n + j.

        Raises:
            APIError: 400 for a prompt without tokens, a request that cannot fit
                (`context_length_exceeded`, naming ``prompt[i]`` in a batch) or `ignore_eos` on the
                P/D gateway; 503 when echo logprobs do not fit the memory budget; any other
                request error of the engine, before anything is answered.
            FieldError: `min_tokens` above the default `max_tokens` that fits.
        """
        prompts, texts = self._tokenize(req)
        self._check_engine(req)
        rid, created = self._new_id()
        choices = await self._choices(req, prompts, rid, [req.prompt_param(i) for i in range(len(prompts))])
        echo = await self._echo_logprobs(req, prompts)
        fmt = _CompletionFormat(self.tokenizer, req, len(choices), texts, echo, prompts)
        return await self._respond(req, choices, fmt, rid, created)

    def _tokenize(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """(token ids, text) of every prompt: a string is encoded, token ids are decoded."""
        ids_out, texts = [], []
        for i, item in enumerate(req.prompt):
            if isinstance(item, str):
                ids, text = self.tokenizer.encode_prompt(item), item
            else:
                ids, text = list(item), self.tokenizer.decode(item)
            if not ids:
                raise APIError(400, f"'{req.prompt_param(i)}' has no tokens", req.prompt_param(i), "invalid_value")
            ids_out.append(ids)
            texts.append(text)
        return ids_out, texts

    async def _echo_logprobs(self, req: CompletionRequest, prompts: list[list[int]]) -> list[list[PromptLogprob]]:
        """Every prompt's token logprobs when `echo` and `logprobs` are set (else Nones), each
        forward charged to the budget; raises APIError(503, with `Retry-After`) when it does not fit."""
        if not (req.echo and req.logprobs is not None):
            return [None] * len(prompts)
        loop, cfg, out = asyncio.get_running_loop(), self.llm.cfg, []
        for ids in prompts:
            need = len(ids) * 4 * (2 * cfg.vocab_size + 4 * cfg.dim + 3 * cfg.ffn_dim)
            charge = self.budget.try_charge("echo_logprobs", need) if self.budget is not None else None
            if self.budget is not None and charge is None:
                raise APIError(503, self.budget.refusal(f"echo logprobs of a {len(ids)}-token prompt", need),
                               type_="server_error", headers={"Retry-After": str(max(1, round(self.retry_after_s)))})
            try:
                out.append(await loop.run_in_executor(None, prompt_logprobs, self.llm.model, ids, req.logprobs))
            finally:
                if charge is not None:
                    charge.release()
        return out


class _CompletionFormat(ChoiceFormat):
    """Completions' choices: `text` (after the echoed prompt) and logprobs `{"tokens",
    "token_logprobs", "top_logprobs", "text_offset"}`, offsets counted over each choice's text."""

    def __init__(self, tokenizer, req: CompletionRequest, n_choices: int, texts: list[str],
                 echo: list, prompts: list[list[int]]):
        self.tok, self.req, self.texts, self.echo_lp, self.prompts = tokenizer, req, texts, echo, prompts
        self.offsets = [0] * n_choices  # characters streamed so far per choice

    def _echo(self, ci: int) -> tuple[str, list[Entry]]:
        """The echoed prompt of choice `ci` and its logprob entries ("", [] without echo)."""
        pi = ci // self.req.n
        if not self.req.echo:
            return "", []
        entries = []
        if self.req.logprobs is not None:
            for t, e in zip(self.prompts[pi], self.echo_lp[pi]):
                entries.append((t, None, None) if e is None else (t, e[0], e[1]))
        return self.texts[pi], entries

    def opening(self, ci: int) -> dict | None:
        pre, entries = self._echo(ci)
        return self.delta(ci, pre, None, entries) if pre else None

    def full(self, ci: int, text: str, entries: list[Entry], finish: str) -> dict:
        pre, pre_entries = self._echo(ci)
        return {"index": ci, "text": pre + text, "finish_reason": finish,
                "logprobs": self._logprobs(pre_entries + entries, 0)}

    def delta(self, ci: int, text: str | None, finish: str | None, entries: list[Entry]) -> dict:
        lp = self._logprobs(entries, self.offsets[ci]) if entries else None
        self.offsets[ci] += len(text or "")
        return {"index": ci, "text": text or "", "finish_reason": finish, "logprobs": lp}

    def _logprobs(self, entries: list[Entry], offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        toks, lps, tops, offs = [], [], [], []
        for t, lp, top in entries:
            s = token_str(self.tok, t)
            toks.append(s)
            lps.append(lp)
            tops.append(None if top is None else {token_str(self.tok, a): b for a, b in top})
            offs.append(offset)
            offset += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def prompt_logprobs(model, ids: list[int], top: int) -> list[PromptLogprob]:
    """Logprobs of each prompt token given the ones before it (None for the first), from one
    full forward of `model` (the engine's `Llama`, read-only) over `ids`; each entry is
    `decoding.token_logprobs` of the logits before it (float, natural log), with its `top`
    alternatives."""
    import torch

    from relayinfer.cloud.models.llama import ConcatKV

    cfg = model.cfg
    dev = next(model.parameters()).device
    dt = next(model.parameters()).dtype
    empty = torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim, device=dev, dtype=dt)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=dev), ConcatKV([(empty, empty)] * cfg.n_layers), 0,
                       last_only=False)[0].float().cpu().numpy()
    return [None] + [token_logprobs(logits[i - 1], ids[i], top) for i in range(1, len(ids))]
