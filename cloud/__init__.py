"""relayinfer.cloud."""
