"""Ranking instances placed by Ray (where the cascade spans machines), as the P/D pools place theirs
(`relayinfer.cloud.pd.ray_pool`, whose `start_ray` this reuses).

Each instance is one Ray actor that runs the ordinary instance process (`relayinfer.cloud.relay.server`)
as its child on the node Ray picked, and reports its address. The client then talks to it over the
same websocket protocol and the same affinity router as to a locally spawned instance: only where the
instance runs changes. The checkpoint and the latency model travel as bytes in Ray's object store
(the nodes need no shared filesystem); each actor writes them to a temporary directory it removes on
stop. The child exits with its actor (it watches its parent pid), after its lifetime, or on stop().

Listen address: 127.0.0.1 on a local Ray (one machine: nothing listens beyond loopback); the node's
address when joining a cluster (`address` given), so that the client on another node can reach it;
there every instance requires a random bearer token (`RayInstances.token`, made here, handed to the
actors through Ray and to the client), as every server beyond loopback does.
CPU only: each actor reserves `actor_cpus` Ray CPUs for the compute thread of its instance.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class RelayInstanceActor:
    """Ray actor around one instance process (wrapped by `ray.remote` in `actor_class`).

    Args: name; checkpoint / latency: the files' bytes; config: InstanceConfig fields as a dict;
    baseline: relay disabled; lifetime_s: the child's lifetime; host: listen address, None = this
    node's address; threads: the child's torch threads.
    Raises RuntimeError (from the constructor, surfaced by Ray) if the instance does not start."""

    def __init__(self, name: str, checkpoint: bytes, latency: bytes, config: dict | None, baseline: bool,
                 lifetime_s: float, host: str | None, threads: int = 1, token: str | None = None):
        import ray

        from relayinfer.cloud.relay.instance_proc import spawn_instance

        self.dir = tempfile.mkdtemp(prefix="relay-ray-")
        ck, lat = Path(self.dir) / "model.pt", Path(self.dir) / "latency.json"
        ck.write_bytes(checkpoint)
        lat.write_bytes(latency)
        self.host = host or ray.util.get_node_ip_address()
        try:
            self.proc = spawn_instance(name, str(ck), str(lat), config, baseline=baseline, lifetime_s=lifetime_s,
                                       threads=threads, host=self.host, token=token)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def address(self) -> dict:
        """{"name", "url" (ws://host:port), "fingerprint", "node_id", "pid"} of the instance."""
        import ray

        p = self.proc
        return {"name": p.name, "url": p.url, "fingerprint": p.fingerprint, "pid": p.proc.pid,
                "node_id": ray.get_runtime_context().get_node_id()}

    def stats(self) -> dict:
        """The instance's GET /stats."""
        return self.proc.stats()

    def stop(self) -> None:
        """Stop the instance process and remove the temporary files."""
        try:
            self.proc.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


_ACTOR = None


def actor_class():
    """`ray.remote(RelayInstanceActor)`, made once."""
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(RelayInstanceActor)
    return _ACTOR


class RayInstances:
    """Start `n` instances as Ray actors and wait until each listens.

    Args:
        n: instances (>= 1); checkpoint, latency: file paths on this (the driver's) machine.
        config: InstanceConfig fields (dict); baseline: relay disabled on all.
        address: None = a local Ray (started here if none is running, CPU only), else the cluster to
            join ('auto' = this node's); listen address 127.0.0.1 for a local Ray, the node's otherwise.
        actor_cpus: Ray CPUs each instance reserves; spread: Ray's SPREAD strategy across nodes.
        start_timeout_s: bound on the wait for all instances; ray_cpus: CPUs of a local Ray started
            here (default: max(n, this machine's cores)); a running Ray is reused as it is.
    Attributes: `urls` (name -> ws url), `fingerprint`, `placement` (the address() of each), `token`
    (the instances' bearer token on a cluster, None on a local Ray).
    Raises ValueError for n < 1 or a missing file; RuntimeError if an instance does not start in time.
    """

    def __init__(self, n: int, checkpoint: str | os.PathLike, latency: str | os.PathLike, config: dict | None = None,
                 baseline: bool = False, address: str | None = None, actor_cpus: float = 1.0, spread: bool = True,
                 lifetime_s: float = 3600.0, threads: int = 1, start_timeout_s: float = 300.0,
                 ray_cpus: int | None = None):
        import ray

        from relayinfer.cloud.pd.ray_pool import start_ray

        if n < 1:
            raise ValueError(f"need at least 1 instance, got {n}")
        for what, f in (("checkpoint", checkpoint), ("latency model", latency)):
            if not Path(f).is_file():
                raise ValueError(f"{what} {f} not found")
        start_ray(address, num_cpus=ray_cpus if ray_cpus is not None else max(n, os.cpu_count() or 1))
        import secrets

        host = "127.0.0.1" if address is None else None
        self.token = None if address is None else secrets.token_urlsafe(24)
        ck, lat = ray.put(Path(checkpoint).read_bytes()), ray.put(Path(latency).read_bytes())
        cls = actor_class().options(num_cpus=actor_cpus, max_restarts=0,
                                    **({"scheduling_strategy": "SPREAD"} if spread else {}))
        self.actors = [cls.remote(f"i{k}", ck, lat, config, baseline, lifetime_s, host, threads, self.token)
                       for k in range(n)]
        try:
            self.placement = ray.get([a.address.remote() for a in self.actors], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise RuntimeError(f"{n} Ray-placed ranking instances did not start within {start_timeout_s:.0f} s")
        except BaseException:
            self.stop()
            raise
        self.urls = {p["name"]: p["url"] for p in self.placement}
        self.fingerprint = self.placement[0]["fingerprint"]

    def stats(self) -> list[dict]:
        """GET /stats of every instance (through its actor)."""
        import ray

        return ray.get([a.stats.remote() for a in self.actors], timeout=30)

    def stop(self) -> None:
        """Stop every instance process, then its actor."""
        import ray

        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a, no_restart=True)
        self.actors = []
