"""relayinfer.sdk: the public API (Client, TokenEvent, GenerationResult, freeze_heap) and the CLI."""
from relayinfer.device.split import GenerationResult, TokenEvent
from relayinfer.protocol.messages import Grammar
from relayinfer.sdk.client import Client
from relayinfer.sdk.heap import freeze_heap

__all__ = ["Client", "TokenEvent", "GenerationResult", "Grammar", "freeze_heap"]
