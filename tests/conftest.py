"""Shared test setup: tiny configs, a one-rank process group, commands run in-process, child-process checks."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Before torch (and its OpenMP runtime, which reads this once) is loaded here or in any process the tests start: a
# thread waiting at the end of a parallel region sleeps instead of spinning. The suite runs more threads than the
# machine has cores (three workers, each's ranks, on 2 cores): a spinning thread holds a core another process needs.
# Measured on the 2-core machine under load: a tiny GPT's 30 steps in one process on 2 threads, 29 s wall and 6.2 s of
# CPU spinning, 1.4 s and 0.55 s sleeping. Which thread computes what is unchanged, and so are the results, bitwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch.distributed as dist  # noqa: E402

# Job functions for spawned ranks must be importable by module name in the children.
sys.path.insert(0, os.path.dirname(__file__))
# Prepared text inputs go to a cache of this test session (inherited by subprocesses), not the user's. The processes
# this session starts that import this file (pytest-xdist's workers, ranks running a test's job) use the session's:
# what one prepared, the others find built (the cache locks each entry while it is built), and none leaves its own.
if not (os.environ.get("ZEROTRAIN_TEST_CACHE") == os.environ.get("ZEROTRAIN_CACHE")
        and os.path.isdir(os.environ.get("ZEROTRAIN_CACHE", ""))):
    os.environ["ZEROTRAIN_CACHE"] = os.environ["ZEROTRAIN_TEST_CACHE"] = tempfile.mkdtemp(prefix="zerotrain-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ZEROTRAIN_CACHE"], True)


def compile_checkout() -> None:
    """Bytecode for zerotrain's sources in this checkout and for tests/, written once here. Python reads bytecode where
    it finds it, but with PYTHONDONTWRITEBYTECODE set (as on the 2-core development machine) it writes none: each of the
    suite's hundreds of interpreters (ranks, launchers, torchrun's ranks) would compile 18,000 lines of zerotrain
    anew, 0.3 s of CPU each, about 55 s of the suite's CPU. An installed zerotrain (pip compiled it) is left alone."""
    import compileall
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(importlib.util.find_spec("zerotrain").origin)
    for folder in (package, here):
        if os.path.commonpath([folder, os.path.dirname(here)]) == os.path.dirname(here):
            compileall.compile_dir(folder, quiet=2)


compile_checkout()
# The memory plan's check is strict under the tests: a run whose state differs from the plan by a byte fails (in
# production the difference is an event and the run goes on). Set here, so the ranks and commands the tests start
# inherit it.
os.environ["ZEROTRAIN_STRICT_PLAN"] = "1"

from zerotrain.config import Config, resolve, setting_for, validate  # noqa: E402
from zerotrain.runtime.run_folder import resolve_paths  # noqa: E402


@pytest.fixture(autouse=True)
def strict_plan_kept():
    """A test that ran a script or command in this process must leave the strict check on for the tests after it on
    this worker (a script that turned it off for good once made three later tests pass a planted plan mistake)."""
    yield
    if os.environ.get("ZEROTRAIN_STRICT_PLAN") != "1":
        os.environ["ZEROTRAIN_STRICT_PLAN"] = "1"
        pytest.fail("the test left ZEROTRAIN_STRICT_PLAN off for the tests after it")


def tiny_config(tmp_path, *, nproc=1, micro=8, accum=1, steps=5, **run) -> Config:
    """The lesson's tiny GPT with small buckets, so multi-bucket code paths are exercised."""
    cfg = Config()
    cfg.data.source = "synthetic"  # the default corpus is for users; unit tests learn the tiny Markov chain
    cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.accum, cfg.loop.steps = nproc, micro, accum, steps
    cfg.logging.progress = False
    cfg.parallel.bucket_mb = 0.01  # ~2.6K values: several buckets for the 28K-parameter model
    cfg.logging.out = str(tmp_path)
    cfg.launch.timeout = 60
    # MFU against a given peak: rank 0 of each run otherwise times the CPU's matmul as it starts (up to 0.25 s, never
    # cached under the suite's load), measured a fifth of a multi-rank module's runs (test_zero3's 46 runs on one
    # start of 2 ranks: 6.9 of 33 s). test_throughput times it.
    cfg.logging.peak_flops = 1e12
    for key, value in run.items():
        s = setting_for(key)
        setattr(getattr(cfg, s.section), s.name, value)
    return resolve_paths(resolve(validate(cfg)))


def as_version_1(folder: str) -> None:
    """Turn the checkpoint `folder` into format version 1, as zerotrain wrote them before it stored the parameters
    once: beside the shards, model.safetensors, the full model assembled from their masters (in a bf16 run rounded to
    bf16), listed in the manifest with its size and sha256."""
    import hashlib
    import json

    from safetensors.torch import save_file

    from zerotrain.checkpoint.format import MANIFEST, MODEL_FILE
    from zerotrain.checkpoint.consolidate import checkpoint_model

    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    model = checkpoint_model(folder, manifest, from_shards=True)
    path = os.path.join(folder, MODEL_FILE)
    save_file(model, path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    manifest["version"] = 1
    manifest["files"] = sorted(manifest["files"] + [{"name": MODEL_FILE, "bytes": os.path.getsize(path),
                                                      "sha256": digest}], key=lambda f: f["name"])
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f)


@contextlib.contextmanager
def world_of_one():
    """A real gloo process group of world size 1 on 127.0.0.1 (its Comm), torn down on leaving."""
    from zerotrain.parallel import Comm

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield Comm()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """world_of_one for one test."""
    with world_of_one() as comm:
        yield comm


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process, zombies and multiprocessing's shared resource tracker
    left out. The forkserver local ranks are forked from (started by a launch, it lives as long as its launcher; it
    is not a rank) is left out too and seen through: a rank's parent is given as the forkserver's parent, the
    launcher, as a spawned rank's would be."""
    procs = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[0] != "Z" and b"resource_tracker" not in cmdline:
                procs[int(pid)] = (int(fields[1]), int(fields[2]), b"multiprocessing.forkserver" in cmdline)
    # a forked rank keeps the server's command line: the server is the one whose parent is not a forkserver
    servers = {pid: parent for pid, (parent, _, forked) in procs.items()
               if forked and not procs.get(parent, (0, 0, False))[2]}
    return [(pid, servers.get(parent, parent), group) for pid, (parent, group, _) in procs.items()
            if pid not in servers]


def child_pids() -> list[int]:
    """Live child processes of this process (to check that a job reaped its ranks)."""
    return [pid for pid, parent, _ in live_processes() if parent == os.getpid()]


def zerotrain_here(capfd, *argv: str, faults: str | None = None) -> subprocess.CompletedProcess:
    """`zerotrain ARGV` through its entry point in this process, as `python -m zerotrain` runs it: the exit code, and
    the output of this process and of the ranks it starts (processes of their own, writing to the captured fds).

    ZEROTRAIN_FAULTS is `faults` for this command alone. Any run folder the command still holds is let go here, as
    the end of its own process would let it go.

    Prefer it to a `python -m zerotrain` subprocess unless the command signals its launcher's process group (group_*)
    or needs a bug planted in a fresh interpreter (a SIGTERM to the launcher alone, `sigterm`, reaches the command's
    own handler here): a subprocess imports zerotrain and starts a ranks' server of its own
    (about 6 s of CPU), where this process's server, started once per pytest worker, forks a 2-rank tiny run's ranks
    for about 0.4 s of CPU (measured with cpuacct on the 2-core machine).
    """
    from zerotrain.cli.main import main
    from zerotrain.runtime.run_folder import release_run_folders
    from zerotrain.training.faults import ENV

    capfd.readouterr()
    saved = os.environ.pop(ENV, None)
    if faults:
        os.environ[ENV] = faults
    try:
        code = main(list(argv))
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved
        release_run_folders()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["zerotrain", *argv], code, out, err)


def shared_fixtures(item) -> list[str]:
    """The module-, package- and class-scoped fixtures `item` uses (those it shares with the module's other tests)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = [d for name in getattr(item, "fixturenames", ()) for d in (info.name2fixturedefs.get(name, ()) if info else ())]
    return sorted({d.argname for d in defs if d.scope in ("module", "package", "class")})


def fixture_groups(items) -> dict:
    """Under pytest-xdist (`--dist loadgroup`): the tests that share a module-scoped fixture (an expensive run they all
    assert on) go to one worker, so it is made once; every other test goes wherever a worker is free. A group is a
    module's tests joined by the fixtures they share: a module whose tests use two fixtures that no test uses together
    (test_gpt_oss's `pair` and `folder`, test_sample's `run` and `instruct`) is two groups, made on two workers at once
    rather than one after the other. A group is named after its module, and its first fixture where the module has
    several. Modules that name their own group (pytestmark) keep it whole."""
    parent: dict = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    used = {}
    for item in items:
        shared = shared_fixtures(item)
        if shared and not any(True for _ in item.iter_markers("xdist_group")):
            used[item] = [(item.module.__name__, name) for name in shared]
            for key in used[item][1:]:
                parent[root(key)] = root(used[item][0])
    roots = {}
    for keys in used.values():
        roots.setdefault(keys[0][0], set()).add(root(keys[0]))
    return {item: keys[0][0] if len(roots[keys[0][0]]) == 1 else f"{keys[0][0]}.{root(keys[0])[1]}"
            for item, keys in used.items()}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Each test of a shared fixture marked with its group (fixture_groups), before xdist's worker reads the marks into
    the node ids its scheduler groups by (its own pytest_collection_modifyitems, which runs after this one; pytest
    9.2's node ids no longer take them: pyproject pins below it).

    The README's and docs/' recipes are collected first. Each is one test, and among the longest (a recipe
    starts a dozen processes); pytest-xdist hands out the groups of a module fixture first, then single tests in
    collection order, so a recipe collected late (test_readme sorts after most files) would be the run's tail, its
    worker busy while the others have nothing left."""
    for item, group in fixture_groups(items).items():
        item.add_marker(pytest.mark.xdist_group(group))
    recipes = [item for item in items if item.originalname == "test_cheap_recipe_runs_as_written"]
    if recipes:
        rest = [item for item in items if item.originalname != "test_cheap_recipe_runs_as_written"]
        items[:] = recipes + rest
