"""The package's shape: imports run one way, no circles, a handful of modules at the top, no two modules with one name,
and no module extending another through its private names (DESIGN.md: a seam in the wrong place)."""

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


def absolute_base(name: str, path: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` in module `name` (at `path`) imports from, its dots resolved."""
    if not node.level:
        return node.module or ""
    parts = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (deferred imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = absolute_base(name, path, node)
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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(known: dict[str, str]) -> list[str]:
    """A module importing another's private name, or a class overriding a private method of a class it inherits from
    another module (zero3.py's ZeroThreeEngine over engine.py's ZeroEngine, as it was): DESIGN.md's rule for seams."""
    trees = {n: ast.parse(open(p).read()) for n, p in known.items()}
    bad = []
    for name, tree in trees.items():
        imported = {}  # local name -> (module, name there)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = absolute_base(name, known[name], node)
                for alias in node.names:
                    if base.split(".")[0] == "zerotrain" and _private(alias.name) and f"{base}.{alias.name}" not in known:
                        bad.append(f"{name} imports {base}.{alias.name}")
                    imported[alias.asname or alias.name] = (base, alias.name)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            own = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for b in (b for b in cls.bases if isinstance(b, ast.Name) and b.id in imported):
                module, base_name = imported[b.id]
                base = next((c for c in ast.walk(trees.get(module, ast.Module(body=[])))
                             if isinstance(c, ast.ClassDef) and c.name == base_name), None)
                theirs = {f.name for f in base.body if isinstance(f, ast.FunctionDef)} if base else set()
                bad += [f"{name}.{cls.name} overrides {module}.{base_name}.{m}" for m in sorted(own & theirs)
                        if _private(m)]
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


def test_no_module_reaches_into_anothers_private_names_and_a_planted_subclass_is_caught(tmp_path):
    """The stages are a seam (parallel/params.py's Placement), not a subclass of the engine overriding its
    private methods. Planted in a copy of the package: a stage-3 class subclassing the GradientReducer and
    overriding _launch, and a module importing the engine's private name."""
    import shutil

    assert private_reaches(modules()) == []
    copy = tmp_path / "zerotrain"
    shutil.copytree(PACKAGE, copy)
    with open(copy / "parallel" / "sharded.py", "a") as f:
        f.write("\nfrom .gradients import GradientReducer as _Reducer, _planted  # planted\n\n\nclass Planted(_Reducer):\n"
                "    def _launch(self, index):\n        pass\n")
    assert private_reaches(modules(str(copy))) == [
        "zerotrain.parallel.sharded imports zerotrain.parallel.gradients._planted",
        "zerotrain.parallel.sharded.Planted overrides zerotrain.parallel.gradients.GradientReducer._launch"]


def same_names(known: dict[str, str]) -> dict[str, list[str]]:
    """Module files (not packages) that share one name in different folders, by that name: a reader searching for
    `model.py` should find one. A module may share a package's name (bench/model.py is `zerotrain bench model`)."""
    files = [n for n, p in known.items() if not p.endswith("__init__.py") and not n.endswith("__main__")]
    count = collections.Counter(n.rsplit(".", 1)[-1] for n in files)
    return {name: sorted(n for n in files if n.rsplit(".", 1)[-1] == name) for name, c in count.items() if c > 1}


def test_a_handful_of_modules_at_the_top_and_no_two_with_one_name():
    top = [n for n in os.listdir(PACKAGE) if n.endswith(".py")]
    assert len(top) <= TOP_LEVEL_LIMIT, sorted(top)
    assert same_names(modules()) == {}


def test_a_planted_second_module_of_one_name_is_caught(tmp_path):
    """checkpoint/model.py beside bench/model.py, as the package had them (the package `model` hid the pair from
    the check, which left out any name a package has): planted again in a copy."""
    import shutil

    copy = tmp_path / "zerotrain"
    shutil.copytree(PACKAGE, copy)
    shutil.copy(copy / "checkpoint" / "consolidate.py", copy / "checkpoint" / "model.py")
    assert same_names(modules(str(copy))) == {"model": ["zerotrain.bench.model", "zerotrain.checkpoint.model"]}


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_every_part_of_the_layout_exists(name):
    assert name in modules(), f"{name} is in the layout but not in the package"
