"""TLS contexts and bearer-token checks shared by the cloud service and the device (torch-free).

Server side: `server_context(certfile, keyfile)` serves `wss://` and `https://` from one PEM
certificate chain. Client side: `client_context(ca, verify)` trusts the system CAs, or only the CA
bundle `ca` (a self-signed or private CA), and checks the host name; `verify=False` turns every
check off (logged as a warning: anyone on the path can then read the token).

Policy (every server: `cloud serve`, `pd serve`, `relay serve`, `patho serve`): `--token` (or the
`RELAYINFER_TOKEN` environment variable) is the bearer token clients must present, `--certfile` /
`--keyfile` serve TLS, and a server whose `--host` reaches beyond this machine refuses to start
without a token unless `--insecure-no-auth` is given (`check_exposure`, before anything binds).

Auth: `bearer_token(header)` takes the token out of an `Authorization: Bearer <token>` header and
`token_matches(given, expected)` compares in constant time; the websocket Hello check
(`protocol.session.ServerSession`) and the HTTP middleware of the cloud service use the same rule.
"""
from __future__ import annotations

import hmac
import logging
import os
import ssl

__all__ = ["server_context", "client_context", "context_for_url", "bearer_token", "token_matches", "check_exposure",
           "TOKEN_ENV"]

TOKEN_ENV = "RELAYINFER_TOKEN"  # the environment variable every server and client reads the token from

log = logging.getLogger("relayinfer.security")


def server_context(certfile: str | os.PathLike, keyfile: str | os.PathLike | None = None) -> ssl.SSLContext:
    """A server `ssl.SSLContext` (TLS 1.2 or newer) with the PEM certificate chain `certfile` and its
    private key `keyfile` (None: the key is inside `certfile`).

    Raises:
        ValueError: a file is missing or unreadable, is not PEM, or the key does not match the
            certificate (the message names the files and the reason).
    """
    what = f"certfile {os.fspath(certfile)!r}" + ("" if keyfile is None else f", keyfile {os.fspath(keyfile)!r}")
    for f in (certfile, keyfile):
        if f is not None and not os.path.isfile(f):
            raise ValueError(f"cannot load the TLS certificate ({what}): no such file {os.fspath(f)!r}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(os.fspath(certfile), None if keyfile is None else os.fspath(keyfile))
    except ssl.SSLError as e:
        reason = ("the private key does not match the certificate" if e.reason == "KEY_VALUES_MISMATCH" else
                  "not a PEM certificate chain and its private key" + (f" ({e.reason})" if e.reason else ""))
        raise ValueError(f"cannot load the TLS certificate ({what}): {reason}") from None
    except OSError as e:
        raise ValueError(f"cannot load the TLS certificate ({what}): {e.strerror or e}") from None
    return ctx


def client_context(ca: str | os.PathLike | None = None, verify: bool = True) -> ssl.SSLContext:
    """A client `ssl.SSLContext` for `wss://` / `https://`.

    Args:
        ca: PEM file of the CA certificate(s) to trust instead of the system store (a private or
            self-signed CA); None = the system store.
        verify: False disables certificate and host-name verification (a warning is logged; use
            only on a trusted network, the connection can then be intercepted).

    Raises:
        ValueError: `ca` is missing or holds no PEM certificate.
    """
    if ca is not None and not os.path.isfile(ca):
        raise ValueError(f"cannot load the CA file {os.fspath(ca)!r}: no such file")
    try:
        ctx = ssl.create_default_context(cafile=None if ca is None else os.fspath(ca))
    except ssl.SSLError as e:
        raise ValueError(f"cannot load the CA file {os.fspath(ca)!r}: not a PEM certificate ({e.reason or e})") from None
    except OSError as e:
        raise ValueError(f"cannot load the CA file {os.fspath(ca)!r}: {e.strerror or e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not verify:
        log.warning("TLS certificate verification is OFF: the cloud's identity is not checked and the "
                    "connection (and its token) can be intercepted")
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def context_for_url(url: str | None, ca: str | os.PathLike | None = None, verify: bool = True) -> ssl.SSLContext | None:
    """`client_context(ca, verify)` for a `wss://` or `https://` URL, None for anything else (plain
    `ws://` / `http://`, or no URL), so callers can pass the result straight on."""
    if url is None or not url.lower().startswith(("wss://", "https://")):
        return None
    return client_context(ca, verify)


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive), or
    None when the header is absent or uses another scheme."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token with the expected one (False for None)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def check_exposure(host: str | None, token: str | None, insecure_no_auth: bool = False) -> None:
    """The start-up policy of every server: a listen address other than loopback (127.0.0.0/8, ::1,
    localhost) needs a token, unless `insecure_no_auth` says serving anyone who can connect is meant.

    Raises:
        ValueError: `host` is not loopback, there is no token and `insecure_no_auth` is False (the
            message names --host, --token and --insecure-no-auth); or a token is given but empty or
            blank (no HTTP client could present it, while a Hello with an empty token would match).
    """
    from relayinfer.protocol.transport.limits import is_loopback

    if token is not None and not token.strip():
        raise ValueError(f"--token (or {TOKEN_ENV}) is empty: give a secret, or leave it unset to serve "
                         "without auth on loopback")
    if token or insecure_no_auth or is_loopback(host):
        return
    raise ValueError(f"--host {host or '(all interfaces)'} listens beyond this machine and no token is set: give "
                     f"--token (or {TOKEN_ENV}) so that clients must present it, or --insecure-no-auth to serve "
                     f"anyone who can connect")
