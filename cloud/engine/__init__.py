"""relayinfer.cloud.engine."""
