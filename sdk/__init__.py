"""relayinfer.sdk: the public API (Client, TokenEvent, GenerationResult) and the CLI."""
from relayinfer.device.split import GenerationResult, TokenEvent
from relayinfer.protocol.messages import Grammar
from relayinfer.sdk.client import Client

__all__ = ["Client", "TokenEvent", "GenerationResult", "Grammar"]
