"""One ranking instance as a child process of this one: `spawn_instance` starts
`python -m relayinfer.cloud.relay.server` and waits for its READY line; `InstanceProc` addresses,
queries and stops it. Used by the cascade front end (`client.RelayClient`, placement "process") and
by the Ray actor that runs an instance on a Ray node (`ray_place.RelayInstanceActor`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


@dataclass
class InstanceProc:
    """A spawned ranking instance: name, port, model fingerprint, process, listen address."""
    name: str
    port: int
    fingerprint: str
    proc: subprocess.Popen
    host: str = "127.0.0.1"
    token: str | None = None  # the instance's bearer token (None: it needs none)

    @property
    def url(self) -> str:
        """ws:// address of the instance."""
        return f"ws://{self.host}:{self.port}"

    def stats(self, timeout: float = 5.0) -> dict:
        """GET /stats from the instance (counters as a dict)."""
        req = urllib.request.Request(f"http://{self.host}:{self.port}/stats",
                                     headers={"Authorization": f"Bearer {self.token}"} if self.token else {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after timeout seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def spawn_instance(name: str, checkpoint: str, latency: str, config: dict | None = None, baseline: bool = False,
                   lifetime_s: float = 600.0, start_timeout_s: float = 120.0, env: dict | None = None,
                   cpus: list[int] | None = None, threads: int = 1, host: str = "127.0.0.1",
                   token: str | None = None) -> InstanceProc:
    """Start `python -m relayinfer.cloud.relay.server` on a free port of `host` and wait for READY.
    cpus: pin the instance to these CPU ids (None: not pinned); threads: its torch threads. The child
    exits when this process dies, after lifetime_s, or on stop(). Raises RuntimeError if it does not
    come up within start_timeout_s (or exits, e.g. on CPU ids this machine does not have).
    token: the bearer token the instance requires (handed over in its environment, not on its
    command line; a RELAYINFER_TOKEN of this process is not passed on); needed for a non-loopback
    `host`, where the instance refuses to start without one."""
    from relayinfer.protocol.transport.security import TOKEN_ENV

    cmd = [sys.executable, "-m", "relayinfer.cloud.relay.server", "--port", "0", "--checkpoint", checkpoint,
           "--latency", latency, "--parent-pid", str(os.getpid()), "--lifetime-s", str(lifetime_s),
           "--threads", str(int(threads)), "--host", host]
    if cpus:
        cmd += ["--cpus", ",".join(str(int(c)) for c in cpus)]
    if config:
        cmd += ["--config", json.dumps(config)]
    if baseline:
        cmd.append("--baseline")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, **(env or {}),
                                 **({TOKEN_ENV: token} if token else {})})
    t_end = time.monotonic() + start_timeout_s
    line = ""
    while time.monotonic() < t_end and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            _, port, fp = line.split()
            return InstanceProc(name, int(port), fp, proc, host, token)
    proc.kill()
    raise RuntimeError(f"ranking instance {name} did not start (last line {line!r}, rc {proc.poll()})")
