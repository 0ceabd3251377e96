"""Code outside parallel/ asks the parts (parallel/parts.py, the engine's placement), not the ZeRO stage number.

A read of the stage outside parallel/ (and config.py, which declares and validates the setting) is a place that knows
what a stage does; each such place is one more to change when a part is added (hybrid sharding, context
parallelism). The few left say which stage was asked for (the engine's construction, the reports' `zero` field).
"""

from __future__ import annotations

import ast
import os
import shutil

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "zerotrain")
EXEMPT = ("parallel" + os.sep, "config.py")
MOST_READS = 3
STAGE_NAMES = {"zero", "stage"}


def stage_reads(path: str, text: str) -> list[str]:
    """Where module `text` reads the ZeRO stage: `X.parallel.zero` (or `p.zero`, `p` bound to `X.parallel` in the
    module), an engine's `.stage`, a comparison of a name `zero` or `stage`, a call of keeps_autograd_grads; one
    'path:line' each. Writes (a bench setting a variant's stage) are not reads."""
    tree = ast.parse(text)
    aliases = set()  # names bound to some config's `.parallel`
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts)
                else:
                    pairs.append((target, node.value))
            aliases |= {t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Attribute)
                        and v.attr == "parallel"}
    found = []
    for node in ast.walk(tree):
        read = False
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr == "zero":
                base = node.value
                read = (isinstance(base, ast.Attribute) and base.attr == "parallel") or \
                    (isinstance(base, ast.Name) and base.id in aliases)
            read = read or node.attr == "stage"
        elif isinstance(node, ast.Compare):
            read = any(isinstance(side, ast.Name) and side.id in STAGE_NAMES for side in [node.left, *node.comparators])
        elif isinstance(node, ast.Call):
            func = node.func
            read = (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) == "keeps_autograd_grads"
        if read:
            found.append(f"{path}:{node.lineno}")
    return found


def reads_outside_parallel(root: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if rel.startswith(EXEMPT[0]) or rel == EXEMPT[1]:
                continue
            with open(path) as f:
                out += stage_reads(rel, f.read())
    return sorted(out)


def test_code_outside_parallel_reads_the_stage_in_at_most_three_places_and_a_new_read_is_caught(tmp_path):
    found = reads_outside_parallel(SRC)
    assert len(found) <= MOST_READS, f"{len(found)} reads of the ZeRO stage outside parallel/: {found}; ask the " \
                                     "parts (parallel/parts.py) instead"
    # planted: a planner branching on the stage again, in a copy of the package the scan reads as it reads src/
    copy = tmp_path / "zerotrain"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / "training" / "memory_plan.py"
    planted.write_text(planted.read_text() + "\n\ndef planted(cfg):\n    p = cfg.parallel\n"
                       "    return p.zero == 3 or cfg.parallel.zero > 1\n")
    assert len(reads_outside_parallel(str(copy))) == len(found) + 2


def test_every_way_of_reading_the_stage_is_counted():
    # each planted line is a read the lead's grep names: zero ==, zero <, .stage, parallel.zero, p.zero, stage in,
    # keeps_autograd_grads(
    planted = ["cfg.parallel.zero < 3", "engine.stage == 3", "zero == 3", "stage in (2, 3)",
               "keeps_autograd_grads(1, 'fp32', 1, 1)", "f(stage=cfg.parallel.zero)"]
    for line in planted:
        assert len(stage_reads("x.py", f"def f(cfg, engine, zero, stage):\n    return {line}\n")) == 1, line
    assert len(stage_reads("x.py", "def f(cfg):\n    p, tp = cfg.parallel, cfg.parallel.tp\n    return p.zero\n")) == 1
    # what is not a read: setting a variant's stage, a loop over stages for names
    assert stage_reads("x.py", "def f(c, v):\n    c.parallel.zero = v.zero\n") == []
    assert stage_reads("x.py", "def f():\n    return [f'ZeRO-{stage}' for stage in (2, 3)]\n") == []
