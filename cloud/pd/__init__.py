"""relayinfer.cloud.pd: P/D-Serve (disaggregated prefill and decode pools, per-scenario groups,
on-demand forwarding, contiguous KV transfer) on the continuous-batching engine, on Ray."""
