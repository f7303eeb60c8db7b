"""relayinfer.sdk."""
