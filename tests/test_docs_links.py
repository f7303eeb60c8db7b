"""The documentation stays navigable: every relative link in README.md and docs/*.md points at a file
that exists (and, for a link into a markdown page, at a heading that exists), the README stays short,
and no tracked source or documentation file cites tracker numbers a reader cannot look up."""
from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A tracker reference: the word issue with a number, or a hash sign with a number; not a markdown
# anchor such as "(#error-codes)", a numeric HTML entity, or the status lines libFuzzer prints
# (a hash sign, a number and a tab).
_TRACKER_REF = re.compile(r"\b[Ii]ssues? ?#?\d+|(?<![\w&/(\[\"'#])#\d{1,4}\b(?!\t|\\t)")


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _outside_code(text: str, inline: bool = False) -> list[str]:
    """The lines of a markdown text outside fenced code blocks; inline code cut out unless `inline`."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        lines.append("" if fenced else line if inline else re.sub(r"`[^`]*`", "", line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(page.read_text(encoding="utf-8"), inline=True):
        m = _HEADING.match(line)
        if m is None:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return [m.group(1) for line in _outside_code(text) for m in _LINK.finditer(line)]


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked sdist): walk the tree
        names = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("build", "dist", "node_modules")]
            names += [str(Path(d, f).relative_to(ROOT)) for f in files]
    return [ROOT / n for n in names if n.endswith((".py", ".md")) and (ROOT / n).is_file()]


def test_the_pages_exist_and_link_somewhere():
    pages = _doc_pages()
    names = {p.name for p in pages}
    for want in ("ARCHITECTURE.md", "SERVING.md", "SPLIT.md", "PD.md", "RELAY.md", "PATHOLOGY.md",
                 "BENCHMARKS.md", "PROTOCOL.md"):
        assert want in names, f"docs/{want} is missing"
    readme_targets = {t.split("#")[0] for t in _links(ROOT / "README.md")}
    for want in names - {"README.md"}:
        assert f"docs/{want}" in readme_targets, f"README.md does not link docs/{want}"


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


_CODE_REF = re.compile(r"`((?:[a-z_]+/)+[a-z_]+\.py)` `([A-Za-z_][\w.]*)`")


def _defined(path: Path) -> set[str]:
    """Qualified names defined in a Python file: functions, classes and their methods (`A.b`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{m.name}" for m in node.body
                      if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def test_architecture_names_real_code():
    """Every "`file.py` `Name`" pair in docs/ARCHITECTURE.md (the life of a token) is defined there."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    refs = set(_CODE_REF.findall(text))
    assert len(refs) >= 25, f"only {len(refs)} code references found: the pattern or the page changed"
    bad = [f"{f} {name}" for f, name in sorted(refs)
           if not (ROOT / f).is_file() or name not in _defined(ROOT / f)]
    assert not bad, "docs/ARCHITECTURE.md names code that does not exist: " + ", ".join(bad)


_PATH_IN_CODE = re.compile(r"`((?:bench|docs|tests|cloud|device|protocol|sdk|\.ci)/[\w./-]*[\w/])`")


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_in_code_exists(page: Path):
    """A path written as code (`bench/results/x.json`) names a file or folder of this repository
    (or `module/file.function`, a function of an existing file)."""
    bad = []
    for path in sorted(set(_PATH_IN_CODE.findall(page.read_text(encoding="utf-8")))):
        module = path.rsplit(".", 1)[0] + ".py"
        if not (ROOT / path).exists() and not (ROOT / module).is_file():
            bad.append(path)
    assert not bad, f"{page.relative_to(ROOT)} names paths that do not exist: {bad}"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_no_tracker_numbers_in_sources_or_docs():
    files = _tracked_files()
    assert len(files) > 50, f"found only {len(files)} .py/.md files: the listing is wrong"
    hits = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            m = _TRACKER_REF.search(line)
            if m:
                hits.append(f"{f.relative_to(ROOT)}:{i}: {m.group(0)!r}")
    assert not hits, "describe the software, not its history:\n" + "\n".join(hits[:50])


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    """The patterns themselves: a tracker reference is found, an anchor or an entity is not."""
    n = "16"  # the examples are built here so that this file does not match itself
    for s in ("see issue " + n, "Issue #" + n + " says", "fixed in #" + n + ".", "issues " + n):
        assert _TRACKER_REF.search(s), s
    h = "#"
    for s in ("[section 6](" + h + "6-error-codes)", "&" + h + "39;", h + "2\tINITED cov: 7", '"' + h + '10\\tpulse',
              "tissue" + " 3"):
        assert not _TRACKER_REF.search(s), s
    assert _slug("P/D serving") == "pd-serving"
    assert _slug("Reliability: soak, links, fuzzing") == "reliability-soak-links-fuzzing"
    page = tmp_path / "x.md"
    page.write_text("# A `b` c\n\n[x](y.md) ![i](img/p.png \"t\") `[no](link.md)`\n```\n[no](z.md)\n```\n")
    assert _links(page) == ["y.md", "img/p.png"]
    assert _anchors(page) == {"a-b-c"}
