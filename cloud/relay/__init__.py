"""relayinfer.cloud.relay: RelayGR, pre-inferred user prefixes for GR ranking."""
