"""The package's structure, read from its own source: imports point one way (the table below, written once), no two
modules import each other however indirectly, a function-local import says why it is local, and
docs/development.md's module map names every module there is and the same directions."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ntp_megatron"
PATCHES = REPO / "patches"  # installed as ntp_megatron.patches

# Room -> the rooms it may import. A room is a subpackage, or a cross-cutting module at the top level; ``config.files``
# (YAML reading and the one-line error every layer reports bad input with) is a room of its own at the bottom.
ALLOWED: dict[str, set[str]] = {
    "config.files": set(),
    "phases": set(),
    "sockets": set(),
    "metrics": set(),
    "faults": {"config.files", "phases"},
    "plan": {"config.files"},
    "patches": {"phases"},
    "config": {"config.files", "plan"},
    "core": {"config.files", "plan", "patches", "phases", "sockets"},
    "speed": {"plan", "phases"},
    "elastic": {"config.files", "config", "plan", "core", "patches", "phases", "sockets", "metrics", "faults"},
    "training": {"config.files", "config", "plan", "core", "speed", "elastic", "patches", "phases", "sockets", "metrics",
                 "faults"},
    "launch": {"config.files", "config", "plan", "elastic", "training", "phases", "sockets", "metrics", "faults"},
    "sim": {"config.files", "config", "plan"},
    "bench": {"config.files", "config", "plan", "core", "speed", "elastic", "training", "launch", "sim", "patches",
              "phases", "sockets", "metrics", "faults"},
}
TOP_LEVEL_MAX = 8  # modules directly in ntp_megatron/, __init__.py included


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module of the package
    line: int
    local: bool  # inside a function
    commented: bool  # a comment on its line or the line above


def modules(package: Path = PACKAGE, patches: Path = PATCHES) -> dict[str, Path]:
    """Dotted name -> file, for every module of the installed package (patches/ as ntp_megatron.patches)."""
    found = {}
    for base, root in (("ntp_megatron", package), ("ntp_megatron.patches", patches)):
        for path in root.rglob("*.py"):
            parts = [base, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "(package)"
    if parts[1] == "config" and parts[2:3] == ["files"]:
        return "config.files"
    return parts[1]


def _targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: None if is_package else -1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known and name != module:
            out.append(name)
    return out


def _says_why(line: str) -> bool:
    """A comment on ``line`` with words in it, not only a linter's codes (``# noqa: F401`` says nothing of why)."""
    _, hash_, comment = line.partition("#")
    return bool(hash_) and bool(re.sub(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?", "", comment).strip(" -:"))


def _first_import_of_block(tree: ast.AST) -> dict[int, ast.stmt]:
    """Import statement -> the first of the run of import statements it stands in (a comment above a run of local
    imports covers the run)."""
    out = {}
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            lead = None
            stmts = getattr(parent, field, None)
            for stmt in stmts if isinstance(stmts, list) else []:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    lead = lead or stmt
                    out[id(stmt)] = lead
                else:
                    lead = None
    return out


def imports(known: dict[str, Path]) -> list[Import]:
    found = []
    for module, path in known.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        first_of_block = _first_import_of_block(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            lead = first_of_block.get(id(node), node)
            above = (lambda n: n.lineno > 1 and lines[n.lineno - 2].strip().startswith("#")
                     and _says_why(lines[n.lineno - 2]))
            commented = any(_says_why(lines[n.lineno - 1]) or above(n) for n in (node, lead))
            for target in _targets(node, module, path.name == "__init__.py", known) or [None]:
                found.append(Import(module, target, node.lineno, id(node) in local, commented))
    return found


def _where(i: Import, known: dict[str, Path]) -> str:
    return f"{known[i.source].relative_to(REPO)}:{i.line}"


def backward_imports(found: list[Import]) -> list[Import]:
    return [i for i in found if i.target and room(i.source) != room(i.target)
            and room(i.target) not in ALLOWED.get(room(i.source), set())]


def cycles(found: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges: dict[str, set[str]] = {}
    for i in found:
        if i.target:
            edges.setdefault(i.source, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return known, imports(known)


def test_every_room_is_in_the_table(graph):
    known, _ = graph
    rooms = {room(m) for m in known} - {"(package)"}
    assert rooms == set(ALLOWED), f"rooms without a row: {sorted(rooms - set(ALLOWED))}; " \
                                  f"rows without a room: {sorted(set(ALLOWED) - rooms)}"


def test_imports_point_one_way(graph):
    known, found = graph
    wrong = [f"{_where(i, known)}: {i.source} ({room(i.source)}) imports {i.target} ({room(i.target)})"
             for i in backward_imports(found)]
    assert not wrong, "imports against the allowed directions:\n" + "\n".join(wrong)


def test_the_package_itself_imports_nothing(graph):
    _, found = graph
    assert not [i for i in found if i.source == "ntp_megatron" and i.target]


def test_no_two_modules_import_each_other(graph):
    _, found = graph
    assert cycles(found) == []


def test_a_function_local_import_says_why(graph):
    known, found = graph
    silent = sorted({_where(i, known) for i in found if i.local and not i.commented})
    assert not silent, "function-local imports without a comment saying why:\n" + "\n".join(silent)


def test_the_top_level_keeps_a_handful_of_cross_cutting_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, top


def test_the_rules_catch_a_back_import_and_a_cycle():
    """The checks themselves: an import from plan/ up into core/ and a pair importing each other are found."""
    up = Import("ntp_megatron.plan.layout", "ntp_megatron.core.groups", 1, False, False)
    down = Import("ntp_megatron.core.groups", "ntp_megatron.plan.layout", 1, False, False)
    assert backward_imports([up, down]) == [up]
    assert cycles([up, down]) == [["ntp_megatron.core.groups", "ntp_megatron.plan.layout"]]


# -- docs/development.md ------------------------------------------------------------------------------------------

DEVELOPMENT = REPO / "docs" / "development.md"


def _doc_directions() -> dict[str, set[str]]:
    """The table under "## Allowed directions": ``| room | may import |`` rows."""
    text = DEVELOPMENT.read_text()
    section = text.split("## Allowed directions", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("room", "") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = {c.strip().strip("`") for c in cells[1].split(",") if c.strip() not in ("", "nothing")}
    return rows


def test_development_md_states_the_same_directions():
    assert _doc_directions() == ALLOWED


def _doc_map() -> set[str]:
    """The files the module map under "## Modules" names: a tree of ``name/`` and ``name.py`` lines, two spaces of
    indentation a level, each name followed by its purpose."""
    block = DEVELOPMENT.read_text().split("## Modules", 1)[1].split("```", 2)[1]
    named, folders = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            named.add("/".join([*folders, name]))
    return named


def test_development_md_maps_every_module():
    files = {p.relative_to(REPO).as_posix() for root in (PACKAGE, PATCHES) for p in root.rglob("*.py")}
    named = _doc_map()
    assert not files - named, f"modules missing from docs/development.md: {sorted(files - named)}"
    assert not named - files, f"names in docs/development.md that are no module: {sorted(named - files)}"
