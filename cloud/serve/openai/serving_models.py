"""`OpenAIServingModels`: the served model, as `GET /v1/models` lists it and requests name it."""
from __future__ import annotations

import time
from typing import Collection

from relayinfer.cloud.serve.openai.protocol import ServedModel


class OpenAIServingModels:
    """The one served model.

    Args:
        engine: the `AsyncLLMEngine` (or the P/D gateway); `engine.engine.max_model_len` is the
            most prompt + answer tokens one request can hold, `engine.engine.cfg.vocab_size`
            bounds token ids.
        model_name: the id `/v1/models` lists and answers carry.
        aliases: other names a request may give as `model` (e.g. the GGUF file's name).
    """

    def __init__(self, engine, model_name: str, aliases: Collection[str] = ()):
        self.llm = engine.engine
        self.served = ServedModel(model_name, tuple(aliases), self.llm.cfg.vocab_size)
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        """The served model's id (what answers carry as `model`)."""
        return self.served.name

    def show_available_models(self) -> dict:
        """The body of `GET /v1/models`: OpenAI's model list plus vLLM's `max_model_len` (tokens)."""
        return {"object": "list", "data": [
            {"id": self.served.name, "object": "model", "created": self.created, "owned_by": "relayinfer",
             "max_model_len": self.llm.max_model_len}]}
