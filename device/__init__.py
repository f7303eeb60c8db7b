"""relayinfer.device."""
