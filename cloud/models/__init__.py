"""relayinfer.cloud.models."""
