"""The shape of the code at a git revision, read from the source with `ast` (nothing imported):
the largest classes by field count, functions over 80 lines, import cycles between our modules,
README lines, and the places that decide where an answer ends.

    python -m bench.code_shape REV [REV ...] [--out bench/results/code-shape.json]

A class's fields: its annotated class-level names (dataclass / msgspec fields) plus every distinct
`self.<name> = ...` target in its methods. A function's length: `end_lineno - lineno + 1` of its
`def` (nested functions counted on their own too). The finish sites: every comparison of a token
id with an EOS id (`== eos_id`, `== engine.eos_id`, ...) and every call of the shared finish rule
(`finish_reason(...)`, `is_stop(...)`), counted per file, outside tests and benchmarks.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("protocol", "cloud", "device", "sdk")
LONG = 80


def _tree(rev: str, dest: Path) -> None:
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(dest, filter="data")


def _class_fields(node: ast.ClassDef) -> set[str]:
    names = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    for fn in ast.walk(node):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                    n, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for x in ast.walk(t):
                        if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                            names.add(x.attr)
    return names


def _is_eos_compare(n: ast.AST) -> bool:
    if not isinstance(n, ast.Compare):
        return False
    for side in [n.left, *n.comparators]:
        name = side.attr if isinstance(side, ast.Attribute) else side.id if isinstance(side, ast.Name) else ""
        if name in ("eos_id", "eos"):
            return True
    return False


def shape(root: Path) -> dict:
    """The measures of the module docstring for the source tree at `root`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_layering import all_edges, cycles  # the same reader the layering test uses

    classes, long_fns, finish = [], [], {}
    py = sorted(f for layer in LAYERS for f in (root / layer).rglob("*.py"))
    for f in py:
        rel = str(f.relative_to(root))
        tree = ast.parse(f.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                classes.append({"class": f"{rel}:{n.name}", "fields": len(_class_fields(n)),
                                "lines": n.end_lineno - n.lineno + 1})
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > LONG:
                long_fns.append({"function": f"{rel}:{n.name}", "lines": n.end_lineno - n.lineno + 1})
            if _is_eos_compare(n) or (isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)) and (
                    n.func.id if isinstance(n.func, ast.Name) else n.func.attr) in ("finish_reason", "is_stop")):
                finish[rel] = finish.get(rel, 0) + 1
    mods, edges = all_edges(root)
    classes.sort(key=lambda c: -c["fields"])
    readme = root / "README.md"
    return {"largest_classes": classes[:5], "functions_over_80_lines": sorted(long_fns, key=lambda x: -x["lines"]),
            "import_cycles": cycles(mods, edges), "readme_lines": len(readme.read_text().splitlines()),
            "finish_sites": finish, "python_files": len(py),
            "protocol_top_level_modules": sorted(p.name for p in (root / "protocol").glob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("revs", nargs="+", help="git revisions (commits, branches)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    out = {"command": "python -m bench.code_shape " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "revisions": {}}
    for rev in a.revs:
        with tempfile.TemporaryDirectory() as d:
            _tree(rev, Path(d))
            commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()
            out["revisions"][rev] = {"commit": commit, **shape(Path(d))}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
