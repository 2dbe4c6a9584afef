"""Every key of the control-plane store has one owner module, which holds its name, its writers and its readers
(:mod:`ntp_megatron.elastic.keys` lists them). This scans the package's source so that it cannot drift: outside the
owners no module calls the store's key methods, writes a key's literal prefix, or names another owner's key."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import ntp_megatron

PACKAGE = Path(ntp_megatron.__file__).parent
OWNERS = {
    "ntp_megatron.elastic.keys": "every key no protocol module below owns",
    "ntp_megatron.elastic.commit": "the commit protocol and the run's progress",
    "ntp_megatron.elastic.publication": "what a generation is",
    "ntp_megatron.launch.nodes": "between the launchers of a job's nodes",
}
SHARED = {"PREFIX"}
"""Names an owner may use from another owner: the ``elastic/`` namespace every owner builds its keys in."""
NOT_KEYS = {("ntp_megatron.elastic.keys", "process_group_prefix")}
"""Not a key of the control plane: the prefix under which torch.distributed's own rendezvous runs."""
ALLOWED = {
    # The load test drives the runtime's own CommitProtocol.bring/fetch, which take the decision key to carry.
    ("ntp_megatron.bench.control_plane", "ntp_megatron.elastic.commit", "formed_key"),
    ("ntp_megatron.bench.control_plane", "ntp_megatron.elastic.commit", "decision_key"),
}

STORE_ONLY = {"compare_set", "multi_get", "multi_set", "delete_key", "num_keys"}
"""Methods nothing but a store has: a call anywhere outside the owners is a raw store call."""
STORE_ALSO = {"set", "get", "add", "check", "wait"}
"""Methods a store shares with sets, dicts and events: a raw store call where the receiver is named like a store
(``store``, ``self._store``, ``root``, ``ctl``, ...) or an argument names a key."""
STORE_NAMES = re.compile(r"(^|_)(store|root|ctl|local|shared|monitor)$")
KEY_PREFIX = re.compile(r"^(elastic/|launcher/|topology/|gen\d+/)")


def module_name(path: Path) -> str:
    return ".".join(("ntp_megatron",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


@functools.lru_cache(maxsize=1)
def sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def key_names(tree: ast.Module) -> set[str]:
    """An owner's key names: module-level constants that are a key (a literal with a key's prefix, or built from
    one: ``PREFIX + "..."``) and functions that return an f-string."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if (isinstance(value, ast.Constant) and isinstance(value.value, str) and KEY_PREFIX.match(value.value)) \
                    or isinstance(value, ast.BinOp):
                names.add(node.targets[0].id)
        elif isinstance(node, ast.FunctionDef):
            returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return)]
            if returns and all(isinstance(r, ast.JoinedStr) for r in returns):
                names.add(node.name)
    return names


def receiver(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def literal_prefix(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(KEY_PREFIX.match(node.value))
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        first = node.values[0].value
        return bool(KEY_PREFIX.match(first)) or (first == "gen" and len(node.values) > 2 and isinstance(
            node.values[2], ast.Constant) and node.values[2].value.startswith("/"))
    return False


def imported(tree: ast.Module) -> tuple[dict[str, str], list[tuple[str, str, int]]]:
    """Aliases of modules (``from ntp_megatron.elastic import keys`` -> keys: ntp_megatron.elastic.keys), and the
    names imported from modules (module, name, line)."""
    aliases, names = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                names.append((node.module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(
                    ".")[0]
    return aliases, names


def violations(trees: dict[str, ast.Module]) -> list[str]:
    owned = {owner: key_names(trees[owner]) for owner in OWNERS}
    out = []
    for module, tree in trees.items():
        aliases, from_imports = imported(tree)
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            where = f"{module}:{getattr(node, 'lineno', '?')}"
            if module not in OWNERS:
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    method = node.func.attr
                    if method in STORE_ONLY or (method in STORE_ALSO and STORE_NAMES.search(receiver(node.func.value))):
                        out.append(f"{where}: raw store call .{method}()")
                if literal_prefix(node) and id(node) not in parts:
                    out.append(f"{where}: a key's literal prefix")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = aliases.get(node.value.id)
                if owner in owned and owner != module and node.attr in owned[owner]:
                    if not _allowed(module, owner, node.attr):
                        out.append(f"{where}: names {owner}.{node.attr}, a key it does not own")
        for source, name, line in from_imports:
            if source in owned and source != module and name in owned[source] and not _allowed(module, source, name):
                out.append(f"{module}:{line}: imports {source}.{name}, a key it does not own")
    return out


def _allowed(module: str, owner: str, name: str) -> bool:
    return ((owner, name) in NOT_KEYS or (module, owner, name) in ALLOWED
            or (module in OWNERS and name in SHARED))


def test_only_the_owners_touch_the_stores_keys():
    assert violations(sources()) == []


def test_every_owner_owns_keys_and_the_scan_sees_a_raw_call():
    trees = sources()
    for owner in OWNERS:
        assert key_names(trees[owner]), owner
    assert {"decision_key", "COMMITTED"} <= key_names(trees["ntp_megatron.elastic.commit"])
    assert {"LATEST", "topology_key"} <= key_names(trees["ntp_megatron.elastic.publication"])
    assert "MOVED" not in key_names(trees["ntp_megatron.elastic.keys"])  # a value, not a key
    planted = ast.parse("from ntp_megatron.elastic import keys, commit\n"
                        "def f(store, x):\n"
                        "    store.set(keys.heartbeat(1), '{}')\n"
                        "    x.multi_get(['a'])\n"
                        "    y = f'elastic/gen{x}/votes'\n"
                        "    return commit.COMMITTED\n")
    found = [v for v in violations({**trees, "ntp_megatron.planted": planted})
             if v.startswith("ntp_megatron.planted:")]
    assert sorted(found) == [
        "ntp_megatron.planted:3: names ntp_megatron.elastic.keys.heartbeat, a key it does not own",
        "ntp_megatron.planted:3: raw store call .set()",
        "ntp_megatron.planted:4: raw store call .multi_get()",
        "ntp_megatron.planted:5: a key's literal prefix",
        "ntp_megatron.planted:6: names ntp_megatron.elastic.commit.COMMITTED, a key it does not own"], found
