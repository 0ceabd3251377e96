"""The package's shape: imports run one way, no circles, a handful of modules at the top, no two modules with one name."""

from __future__ import annotations

import ast
import collections
import os

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
PACKAGE = os.path.join(SRC, "zerotrain")

# Each part may import what is below it (a lower number) and its own folder's modules, nothing else:
# cli -> commands / bench -> hub, training -> runtime -> checkpoint -> parallel -> model, data -> config -> errors,
# durable (whole-or-absent file writes).
LEVELS = {
    "zerotrain.errors": 0,
    "zerotrain.durable": 0,
    "zerotrain.config": 1,
    "zerotrain.data": 2,
    "zerotrain.model": 2,
    "zerotrain.parallel": 3,
    "zerotrain.checkpoint": 4,
    "zerotrain.runtime": 5,
    "zerotrain.training": 6,
    "zerotrain.hub": 5,  # below training: --init-from fills the model the loop builds
    "zerotrain.cli.flags": 7,
    "zerotrain.cli.figures": 7,
    "zerotrain.bench": 8,
    "zerotrain.cli.commands": 8,
    "zerotrain.cli.main": 9,
    "zerotrain.cli": 9,
    "zerotrain.__main__": 10,
    "zerotrain": 7,  # the public API (load_model, load_tokenizer, __version__): above hub, below the CLI
}
TOP_LEVEL_LIMIT = 6


def modules(root: str = PACKAGE) -> dict[str, str]:
    """Every module of the package by dotted name (a package is its __init__), to its path."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (deferred imports count too)."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def level(name: str) -> int:
    owner = max((p for p in LEVELS if name == p or name.startswith(p + ".")), key=len)
    return LEVELS[owner]


def upward_imports(known: dict[str, str]) -> list[str]:
    bad = []
    for name, path in known.items():
        for target in imports(name, path, known):
            same_folder = target.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or target.startswith(name + ".")
            if not same_folder and level(target) >= level(name):
                bad.append(f"{name} imports {target}")
    return bad


def cycles(known: dict[str, str]) -> list[list[str]]:
    """Import circles between modules (a package is its __init__, which imports its submodules)."""
    graph = {n: imports(n, p, known) for n, p in known.items()}
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_imports_run_one_way_without_circles():
    known = modules()
    assert upward_imports(known) == []
    assert cycles(known) == []


def test_a_planted_upward_import_and_circle_are_caught(tmp_path):
    """A copy of the package where checkpoint imports the training loop: both checks must fail."""
    import shutil

    copy = tmp_path / "zerotrain"
    shutil.copytree(PACKAGE, copy)
    with open(copy / "checkpoint" / "save.py", "a") as f:
        f.write("\nfrom zerotrain.training.loop import train  # planted\n")
    known = modules(str(copy))
    assert "zerotrain.checkpoint.save imports zerotrain.training.loop" in upward_imports(known)
    assert any("zerotrain.checkpoint.save" in c and "zerotrain.training.loop" in c for c in cycles(known))


def test_a_handful_of_modules_at_the_top_and_no_two_with_one_name():
    top = [n for n in os.listdir(PACKAGE) if n.endswith(".py")]
    assert len(top) <= TOP_LEVEL_LIMIT, sorted(top)
    names = collections.Counter(n.rsplit(".", 1)[-1] for n in modules() if not n.endswith("__main__"))
    names = {n: c for n, c in names.items() if c > 1 and n not in ("zerotrain",)}
    packages = {n.rsplit(".", 1)[-1] for n, p in modules().items() if p.endswith("__init__.py")}
    assert {n: c for n, c in names.items() if n not in packages} == {}


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_every_part_of_the_layout_exists(name):
    assert name in modules(), f"{name} is in the layout but not in the package"
