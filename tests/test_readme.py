"""The README's and docs/'s recipes run as written, and the quickstart holds exactly the commands CI and the demo run.

A fenced block in README.md or docs/*.md is a recipe to run when the line before its opening fence is a marker:

    <!-- run: cheap -->               this test runs it, alone in a fresh folder
    <!-- run: cheap, dir=NAME -->     this test runs it in folder NAME, after the earlier blocks marked NAME
    <!-- run: manual -->              too slow or needs a cluster: left to the reader

The blocks of one folder run in the order of README.md, then docs/*.md by file name, each file's in its own order,
so that a run folder one recipe makes (`runs/stdlib`) is made once and used by the recipes of every file that
reads it. Shell blocks run with `bash -eo pipefail`, ```python blocks with this interpreter, in a temporary
folder, with this interpreter's folder first on PATH, so `python3` is the one under test. The `zerotrain`
commands of a shell block run by zerotrain's entry point in this test's process (command_server.py: the same
argument list, folder, environment and output, without importing torch twice per command); one given
ZEROTRAIN_FAULTS runs as the installed console script. A ```python block, and a shell block's `python3 -c` or
`python3 -`, run the same way in this process (without importing torch and transformers again per script);
other uses of the interpreter (`python3 -m pydoc`) run as their own process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from command_server import CommandServer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*run:\s*(?P<kind>cheap|manual)\s*(?:,\s*dir=(?P<dir>[\w-]+)\s*)?-->")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<lang>[\w-]*)\s*$")
SHELLS = ("", "bash", "sh", "shell", "console")
BLOCK_TIMEOUT_S = 180
# Fewer cheap blocks than this, over README.md and docs/, means markers were lost: the recipes would silently stop
# being tested.
MIN_CHEAP_BLOCKS = 24

TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[test]' "
                "&& .venv/bin/python -m pytest -q -n 3 --dist loadgroup")
DEMO_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e . && .venv/bin/zerotrain demo"


@dataclass(frozen=True)
class Block:
    source: str  # the file, relative to the repository: README.md, docs/data.md
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kind: str | None  # "cheap", "manual", or None (unmarked)
    group: str  # blocks of one group run in order in one folder

    @property
    def name(self) -> str:
        return f"{self.source}:{self.line}"


def read_docs(root: Path = ROOT) -> dict[str, str]:
    """README.md, then docs/*.md by name: each file's text under its path relative to the repository."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return {f.relative_to(root).as_posix(): f.read_text() for f in files}


def parse_blocks(text: str, source: str = "README.md") -> list[Block]:
    """Every fenced block, with the run marker on the line before it; a marker not followed by a fence is an error."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        marker = MARKER.fullmatch(lines[i].strip())
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(f"{source}:{i + 1}: {lines[i].strip()} is not followed by a fenced block")
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence["fence"]), None)
        if end is None:
            raise ValueError(f"{source}:{i + 1}: the fenced block never closes")
        before = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        kind = before["kind"] if before else None
        group = before["dir"] if before and before["dir"] else f"{source}:{i + 1}"
        blocks.append(Block(source, i + 1, fence["lang"], "\n".join(lines[i + 1 : end]) + "\n", kind, group))
        i = end + 1
    return blocks


def all_blocks(docs: dict[str, str]) -> list[Block]:
    return [b for source, text in docs.items() for b in parse_blocks(text, source)]


def cheap_groups(docs: dict[str, str]) -> dict[str, list[Block]]:
    """The cheap blocks by folder, each folder's blocks in the order of `docs` (README.md first) and of each file,
    folders in order of first appearance."""
    groups: dict[str, list[Block]] = {}
    for block in all_blocks(docs):
        if block.kind == "cheap":
            groups.setdefault(block.group, []).append(block)
    return groups


def run_blocks(blocks: list[Block], workdir: Path, timeout: float = BLOCK_TIMEOUT_S,
               outputs: dict[str, str] | None = None) -> int:
    """Run the blocks in order in `workdir`, their `zerotrain` commands served by this process (command_server.py);
    AssertionError naming the block, its exit code and output tail. Returns how many commands were served; each
    block's output goes into `outputs` under its name."""
    server = CommandServer()
    env = server.environment(dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                                  + os.environ.get("PATH", "")))
    try:
        for block in blocks:
            if block.lang == "python":
                argv = [server.python, "-c", block.code]
            elif block.lang in SHELLS:
                argv = ["bash", "-eo", "pipefail", "-c", block.code]
            else:
                raise AssertionError(f"{block.name}: a block marked to run must be bash or python, not {block.lang!r}")
            with tempfile.TemporaryFile("w+") as output:
                # A session of its own, so that a timeout ends the ranks zerotrain started too, not only the shell.
                proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=output, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                if not server.wait(proc, timeout):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise AssertionError(f"{block.name}: still running after {timeout} s:\n{block.code}")
                output.seek(0)
                said = output.read()
                if proc.returncode != 0:
                    raise AssertionError(f"{block.name}: exit code {proc.returncode}:\n{block.code}\n"
                                         f"--- output (tail) ---\n{said[-3000:]}")
                if outputs is not None:
                    outputs[block.name] = said
        return server.served
    finally:
        server.close()


def fenced_block_after(text: str, marker: str) -> list[str]:
    """The lines of the first fenced block after the line `marker`."""
    lines = text.splitlines()
    start = lines.index(marker)
    blocks = [b for b in parse_blocks(text) if b.line > start + 1]
    assert blocks, f"no fenced block after {marker}"
    return blocks[0].code.splitlines()


DOCS = read_docs()
README_TEXT = DOCS["README.md"]
GROUPS = cheap_groups(DOCS)


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


def test_the_docs_mark_their_recipes_to_run():
    blocks = all_blocks(DOCS)
    cheap = [b for b in blocks if b.kind == "cheap"]
    assert len(cheap) >= MIN_CHEAP_BLOCKS, f"only {len(cheap)} blocks marked <!-- run: cheap -->"
    assert all(b.lang in SHELLS + ("python",) for b in cheap)
    manual = " ".join(b.code for b in blocks if b.kind == "manual")
    for expensive in ("prepare python-stdlib", "torchrun", "srun"):  # documented, run by the reader
        assert expensive in manual
    # The README holds the three recipes for real jobs; the run they need to be real (GPUs, a cluster) is manual.
    readme = {b.group for b in cheap if b.source == "README.md"}
    assert {"plan", "chat", "resized"} <= readme, readme
    # The first recipe's folder is what the later recipes (sample, eval, export, plot, verify) use, in other files.
    assert "--out runs/stdlib" in GROUPS["stdlib"][0].code and GROUPS["stdlib"][0].source == "docs/data.md"
    assert len(GROUPS["stdlib"]) >= 6 and len({b.source for b in GROUPS["stdlib"]}) >= 3
    assert set(PROMISES) <= set(GROUPS)  # a renamed folder must not drop a promise's check


def torchrun_problems(blocks: list[Block]) -> list[str]:
    """What is wrong with the zerotrain command of each torchrun recipe: flags the parser refuses, a run that would
    train on the CPU (no --device cuda), or a --max-restarts given to zerotrain, which only its own launcher reads."""
    from zerotrain.cli.main import build_parser
    from zerotrain.config import setting_for
    from zerotrain.errors import ConfigError

    problems = []
    for block in blocks:
        for command in block.code.replace("\\\n", " ").splitlines():
            if "torchrun" not in command or " -m zerotrain " not in command:
                continue
            argv = shlex.split(command.split(" -m zerotrain ", 1)[1])
            try:
                args = build_parser().parse_args(argv)
            except (ConfigError, SystemExit) as e:
                problems.append(f"{block.name}: {e}")
                continue
            device = args.device or setting_for("device").default  # the parser leaves what is not given as None
            if device != "cuda":
                problems.append(f"{block.name}: trains on {device}: give --device cuda")
            if "--max-restarts" in argv:
                problems.append(f"{block.name}: --max-restarts under torchrun is torchrun's own, not zerotrain's")
    return problems


def test_the_torchrun_recipes_train_on_the_gpus_and_leave_restarts_to_torchrun():
    torchrun = [b for b in all_blocks(DOCS) if "torchrun" in b.code and " -m zerotrain " in b.code]
    assert {b.source for b in torchrun} >= {"README.md", "docs/production.md"}
    assert torchrun_problems(torchrun) == []
    assert "restarts under torchrun are torchrun's own `--max-restarts`" in " ".join(README_TEXT.split()).lower()
    # Planted: the broken example, on CPU and with zerotrain's --max-restarts, in the README's recipe.
    recipe = next(b for b in torchrun if b.source == "README.md")
    broken = recipe.code.replace("--device cuda ", "").replace("--resume auto", "--resume auto --max-restarts 3")
    found = torchrun_problems(parse_blocks(README_TEXT.replace(recipe.code, broken)))
    assert any("trains on cpu" in p for p in found) and any("--max-restarts" in p for p in found), found
    misspelt = recipe.code.replace("--ckpt-every-minutes", "--ckpt-evry-minutes")
    assert torchrun_problems(parse_blocks(README_TEXT.replace(recipe.code, misspelt)))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but hyphens and underscores dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside fenced blocks), the repeated ones numbered as GitHub does."""
    inside = {n for b in parse_blocks(text) for n in range(b.line, b.line + b.code.count("\n") + 2)}
    found: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        heading = re.match(r"^#{1,6} (.+)$", line)
        if heading and n not in inside:
            base = slug(heading[1])
            found.add(next(a for a in [base] + [f"{base}-{i}" for i in range(1, 99)] if a not in found))
    return found


def broken_links(docs: dict[str, str]) -> list[str]:
    """Relative links in the docs that name a missing file or a heading their file does not have."""
    broken = []
    for source, text in docs.items():
        for target in re.findall(r"\]\((?![a-z]+:)([^)\s]+)\)", text):
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
            if resolved not in docs and not (ROOT / resolved).exists():
                broken.append(f"{source}: {target}: no file {resolved}")
            elif anchor and resolved in docs and anchor not in anchors(docs[resolved]):
                broken.append(f"{source}: {target}: no heading #{anchor} in {resolved}")
    return broken


def test_the_readme_links_every_docs_file_and_every_link_lands():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)[#)]", README_TEXT))
    assert linked == {s for s in DOCS if s.startswith("docs/")}
    assert broken_links(DOCS) == []
    # Planted: a heading renamed under the links that point at it, and a link to a file that is not there.
    renamed = dict(DOCS, **{"docs/production.md": DOCS["docs/production.md"].replace("## Fault injection",
                                                                                      "## Faults")})
    assert any("#fault-injection" in b for b in broken_links(renamed))
    assert broken_links({"README.md": "see [the guide](docs/guide.md)"}) == ["README.md: docs/guide.md: no file "
                                                                             "docs/guide.md"]


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


def the_stopped_run_went_on_from_its_stop_on_four_ranks(workdir: Path) -> None:
    """The README's stop, resume and resize: SIGTERM after step 20, which lands at the next log step (30): step 29
    saved, then steps 30-40 on 4 ranks from that checkpoint, the metrics reading as one run of steps 1-40."""
    run = workdir / "runs" / "resized"
    events = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" in r]
    assert [(e["event"], e["step"], e["signal"]) for e in events] == [("stop", 29, "SIGTERM")]
    assert [r["step"] for r in metrics_of(run)] == list(range(1, 41))
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["start_step"], summary["steps"]) == (4, 29, 40)
    assert summary["resumed_from"].endswith("step_00000029")


# What the docs say a recipe does, checked after its blocks ran (not only their exit codes).
PROMISES = {"stdlib": eval_reproduces_val_loss, "meshes": meshes_continue_to_the_same_losses,
            "resized": the_stopped_run_went_on_from_its_stop_on_four_ranks}


# The plan figures the docs quote in their prose and tables, by the block whose commands print them (a line of its
# code): each is found in that block's output, and in the doc its number (or, a pair: (as printed, as quoted)). A
# ```text block right after a cheap block is (lines of) its output, checked line by line.
QUOTED = {
    ("docs/parallelism.md", "--micro-batch 1 --device cuda --data synthetic --accum 4"):
        ["60.64 GiB", "29.92 GiB of gradient buckets", "86.65 GiB in all"],
    ("docs/parallelism.md", "zerotrain plan --preset gpt2 --nproc 2 --accum 8 --zero 1 --data synthetic"):
        ["474.7 MiB  P x 4", "712.1 MiB", "237.4 MiB", "195.3 MiB", "159.3 MiB", ("hold 474.7 MiB", "474.7")],
    ("docs/parallelism.md", "--micro-batch 1 --zero 2 --device cuda --device-memory 80GiB --data synthetic"):
        ["14.96 GiB", "239.3 MiB", "1.79 GiB", "478.7 MiB", "3.91 GiB", "957.4 MiB", "2.25 GiB", "2.32 GiB",
         "25.32 GiB", "12.38 GiB", ("80.00 GiB: 25", "| 25 |"), ("80.00 GiB: 31", "| 31 |"), "137 layers (30.9B parameters)",
         "597 layers (131.3B parameters)"],
    ("docs/parallelism.md", "--vocab-size 8000 --no-tie-embeddings --nproc 4 --micro-batch 1 --seq-len 32"):
        ["1.90 GiB"],
    ("docs/parallelism.md", "--micro-batch 1 --device cuda --data synthetic --tp 8"): ["2.32 GiB", "626.2 MiB"],
    ("docs/dpo.md", "--method dpo --lora-rank 16 --micro-batch 1"):
        ["19.90 GiB", "14.96 GiB", "1.09 GiB", "3.46 GiB", "80.0 MiB", "260.0 MiB", "40.0 MiB", "20.0 MiB",
         ("80.00 GiB: 54", "54 pairs")],
    ("docs/dpo.md", "for reference in precomputed live; do"):
        ["27.11 GiB", "28.98 GiB", "1.87 GiB", ("80.00 GiB: 46", "46 against"), ("80.00 GiB: 45", "against 45"),
         "38.41 GiB", "53.37 GiB",
         "79.37 GiB", "94.33 GiB", "14.96 GiB"],
}


def quoted_problems(block: Block, output: str, docs: dict[str, str]) -> list[str]:
    """What the doc around `block` quotes that `output` (the block's, run) does not say: a figure of QUOTED missing
    from the output or (its number) from the doc, or a line of the ```text block after it missing from the output."""
    problems = []
    said = {line.rstrip() for line in output.splitlines()}
    for (source, line), figures in QUOTED.items():
        if source == block.source and line in block.code:
            pairs = [f if isinstance(f, tuple) else (f, f.split()[0]) for f in figures]
            problems += [f"{block.name}: its output does not say {f!r}" for f, _ in pairs if f not in output]
            problems += [f"{source} does not quote {q!r}" for _, q in pairs if q not in docs[source]]
    blocks = parse_blocks(docs[block.source], block.source)
    after = next((b for b in blocks if b.line > block.line), None)
    if after is not None and after.lang == "text" and after.line <= block.line + block.code.count("\n") + 3:
        problems += [f"{after.name}: the output has no line {line.rstrip()!r}" for line in after.code.splitlines()
                     if line.strip() and line.rstrip() not in said]
    return problems


@pytest.mark.parametrize("group", list(GROUPS), ids=list(GROUPS))
def test_cheap_recipe_runs_as_written(group, tmp_path):
    outputs: dict[str, str] = {}
    run_blocks(GROUPS[group], tmp_path, outputs=outputs)
    assert [p for b in GROUPS[group] for p in quoted_problems(b, outputs[b.name], DOCS)] == []
    if group in PROMISES:
        PROMISES[group](tmp_path)


def test_every_quoted_block_runs_and_a_stale_figure_is_caught():
    """Each block QUOTED names is a cheap block of its doc; a figure the plan no longer prints (the 8B table's total
    before the loss working set was counted, 10.06 GiB), and a quoted output line it no longer prints, are caught."""
    cheap = [b for b in all_blocks(DOCS) if b.kind == "cheap"]
    for source, line in QUOTED:
        assert any(b.source == source and line in b.code for b in cheap), (source, line)
    block = next(b for b in cheap if "--micro-batch 1 --zero 2 --device cuda --device-memory 80GiB" in b.code)
    figures = QUOTED[("docs/parallelism.md", "--micro-batch 1 --zero 2 --device cuda --device-memory 80GiB --data "
                                             "synthetic")]
    printed = "\n".join(f[0] if isinstance(f, tuple) else f for f in figures)
    assert quoted_problems(block, printed, DOCS) == []
    stale = printed.replace("12.38 GiB", "10.06 GiB")  # planted: the plan prints the old figure
    assert quoted_problems(block, stale, DOCS) == [f"{block.name}: its output does not say '12.38 GiB'"]
    docs = dict(DOCS, **{"docs/parallelism.md": DOCS["docs/parallelism.md"].replace("12.38", "10.06")})  # the old doc
    assert quoted_problems(block, printed, docs) == ["docs/parallelism.md does not quote '12.38'"]
    advice = next(b for b in cheap if "--preset llama-3.1-70b" in b.code)
    lines = fenced_text_after(advice)
    assert lines and quoted_problems(advice, "\n".join(lines), DOCS) == []
    assert quoted_problems(advice, "\n".join(lines).replace("largest micro-batch 4", "largest micro-batch 2"), DOCS)


def fenced_text_after(block: Block) -> list[str]:
    """The lines of the ```text block right after `block` in its doc."""
    after = next(b for b in parse_blocks(DOCS[block.source], block.source) if b.line > block.line)
    return after.code.splitlines() if after.lang == "text" else []


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
    groups = cheap_groups({"docs/failing.md": FAILING, "README.md": "<!-- run: cheap, dir=x -->\n```bash\ntrue\n```\n"})
    assert list(groups) == ["docs/failing.md:3", "x"]  # the manual block is not run
    assert [b.name for b in groups["x"]] == ["docs/failing.md:10", "README.md:2"]  # one folder, the files' order
    with pytest.raises(AssertionError, match=r"docs/failing.md:3: exit code 1"):
        run_blocks(groups["docs/failing.md:3"], tmp_path)  # a failing line in the middle of a block fails it
    with pytest.raises(AssertionError, match=r"docs/failing.md:10: exit code 3"):
        run_blocks(groups["x"], tmp_path)
    with pytest.raises(AssertionError, match=r"still running after 1 s"):
        run_blocks(parse_blocks("<!-- run: cheap -->\n```bash\nsleep 30\n```\n"), tmp_path, timeout=1)
    with pytest.raises(ValueError, match="docs/x.md:1: .* not followed by a fenced block"):
        parse_blocks("<!-- run: cheap -->\n\n```bash\ntrue\n```\n", "docs/x.md")


def test_a_recipe_s_zerotrain_commands_run_in_this_process_unless_given_faults(tmp_path):
    from zerotrain import __version__

    script = "zerotrain --version > versions.txt\nZEROTRAIN_FAULTS=kill@step=9 zerotrain --version >> versions.txt\n"
    assert run_blocks(parse_blocks(f"<!-- run: cheap -->\n```bash\n{script}```\n"), tmp_path) == 1  # served: one
    assert (tmp_path / "versions.txt").read_text() == f"zerotrain {__version__}\n" * 2  # same output either way


def test_a_recipe_s_python_scripts_run_in_this_process_as_the_interpreter_would(tmp_path):
    # Each script once served and once (given ZEROTRAIN_FAULTS, which the client hands to the real interpreter) as
    # its own process: the same output and exit code either way, and a script's failure fails its block.
    script = """import os, sys
print(__name__, sys.argv, os.getcwd() == sys.path[0] or sys.path[0] == '', os.environ['WORD'])
"""
    block = (f"WORD=one python3 -c \"{script}\" a b > c.txt\n"
             f"WORD=two ZEROTRAIN_FAULTS=none python3 -c \"{script}\" a b >> c.txt\n"
             f"python3 - x <<'PY' > stdin.txt\nimport sys; print(sys.argv, sys.stdin is not None)\nPY\n"
             f"ZEROTRAIN_FAULTS=none python3 - x <<'PY' >> stdin.txt\nimport sys; print(sys.argv, sys.stdin is not None)\n"
             f"PY\nset +e; python3 -c 'raise SystemExit(4)'; echo $? > codes.txt\n"
             f"python3 -c 'raise ValueError(5)' 2> raised.txt; echo $? >> codes.txt\n"
             f"python3 -c 'raise SystemExit(\"said\")' 2>> raised.txt; echo $? >> codes.txt\n")
    assert run_blocks(parse_blocks(f"<!-- run: cheap -->\n```bash\n{block}```\n"), tmp_path) == 5  # served: five
    assert (tmp_path / "c.txt").read_text() == "__main__ ['-c', 'a', 'b'] True one\n__main__ ['-c', 'a', 'b'] True two\n"
    assert (tmp_path / "stdin.txt").read_text() == "['-', 'x'] True\n" * 2
    assert (tmp_path / "codes.txt").read_text().split() == ["4", "1", "1"]
    raised = (tmp_path / "raised.txt").read_text()
    assert "ValueError: 5" in raised and raised.endswith("said\n")
    with pytest.raises(AssertionError, match=r"README.md:2: exit code 1(.|\n)*ZeroDivisionError"):
        run_blocks(parse_blocks("<!-- run: cheap -->\n```python\n1 / 0\n```\n"), tmp_path)


def test_a_broken_recipe_is_caught(tmp_path):
    # A planted bug in a copy of the docs: the first recipe gets a width its head count does not divide.
    first = GROUPS["stdlib"][0]
    assert "zerotrain train" in first.code
    text = DOCS[first.source]
    broken = dict(DOCS, **{first.source: text.replace(first.code, first.code.replace("zerotrain train",
                                                                                     "zerotrain train --n-head 3", 1))})
    with pytest.raises(AssertionError, match=rf"{first.source}:{first.line}: exit code 2(.|\n)*(n_embd|head)"):
        run_blocks(cheap_groups(broken)["stdlib"][:1], tmp_path)


def test_a_broken_promise_is_caught(tmp_path):
    # The promise checks read the run's own files: a resumed run that restarted from step 0 instead fails them.
    run = tmp_path / "runs" / "resized"
    run.mkdir(parents=True)
    records = [{"step": s, "loss": 1.0} for s in range(1, 21)] + [{"event": "stop", "step": 20, "signal": "SIGTERM"}]
    records += [{"step": s, "loss": 1.0} for s in range(1, 41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"world_size": 4, "start_step": 0, "steps": 40, "resumed_from": None}))
    with pytest.raises(AssertionError):
        the_stopped_run_went_on_from_its_stop_on_four_ranks(tmp_path)
