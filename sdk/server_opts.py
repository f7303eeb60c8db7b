"""Options and start-up checks every server command shares (`cloud serve`, `pd serve`, `patho serve`;
`relay serve` mirrors them in sdk/relay_cli.py): auth, TLS and connection limits
(protocol/transport/security.py, protocol/transport/limits.py). Torch-free."""
from __future__ import annotations

import typer

from relayinfer.sdk.cli_common import fail

OPT_INSECURE_NO_AUTH = typer.Option(False, "--insecure-no-auth",
                                    help="Allow a non-loopback --host without --token (anyone who can connect is served).")
OPT_MAX_CONNECTIONS = typer.Option(512, min=1, help="Open connections at most, all ports together; more get 503 + Retry-After.")
OPT_MAX_PER_CLIENT = typer.Option(128, min=1, help="Open connections per client IP address at most; more get 503 + Retry-After.")
OPT_HEADER_TIMEOUT = typer.Option(10.0, min=0.001, help="Seconds for an HTTP request head, a websocket opening "
                                  "handshake, the protocol Hello and a TLS handshake, each.")
OPT_IDLE_TIMEOUT = typer.Option(60.0, min=0.001, help="Seconds an HTTP keep-alive connection may idle between requests, "
                                  "and the most a request body may take to arrive (408 beyond).")


def server_policy(host: str, token: str | None, insecure_no_auth: bool, certfile: str | None = None,
                  keyfile: str | None = None):
    """The start-up policy of every server command, before anything loads or binds: exit 2 when
    `host` is not loopback and there is no token (unless --insecure-no-auth), or when the TLS files
    do not go together or do not load. Returns the server ssl.SSLContext (None without TLS)."""
    from relayinfer.protocol.transport.security import check_exposure

    try:
        check_exposure(host, token, insecure_no_auth)
    except ValueError as e:
        fail(e)
    return server_tls(certfile, keyfile)


def connection_limits(max_connections: int, max_connections_per_client: int, header_timeout_s: float,
                      idle_timeout_s: float, retry_after_ms: float = 5000.0):
    """`protocol.transport.limits.ConnectionLimits` of the shared server options (exit 2 naming a bad one)."""
    from relayinfer.protocol.transport.limits import ConnectionLimits

    try:
        return ConnectionLimits(max_connections, max_connections_per_client, header_timeout_s, idle_timeout_s,
                                retry_after_ms / 1e3)
    except ValueError as e:
        name, rest = str(e).split(" ", 1)  # 'header_timeout_s must be ...' -> '--header-timeout-s must be ...'
        fail(ValueError(f"--{name.replace('_', '-')} {rest}"))


def server_tls(certfile: str | None, keyfile: str | None):
    """The server ssl.SSLContext of --certfile/--keyfile (None without them); exits 2 with one
    line when only one is given or the files do not load."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        fail(ValueError("--certfile and --keyfile go together: give both (TLS) or neither (plain ws/http)"))
    from relayinfer.protocol.transport.security import server_context

    try:
        return server_context(certfile, keyfile)
    except ValueError as e:
        fail(e)
