"""Input checks of the CLI and the `Client`: cloud URLs and listen ports (the empty-prompt rule that
every door shares is `protocol.validate.check_prompt_text`). Each raises `ValueError` with a message
in plain words that names the field, the value and what is allowed, so the CLI can print it as one
line (exit status 2).
"""
from __future__ import annotations

import errno
import socket
from typing import Iterable
from urllib.parse import urlsplit

CLOUD_SCHEMES = ("ws", "wss")


def check_cloud_url(url: str, field: str = "cloud_url") -> str:
    """Return `url` if it is a usable websocket URL of a cloud service: `ws://` or `wss://`, a host,
    and a port (if given) between 1 and 65535. Nothing is dialled here.

    Raises:
        ValueError: another scheme (an `http://` URL gets a hint at the websocket port), no host, a
            port that is not a number in range, or a path/query (the service has none).
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{field} is empty: give the service's websocket URL, e.g. ws://127.0.0.1:8765")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:  # port out of range or not a number, bad IPv6 brackets
        raise ValueError(f"{field} {url!r} is not a valid URL ({e}); expected ws://HOST:PORT, e.g. "
                         "ws://127.0.0.1:8765") from None
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        raise ValueError(f"{field} {url!r} is an HTTP URL; devices connect to the websocket port: "
                         f"{'wss' if scheme == 'https' else 'ws'}://HOST:PORT (`cloud serve --port`, default 8765, "
                         "not --http-port)")
    if scheme not in CLOUD_SCHEMES:
        raise ValueError(f"{field} {url!r} must start with ws:// or wss://, e.g. ws://127.0.0.1:8765")
    if not parts.hostname:
        raise ValueError(f"{field} {url!r} names no host; expected ws://HOST:PORT, e.g. ws://127.0.0.1:8765")
    if port == 0:
        raise ValueError(f"{field} {url!r}: port 0 is not a service port; allowed 1..65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{field} {url!r} has a path or query; the service listens at ws://HOST:PORT only")
    return url.strip()


def check_ports_free(host: str, ports: Iterable[tuple[str, int | None]]) -> None:
    """Bind each `(option name, port)` on `host` and release it at once, so a command that listens
    can fail in one line *before* it loads a model. Port 0 or None (a free port is chosen later)
    is skipped. Binding uses SO_REUSEADDR like asyncio's servers, so a port in TIME_WAIT counts as
    free (the later real bind succeeds too).

    Raises:
        ValueError: a port outside 0..65535, the same port given twice, a port already in use, no
            permission to bind it (below 1024), or a host that is not an address of this machine.
    """
    seen: dict[int, str] = {}
    for name, port in ports:  # every check that needs no socket first: a busy port must not hide them
        if port is None or port == 0:
            continue
        if not 0 < port < 65536:
            raise ValueError(f"{name} {port} is not a port number; allowed 1..65535 (0 = any free port)")
        if port in seen:
            raise ValueError(f"{name} {port} is the same port as {seen[port]}; give them different ports")
        seen[port] = name
    for port, name in seen.items():
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise ValueError(f"--host {host!r} is not an address this machine can listen on ({e.strerror})") from None
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(addr)
                except OSError as e:
                    raise ValueError(_bind_error(name, host, port, e)) from None


def _bind_error(name: str, host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use ({name}); stop the process using it or choose "
                f"another with {name}")
    if e.errno == errno.EACCES:
        return f"no permission to listen on port {port} ({name}); ports below 1024 need root, choose another"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host!r} is not an address of this machine; use 127.0.0.1 or 0.0.0.0"
    return f"cannot listen on {host}:{port} ({name}): {e.strerror or e}"
