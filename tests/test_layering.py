"""The package layering, read from the source (ast, nothing imported): every `import` / `from ...
import` of every module under protocol/, cloud/, device/ and sdk/, at module level or inside a
function, resolved to the module it names.

The rules:
- no import cycles between modules, counting imports inside functions too (a lazy import still
  ties the two modules together; a shared piece belongs in a lower or a small shared module);
- protocol/ (the wire layer) imports nothing of cloud/, device/ or sdk/, and never torch;
- the wire contract (the modules directly in protocol/) is sans-I/O: no asyncio, sockets, TLS or
  websockets/aiohttp, and nothing of its own adapters (protocol/transport/) or of the shared model
  side (protocol/model/); those two import the contract, never the other way round;
- device/ (the on-device install, no torch) imports neither torch, cloud/ nor sdk/, anywhere;
- cloud/ never imports device/ or sdk/ (what both sides need lives in protocol/);
- sdk/ imports cloud/ only inside functions: the CLI and `load_engine` load the cloud side lazily,
  when a sub-command needs it, so `import relayinfer.sdk` works on a device-only install.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("protocol", "cloud", "device", "sdk")
IO_PACKAGES = ("asyncio", "socket", "ssl", "websockets", "aiohttp")


@dataclass(frozen=True)
class Edge:
    src: str          # importing module, e.g. relayinfer.sdk.cli
    dst: str          # imported module (a module of ours when it resolves to one), e.g. torch
    lazy: bool        # inside a function (runs when called), not at import time
    line: int

    def __str__(self) -> str:
        return f"{self.src}:{self.line} -> {self.dst}{' (in a function)' if self.lazy else ''}"


def our_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """relayinfer.<layer>.<path> -> (file, is a package __init__) for every .py under the layers."""
    mods = {}
    for layer in LAYERS:
        for f in sorted((root / layer).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(["relayinfer", *(parts[:-1] if is_pkg else parts)])] = (f, is_pkg)
    return mods


def import_edges(name: str, source: str, is_pkg: bool, mods) -> list[Edge]:
    """The imports of module `name` (its `source`): relative ones resolved, `from a import b`
    naming module a.b when that is one of `mods`, else a."""
    out: list[Edge] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            inner = lazy or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.Import):
                out.extend(Edge(name, a.name, inner, ch.lineno) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom):
                if ch.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (ch.level - 1)]
                    mod = ".".join(base + ([ch.module] if ch.module else []))
                else:
                    mod = ch.module
                for a in ch.names:
                    sub = f"{mod}.{a.name}"
                    out.append(Edge(name, sub if sub in mods else mod, inner, ch.lineno))
            visit(ch, inner)

    visit(ast.parse(source), False)
    return out


def all_edges(root: Path = ROOT) -> tuple[dict, list[Edge]]:
    mods = our_modules(root)
    edges = [e for m, (f, pkg) in mods.items() for e in import_edges(m, f.read_text(), pkg, mods)]
    return mods, edges


def cycles(mods, edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj: dict[str, list[str]] = {m: [] for m in mods}
    for e in edges:
        if e.dst in mods and e.dst != e.src:
            adj[e.src].append(e.dst)
    index, low, stack, on, found, counter = {}, {}, [], set(), [], 0
    for start in mods:
        if start in index:
            continue
        work = [(start, iter(adj[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(adj[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return found


def layer(module: str) -> str:
    return module.split(".")[1]


def violations(edges: list[Edge]) -> list[str]:
    """Every edge that breaks a layering rule of the module docstring, as text."""
    bad = []
    for e in edges:
        src, dst = layer(e.src), e.dst
        ours = dst.split(".")[1] if dst.startswith("relayinfer.") else None
        if src in ("protocol", "device") and (dst == "torch" or dst.startswith("torch.")):
            bad.append(f"{e}: {src}/ must not import torch")
        if src == "protocol" and ours not in (None, "protocol"):
            bad.append(f"{e}: protocol/ imports only protocol/")
        if src == "protocol" and e.src.count(".") == 2 and (
                dst.split(".")[0] in IO_PACKAGES or dst.startswith(("relayinfer.protocol.transport",
                                                                    "relayinfer.protocol.model"))):
            bad.append(f"{e}: the wire contract is sans-I/O")
        if src == "device" and ours in ("cloud", "sdk"):
            bad.append(f"{e}: device/ must not import {ours}/")
        if src == "cloud" and ours in ("device", "sdk"):
            bad.append(f"{e}: cloud/ must not import {ours}/")
        if src == "sdk" and ours == "cloud" and not e.lazy:
            bad.append(f"{e}: sdk/ imports cloud/ only inside functions")
    return bad


@pytest.fixture(scope="module")
def graph():
    return all_edges()


def test_the_reader_sees_the_packages_and_their_imports(graph):
    mods, edges = graph
    assert len(mods) > 60 and all(any(m.startswith(f"relayinfer.{x}") for m in mods) for x in LAYERS)
    seen = {(e.src, e.dst, e.lazy) for e in edges}
    # known imports of each kind: module level, in a function, relative, `from package import module`
    assert ("relayinfer.sdk.cli", "relayinfer.sdk.patho_cli", False) in seen
    assert ("relayinfer.sdk.cli", "relayinfer.cloud.export", True) in seen
    assert ("relayinfer.cloud.engine.llm_engine", "relayinfer.cloud.engine.block_manager", False) in seen
    assert ("relayinfer.cloud.engine.llm_engine", "torch", False) not in seen  # it imports torch via others
    assert any(e.src.startswith("relayinfer.cloud") and e.dst == "torch" for e in edges)


def test_no_import_cycles(graph):
    found = cycles(*graph)
    assert not found, f"import cycles: {found}"


def test_layering_rules(graph):
    bad = violations(graph[1])
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_cycle_and_each_rule(tmp_path):
    """The same checks on a small fake tree that breaks every rule once."""
    files = {
        "protocol/__init__.py": "", "protocol/a.py": "import torch\nfrom relayinfer.device import b\n",
        "protocol/w.py": "import asyncio\n",
        "device/__init__.py": "", "device/b.py": "def f():\n    from relayinfer.cloud import c\n",
        "cloud/__init__.py": "", "cloud/c.py": "from . import d\n", "cloud/d.py": "from .c import x\nimport relayinfer.sdk.e\n",
        "sdk/__init__.py": "", "sdk/e.py": "from relayinfer.cloud import c\n\ndef g():\n    import relayinfer.cloud.d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods, edges = all_edges(tmp_path)
    assert cycles(mods, edges) == [["relayinfer.cloud.c", "relayinfer.cloud.d", "relayinfer.sdk.e"]]
    bad = violations(edges)
    assert sorted(b.split(": ", 1)[1] for b in bad) == sorted([
        "protocol/ must not import torch", "protocol/ imports only protocol/", "the wire contract is sans-I/O",
        "device/ must not import cloud/",
        "cloud/ must not import sdk/", "sdk/ imports cloud/ only inside functions"])
