"""Options and start-up checks every server command shares (`cloud serve`, `pd serve`, `patho serve`;
`relay serve` mirrors them in cloud/relay/cli.py): auth, TLS and connection limits
(protocol/security.py, protocol/limits.py). Torch-free."""
from __future__ import annotations

import typer

OPT_INSECURE_NO_AUTH = typer.Option(False, "--insecure-no-auth",
                                    help="Allow a non-loopback --host without --token (anyone who can connect is served).")
OPT_MAX_CONNECTIONS = typer.Option(512, min=1, help="Open connections at most, all ports together; more get 503 + Retry-After.")
OPT_MAX_PER_CLIENT = typer.Option(128, min=1, help="Open connections per client IP address at most; more get 503 + Retry-After.")
OPT_HEADER_TIMEOUT = typer.Option(10.0, min=0.001, help="Seconds for an HTTP request head, a websocket opening "
                                  "handshake, the protocol Hello and a TLS handshake, each.")
OPT_IDLE_TIMEOUT = typer.Option(60.0, min=0.001, help="Seconds an HTTP keep-alive connection may idle between requests.")


def server_policy(host: str, token: str | None, insecure_no_auth: bool, certfile: str | None = None,
                  keyfile: str | None = None):
    """The start-up policy of every server command, before anything loads or binds: exit 2 when
    `host` is not loopback and there is no token (unless --insecure-no-auth), or when the TLS files
    do not go together or do not load. Returns the server ssl.SSLContext (None without TLS)."""
    from relayinfer.protocol.security import check_exposure

    try:
        check_exposure(host, token, insecure_no_auth)
    except ValueError as e:
        _fail(e)
    return _server_tls(certfile, keyfile)


def connection_limits(max_connections: int, max_connections_per_client: int, header_timeout_s: float,
                      idle_timeout_s: float, retry_after_ms: float = 5000.0):
    """`protocol.limits.ConnectionLimits` of the shared server options (exit 2 naming a bad one)."""
    from relayinfer.protocol.limits import ConnectionLimits

    try:
        return ConnectionLimits(max_connections, max_connections_per_client, header_timeout_s, idle_timeout_s,
                                retry_after_ms / 1e3)
    except ValueError as e:
        name, rest = str(e).split(" ", 1)  # 'header_timeout_s must be ...' -> '--header-timeout-s must be ...'
        _fail(ValueError(f"--{name.replace('_', '-')} {rest}"))


def _fail(e: Exception) -> None:
    from relayinfer.sdk.cli import fail

    fail(e)


def _server_tls(certfile, keyfile):
    from relayinfer.sdk.cli import _server_tls as tls

    return tls(certfile, keyfile)
