"""The README's recipes run as written, and its quickstart holds exactly the commands CI and the demo run.

A fenced block is a recipe to run when the line before its opening fence is a marker:

    <!-- run: cheap -->               this test runs it, alone in a fresh folder
    <!-- run: cheap, dir=NAME -->     this test runs it in folder NAME, after the earlier blocks marked NAME
    <!-- run: manual -->              too slow or needs a cluster: left to the reader

Shell blocks run with `bash -eo pipefail`, ```python blocks with this interpreter, in a temporary folder,
with this interpreter's folder first on PATH, so `zerotrain` and `python3` are the ones under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*run:\s*(?P<kind>cheap|manual)\s*(?:,\s*dir=(?P<dir>[\w-]+)\s*)?-->")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<lang>[\w-]*)\s*$")
SHELLS = ("", "bash", "sh", "shell", "console")
BLOCK_TIMEOUT_S = 180
# Fewer cheap blocks than this means markers were lost: the recipes would silently stop being tested.
MIN_CHEAP_BLOCKS = 13

TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[test]' "
                "&& .venv/bin/python -m pytest -q")
DEMO_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e . && .venv/bin/zerotrain demo"


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kind: str | None  # "cheap", "manual", or None (unmarked)
    group: str  # blocks of one group run in order in one folder

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def parse_blocks(text: str) -> list[Block]:
    """Every fenced block, with the run marker on the line before it; a marker not followed by a fence is an error."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        marker = MARKER.fullmatch(lines[i].strip())
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(f"README.md:{i + 1}: {lines[i].strip()} is not followed by a fenced block")
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence["fence"]), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: the fenced block never closes")
        before = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        kind = before["kind"] if before else None
        group = before["dir"] if before and before["dir"] else f"line{i + 1}"
        blocks.append(Block(i + 1, fence["lang"], "\n".join(lines[i + 1 : end]) + "\n", kind, group))
        i = end + 1
    return blocks


def cheap_groups(text: str) -> dict[str, list[Block]]:
    """The cheap blocks by folder, each folder's blocks in README order, folders in order of first appearance."""
    groups: dict[str, list[Block]] = {}
    for block in parse_blocks(text):
        if block.kind == "cheap":
            groups.setdefault(block.group, []).append(block)
    return groups


def run_blocks(blocks: list[Block], workdir: Path, timeout: float = BLOCK_TIMEOUT_S) -> None:
    """Run the blocks in order in `workdir`; AssertionError naming the block, its exit code and output tail."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for block in blocks:
        if block.lang == "python":
            argv = [sys.executable, "-c", block.code]
        elif block.lang in SHELLS:
            argv = ["bash", "-eo", "pipefail", "-c", block.code]
        else:
            raise AssertionError(f"{block.name}: a block marked to run must be bash or python, not {block.lang!r}")
        # A session of its own, so that a timeout ends the ranks zerotrain started too, not only the shell.
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"{block.name}: still running after {timeout} s:\n{block.code}") from None
        if proc.returncode != 0:
            raise AssertionError(f"{block.name}: exit code {proc.returncode}:\n{block.code}\n--- output (tail) ---\n"
                                 f"{output[-3000:]}")


def fenced_block_after(text: str, marker: str) -> list[str]:
    """The lines of the first fenced block after the line `marker`."""
    lines = text.splitlines()
    start = lines.index(marker)
    blocks = [b for b in parse_blocks(text) if b.line > start + 1]
    assert blocks, f"no fenced block after {marker}"
    return blocks[0].code.splitlines()


README_TEXT = README.read_text()
GROUPS = cheap_groups(README_TEXT)


# --- the quickstart ------------------------------------------------------------------------------------------


def test_quickstart_is_first_and_holds_exactly_the_ci_and_demo_commands():
    sections = re.findall(r"^## (.+)$", README_TEXT, flags=re.MULTILINE)
    assert sections[0] == "Quickstart", f"the first section is {sections[0]!r}"
    quickstart = README_TEXT.split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    assert [b.code.strip() for b in parse_blocks(quickstart)] == [DEMO_COMMAND, TEST_COMMAND]
    assert fenced_block_after(README_TEXT, "<!-- demo-command -->") == [DEMO_COMMAND]
    assert fenced_block_after(README_TEXT, "<!-- test-command -->") == [TEST_COMMAND]


def test_ci_extracts_the_readme_test_command_as_one_line():
    # Run .ci/run's own extraction, so the check follows CI if its awk changes.
    ci = (ROOT / ".ci" / "run").read_text()
    extract = next(line for line in ci.splitlines() if line.startswith("cmd=$("))
    done = subprocess.run(["bash", "-c", extract + '\nprintf "%s" "$cmd"'], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout == TEST_COMMAND
    demo = extract.replace("test-command", "demo-command")
    done = subprocess.run(["bash", "-c", demo + '\nprintf "%s" "$cmd"'], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout == DEMO_COMMAND


# --- the recipes ---------------------------------------------------------------------------------------------


def test_readme_marks_its_recipes_to_run():
    blocks = parse_blocks(README_TEXT)
    cheap = [b for b in blocks if b.kind == "cheap"]
    assert len(cheap) >= MIN_CHEAP_BLOCKS, f"only {len(cheap)} blocks marked <!-- run: cheap -->"
    assert all(b.lang in SHELLS + ("python",) for b in cheap)
    manual = " ".join(b.code for b in blocks if b.kind == "manual")
    for expensive in ("prepare python-stdlib", "torchrun", "srun"):  # documented, run by the reader
        assert expensive in manual
    # The first recipe's folder is what the later recipes (resume, sample, eval, export, plot) use.
    assert len(GROUPS["stdlib"]) >= 6 and "--out runs/stdlib" in GROUPS["stdlib"][0].code
    assert set(PROMISES) <= set(GROUPS)  # a renamed folder must not drop a promise's check


def metrics_of(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def eval_reproduces_val_loss(workdir: Path) -> None:
    """`zerotrain eval runs/stdlib --batches 8` prints the last val_loss of runs/stdlib/metrics.jsonl."""
    from zerotrain.cli.main import main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # the command's entry point, in this process: no second interpreter
        code = main(["eval", str(workdir / "runs" / "stdlib"), "--batches", "8"])
    assert code == 0
    printed = float(stdout.getvalue().split()[1])
    logged = [r["val_loss"] for r in metrics_of(workdir / "runs" / "stdlib") if "val_loss" in r][-1]
    assert abs(printed - logged) <= 5e-7, (printed, logged)  # the six decimals eval prints


def meshes_continue_to_the_same_losses(workdir: Path) -> None:
    """The TP 2 run continued as TP 1 x DP 2 from step 10 reaches the same losses, within float reordering."""
    tp2 = {r["step"]: r["loss"] for r in metrics_of(workdir / "runs" / "tp2")}
    tp1 = {r["step"]: r["loss"] for r in metrics_of(workdir / "runs" / "tp1")}
    assert sorted(tp1) == list(range(11, 21))
    assert max(abs(tp1[s] - tp2[s]) / abs(tp2[s]) for s in tp1) <= 1e-5


# What the README says a recipe does, checked after its blocks ran (not only their exit codes).
PROMISES = {"stdlib": eval_reproduces_val_loss, "meshes": meshes_continue_to_the_same_losses}


@pytest.mark.parametrize("group", list(GROUPS), ids=list(GROUPS))
def test_cheap_recipe_runs_as_written(group, tmp_path):
    run_blocks(GROUPS[group], tmp_path)
    if group in PROMISES:
        PROMISES[group](tmp_path)


# --- the runner can fail -------------------------------------------------------------------------------------

FAILING = """
<!-- run: cheap -->
```bash
echo first
false
echo never reached
```

<!-- run: cheap, dir=x -->
```python
raise SystemExit(3)
```

<!-- run: manual -->
```bash
exit 1
```
"""


def test_the_runner_fails_on_a_failing_command_and_skips_manual_blocks(tmp_path):
    groups = cheap_groups(FAILING)
    assert list(groups) == ["line3", "x"]  # the manual block is not run
    with pytest.raises(AssertionError, match=r"README.md:3: exit code 1"):
        run_blocks(groups["line3"], tmp_path)  # a failing line in the middle of a block fails it
    with pytest.raises(AssertionError, match=r"exit code 3"):
        run_blocks(groups["x"], tmp_path)
    with pytest.raises(AssertionError, match=r"still running after 1 s"):
        run_blocks(parse_blocks("<!-- run: cheap -->\n```bash\nsleep 30\n```\n"), tmp_path, timeout=1)
    with pytest.raises(ValueError, match="not followed by a fenced block"):
        parse_blocks("<!-- run: cheap -->\n\n```bash\ntrue\n```\n")


def test_a_broken_readme_recipe_is_caught(tmp_path):
    # A planted bug in a copy of the README: the first recipe gets a width its head count does not divide.
    first = GROUPS["stdlib"][0]
    assert "zerotrain train" in first.code
    broken = README_TEXT.replace(first.code, first.code.replace("zerotrain train", "zerotrain train --n-head 3", 1))
    with pytest.raises(AssertionError, match=r"exit code 2(.|\n)*n_embd|exit code 2(.|\n)*head"):
        run_blocks(cheap_groups(broken)["stdlib"][:1], tmp_path)
