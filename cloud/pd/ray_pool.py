"""P/D instances as Ray actors: placement, restarts and KV movement by Ray.

* Each instance is one async Ray actor (`InstanceActor`) holding an `Instance` (its own
  `LLMEngine` and paged KV cache). Actors are restarted by Ray when their process dies
  (`max_restarts`); the gateway retries the requests they held (`gateway.py`).
* The model weights are put in the object store once by the driver; every actor maps them
  zero-copy on its node (no per-actor GGUF dequantization, one copy of the weights per node).
* KV hand-off: the prefill actor `ray.put`s its export, one object (contiguous) or one per 16-token
  block (block-fixed), and returns only their references; the gateway passes the `Handoff` to the
  decode actor, which fetches the objects from the object store: shared memory on one node, Ray's
  object transfer across nodes. The KV never passes through the gateway.

`start_ray(address)` starts a local Ray (the default, one machine) or joins a cluster
(`ray start --head` on one node, `ray start --address=HEAD:6379` on the others, then
`relayinfer pd serve --ray-address auto` on the head).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict

from .gateway import Group, GroupSpec
from .instance import Handoff, Instance, InstanceConfig

NAMESPACE = "relayinfer-pd"


LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's switch for "this node is the whole cluster"


def ray_init_kwargs(address: str | None = None, num_cpus: int | None = None, **kw) -> tuple[dict, dict]:
    """(`ray.init` keyword arguments, environment variables to set first) of `start_ray`.

    A local Ray (`address` None) is one machine's: it listens on loopback only and starts no
    dashboard. `_node_ip_address="127.0.0.1"` alone is not enough (Ray resolves a loopback address
    to the node's routable one and then listens on all interfaces); with
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` it keeps 127.0.0.1 and its GCS, raylet, object manager
    and workers listen there. Joining a cluster (`address` given) changes neither.
    """
    opts = dict(include_dashboard=False, log_to_driver=kw.pop("log_to_driver", False), namespace=NAMESPACE,
                configure_logging=False)
    env: dict = {}
    if address is None:
        opts["num_cpus"] = num_cpus if num_cpus is not None else os.cpu_count()
        opts["_node_ip_address"] = "127.0.0.1"
        env = dict(LOCAL_RAY_ENV)
    return {"address": address, **opts, **kw}, env


def start_ray(address: str | None = None, num_cpus: int | None = None, **kw) -> None:
    """`ray.init` once: a local Ray when `address` is None (loopback only, no dashboard: see
    `ray_init_kwargs`), else join that cluster ('auto' = the cluster this node belongs to). A
    SIGTERM handler the process had installed stays in place (ray.init replaces it with its own)."""
    import sys

    kwargs, env = ray_init_kwargs(address, num_cpus, **kw)
    os.environ.update(env)  # before Ray reads it (its child processes inherit it too)
    import ray

    if ray.is_initialized():
        return
    consts = sys.modules.get("ray._private.ray_constants")
    if env and consts is not None:  # imported before the variable was set: the value it read at import
        consts.ENABLE_RAY_CLUSTER = False
    import signal
    import threading

    mine = signal.getsignal(signal.SIGTERM)
    ours = callable(mine) and threading.current_thread() is threading.main_thread()
    try:
        ray.init(**kwargs)  # first puts its own SIGTERM handler over the application's: sys.exit(15)
    except SystemExit as e:
        if ours and e.code == signal.SIGTERM:  # a SIGTERM during ray.init: the application's handler decides
            mine(signal.SIGTERM, None)
        raise
    if ours:
        signal.signal(signal.SIGTERM, mine)


def model_weights(model) -> tuple:
    """(config, {name: numpy in the model's dtype}, {module name: `ggml_blocks.Blocks`}) of a loaded
    `Llama`: what actors rebuild the model from (bfloat16 as `ml_dtypes.bfloat16`). The third part
    holds the GGUF blocks of a model loaded with weights 'gguf' (`llama.BlockLinear.blocks`; empty
    for fp32): their kernel operands are not in `state_dict`, and their packed layout is the packing
    CPU's."""
    from relayinfer.cloud.models.llama import BlockLinear
    from relayinfer.cloud.pd.kv import _numpy

    blocks = {name: m.blocks() for name, m in model.named_modules() if isinstance(m, BlockLinear)}
    return model.cfg, {k: _numpy(v) for k, v in model.state_dict().items()}, blocks


def build_model(cfg, weights: dict, blocks: dict | None = None):
    """A `Llama` on `weights` (read-only zero-copy arrays from the object store are fine: inference
    never writes them) and `blocks` (`model_weights`' third part: those linears become `BlockLinear`s
    again, the same bits as the driver's), its other linears prepared as `TorchEngine`'s
    (`llama.pack_linears`: the same arithmetic and speed as `cloud serve`'s engine; packed copies
    are the actor's own memory, the dense weights stay shared)."""
    import torch

    from relayinfer.cloud.models.llama import BlockLinear, Llama, pack_linears, rope_bases, set_block_linear
    from relayinfer.cloud.pd.kv import _tensor

    with torch.device("meta"):
        model = Llama(cfg)
    state = {k: _tensor(v) for k, v in weights.items()}
    model.load_state_dict(state, assign=True, strict=False)
    for name, b in (blocks or {}).items():  # "layers.3.attn.wqkv": a fused key replaces its parts
        _, i, key = name.split(".", 2)
        set_block_linear(model.layers[int(i)], key, BlockLinear(b, state.get(f"{name}.bias")))
    if cfg.tied_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_bases(cfg)
    return pack_linears(model.eval())


class InstanceActor:
    """The Ray actor around one `Instance` (wrapped by `ray.remote` in `actor_class`)."""

    def __init__(self, model_ref, name: str, role: str, config: dict, threads: int = 1):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = build_model(*model_ref)
        self.inst = Instance(self.model, name, role, InstanceConfig(**config), in_process=False)
        self.inst.engine.generate([list(range(16, 48))], _warm_params())  # first steps allocate
        self.inst.engine.prefill_tok_s = None  # the warm-up's speed (allocation) is no estimate: back to the prior
        self.started = time.time()
        self.die_after_handoff = 0

    async def ready(self) -> dict:
        return {"name": self.inst.name, "pid": os.getpid(), "node": _node_ip(), "started": self.started}

    async def prefill(self, request_id, prompt_ids, params, output_ids=(), ttft_budget_ms=None):
        import ray

        ho = await self.inst.prefill(request_id, prompt_ids, params, output_ids, ttft_budget_ms)
        if isinstance(ho, Handoff) and ho.kv is not None:  # into the object store: 1 or one per block
            ho.kv.parts = [ray.put(p) for p in ho.kv.parts]
            if self.die_after_handoff > 0:  # dies while the decode side fetches: the objects it owns go too
                self.die_after_handoff -= 1
                asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        return ho

    async def decode(self, handoff: Handoff, request_id: str, cloud_budget=None):
        t0 = time.perf_counter()
        refs = handoff.kv.parts
        handoff.kv.parts = list(await asyncio.gather(*refs))
        handoff.kv.fetch_s = time.perf_counter() - t0
        del refs
        async for o in self.inst.decode(handoff, request_id, cloud_budget):
            yield o

    async def generate(self, request_id, prompt_ids, params, cloud_budget=None, output_ids=(), ttft_budget_ms=None):
        async for o in self.inst.generate(request_id, prompt_ids, params, cloud_budget, output_ids, ttft_budget_ms):
            yield o

    async def abort(self, request_id: str) -> None:
        self.inst.abort(request_id)

    async def set_budget(self, request_id: str, budget: int) -> None:
        self.inst.set_budget(request_id, budget)

    async def set_role(self, role: str) -> None:
        self.inst.role = role

    async def set_fault(self, die_after_export: int = 0, die_after_tokens: int | None = None,
                        die_after_handoff: int = 0, fail_engine: bool = False) -> None:
        """Injected faults: the next prefills die after their export (before answering) or right
        after answering (their KV objects die with them), the next decode after n tokens;
        `fail_engine`: the engine's next step fails (`Instance.set_fault`)."""
        self.inst.set_fault(die_after_export, die_after_tokens, fail_engine)
        self.die_after_handoff = die_after_handoff

    async def load(self) -> dict:
        return self.inst.load()

    async def prefix_hits(self, request_id: str) -> int | None:
        return self.inst.prefix_hits(request_id)

    async def transfers(self) -> list:
        return list(self.inst.transfers)

    async def shutdown(self) -> None:
        self.inst.shutdown()


def _warm_params():
    from relayinfer.protocol.model.decoding import SamplingParams

    return SamplingParams(max_new_tokens=2)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover
        return "?"


_ACTOR = None


def actor_class():
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(InstanceActor)
    return _ACTOR


class RayHandle:
    """The gateway's view of one `InstanceActor` (same interface as `gateway.LocalHandle`)."""

    def __init__(self, actor, name: str, role: str, factory=None):
        self.actor, self.name, self._role = actor, name, role
        self._factory = factory  # role -> a new actor of this instance (for restart)

    async def restart(self) -> None:
        """Replace the actor by a new one (Ray's own restarts count over an actor's life; the
        gateway's budget counts per time window). Raises RuntimeError without a factory."""
        import ray

        if self._factory is None:
            raise RuntimeError(f"instance {self.name} has no actor factory: it cannot be replaced")
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass
        self.actor = self._factory(self._role)
        await self.actor.ready.remote()

    @property
    def role(self) -> str:
        return self._role

    async def set_role(self, role: str) -> None:
        self._role = role
        await self.actor.set_role.remote(role)

    async def prefill(self, request_id, prompt_ids, params, output_ids=(), ttft_budget_ms=None):
        return await self.actor.prefill.remote(request_id, prompt_ids, params, list(output_ids), ttft_budget_ms)

    async def decode(self, handoff: Handoff, request_id: str, cloud_budget=None):
        async for ref in self.actor.decode.remote(handoff, request_id, cloud_budget):
            yield await ref

    async def generate(self, request_id, prompt_ids, params, cloud_budget=None, output_ids=(), ttft_budget_ms=None):
        async for ref in self.actor.generate.remote(request_id, prompt_ids, params, cloud_budget, list(output_ids),
                                                    ttft_budget_ms):
            yield await ref

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def set_budget(self, request_id: str, budget: int) -> None:
        await self.actor.set_budget.remote(request_id, budget)

    async def set_fault(self, **kw) -> None:
        await self.actor.set_fault.remote(**kw)

    async def load(self) -> dict:
        return await self.actor.load.remote()

    async def prefix_hits(self, request_id: str) -> int | None:
        return await self.actor.prefix_hits.remote(request_id)

    async def shutdown(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayPool:
    """Start the actors of `specs` (one per instance) and build the gateway's groups.

    Args:
        model: a loaded `Llama` (or anything with `.model`), put in the object store once.
        specs: instances per scenario group.
        config: engine/transfer settings of every instance.
        threads: torch threads per actor; actor_cpus: Ray CPUs each actor reserves (0 lets more
            actors than cores share a small machine).
        spread: place actors across nodes (Ray's SPREAD strategy) instead of packing.
        max_restarts: Ray restarts of a dead actor.
        placement_timeout_s: longest wait for every actor to be placed and loaded (s).

    Raises:
        ValueError: the instances ask for more Ray CPUs than the cluster has (before any actor
            starts: the message names the counts and the --actor-cpus that fits), or they were not
            all placed within `placement_timeout_s` (the placed ones are killed).
    """

    def __init__(self, model, specs: list[GroupSpec], config: InstanceConfig | None = None, threads: int = 1,
                 actor_cpus: float = 1.0, spread: bool = False, max_restarts: int = 3,
                 placement_timeout_s: float = 300.0):
        import ray

        n = sum(spec.n_prefill + spec.n_decode for spec in specs)
        have = float(ray.cluster_resources().get("CPU", 0.0))
        if n * actor_cpus > have + 1e-9:  # Ray would leave the rest pending for ever
            fit = int(have / actor_cpus) if actor_cpus else n
            raise ValueError(f"{n} instances x {actor_cpus:g} Ray CPUs each = {n * actor_cpus:g} CPUs asked; the Ray "
                             f"cluster has {have:g} (available now: "
                             f"{float(ray.available_resources().get('CPU', 0.0)):g}), so only {fit} can be placed: "
                             f"pass --actor-cpus {have / n:.2g} (instances share cores) or fewer instances")
        model = getattr(model, "model", model)
        self.model_ref = ray.put(model_weights(model))
        cls = actor_class().options(num_cpus=actor_cpus, max_restarts=max_restarts, max_task_retries=0,
                                    max_concurrency=1000, **({"scheduling_strategy": "SPREAD"} if spread else {}))
        cfg = asdict(config or InstanceConfig())
        self.groups: list[Group] = []
        actors = []
        for spec in specs:
            g = Group(spec.scenario)
            for role, n in (("prefill", spec.n_prefill), ("decode", spec.n_decode)):
                for i in range(n):
                    name = f"{spec.scenario.name}-{role[0]}{i}"
                    make = (lambda name: lambda r: cls.remote(self.model_ref, name, r, cfg, threads))(name)
                    a = make(role)
                    (g.prefill if role == "prefill" else g.decode).append(RayHandle(a, name, role, make))
                    actors.append(a)
            self.groups.append(g)
        ready = [a.ready.remote() for a in actors]
        done, pending = ray.wait(ready, num_returns=len(ready), timeout=placement_timeout_s)
        if pending:  # e.g. the CPUs are there but held by other work, or a node went away
            names = [h.name for h in self.handles]  # in the order the actors were made
            late = [names[ready.index(r)] for r in pending]
            for a in actors:
                ray.kill(a, no_restart=True)
            raise ValueError(f"{len(late)} of {len(actors)} instances not placed within {placement_timeout_s:g} s "
                             f"({', '.join(late)}): Ray has {float(ray.available_resources().get('CPU', 0.0)):g} of "
                             f"{float(ray.cluster_resources().get('CPU', 0.0)):g} CPUs free for {actor_cpus:g} each; "
                             "pass a smaller --actor-cpus or fewer instances")
        self.placement = ray.get(ready)

    @property
    def handles(self) -> list[RayHandle]:
        return [h for g in self.groups for h in g.prefill + g.decode]

    def handle(self, name: str) -> RayHandle:
        return next(h for h in self.handles if h.name == name)

    def shutdown(self) -> None:
        import ray

        for h in self.handles:
            ray.kill(h.actor, no_restart=True)

