"""The asyncio adapters of the protocol: websocket channels (`ws`), TLS and auth (`security`),
connection limits and the memory budget (`limits`), bounded server shutdown (`lifecycle`)."""
