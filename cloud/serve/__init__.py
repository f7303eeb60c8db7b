"""relayinfer.cloud.serve."""
