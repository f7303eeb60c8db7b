"""relayinfer.protocol."""
