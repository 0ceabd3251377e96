"""The engine's interface under expert parallelism, each member covering the expert group: the final parameter norms a
run reports count the experts (--ep 2's equal --ep 1's), and an async save's staging copy is waited for by both
groups' updates.

2 ranks, the tiny Qwen3-MoE. Planted: a norm of the dense group's buffer alone (what the run reported while an expert
engine forwarded its attributes to the dense engine), and an update hook registered on the dense group only (an
expert update then runs before the staging copy, which saves the updated experts).
"""

from __future__ import annotations

import os
import threading
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import spawn

from zerotrain.checkpoint import step_name
from zerotrain.checkpoint.format import shard_name
from zerotrain.checkpoint.save import CheckpointWriter
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.parallel import ZeroEngine
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training.loop import build_engine, train

pytestmark = pytest.mark.timeout(300)


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--no-progress",
                                      "--steps", "3", "--nproc", "2", "--micro-batch", "2", "--lr", "1e-2",
                                      "--threads", "1", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def dense_norm_only(engine):
    """Planted in place of ZeroEngine.param_norm: the dense group's buffer alone."""
    return torch.linalg.vector_norm(engine.held_params.float()).reshape(1).to(torch.float64)


def dense_hook_only(engine, hook):
    """Planted in place of ZeroEngine.register_update_pre_hook: the expert group's updates unguarded."""
    engine.adamw.register_update_pre_hook(hook)


def staged_experts(comm, tmp, name) -> float:
    """An async save at --ep 2 whose staging copy is held back while the expert engine updates: the largest
    difference between the expert state the checkpoint holds and that state when the save started."""
    engine = build_engine(config(tmp / name, "--ep", "2"), comm)
    release = threading.Event()
    writer = CheckpointWriter(str(tmp / name / "checkpoints"), comm, async_save=True,
                              staging_hook=lambda step: release.wait(60))
    engine.zero_grad()
    for p in engine.experts.params:  # an update from zero gradients: AdamW's decay and its step count move
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    writer.start(1, engine, {"config": {}})
    at_start = {f"expert_{k}": v.clone() for k, v in engine.experts.shard_state_dict().items()}
    threading.Timer(1.0, release.set).start()  # the copy starts a second later, after the update asked to run
    engine.experts.apply(1e-2, 0.0)
    writer.finish()
    folder = os.path.join(str(tmp / name / "checkpoints"), step_name(1))
    shard = load_file(os.path.join(folder, shard_name(comm.rank, comm.world_size)))
    assert engine.step_count == 0 and engine.experts.step_count == 1
    return max(float((shard[k].double() - v.double()).abs().max()) for k, v in at_start.items())


def job(rank, comm, tmp):
    out = {f"ep{e}": train(config(tmp / f"ep{e}", "--ep", str(e)), comm, announce=False).param_norms for e in (1, 2)}
    with mock.patch.object(ZeroEngine, "param_norm", dense_norm_only):
        out["planted norm"] = train(config(tmp / "planted", "--ep", "2"), comm, announce=False).param_norms
    out["staged"] = staged_experts(comm, tmp, "staged")
    with mock.patch.object(ZeroEngine, "register_update_pre_hook", dense_hook_only):
        out["planted staged"] = staged_experts(comm, tmp, "planted_staged")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    codes, results = spawn(job, 2, tmp_path_factory.mktemp("ep_engine"), timeout=280)
    assert codes == [0, 0], results
    return results


def test_ep2_final_parameter_norms_equal_ep1s_and_a_norm_without_the_experts_is_caught(two_ranks):
    for r in two_ranks:
        assert len(r["ep2"]) == 2
        for ep2, ep1 in zip(r["ep2"], r["ep1"]):
            assert abs(ep2 - ep1) <= 1e-6, (r["ep2"], r["ep1"])
        # planted: the dense engine's buffer alone leaves the experts out
        assert all(ep1 - planted > 0.1 for planted, ep1 in zip(r["planted norm"], r["ep1"])), r["planted norm"]


def test_an_async_save_at_ep2_holds_the_experts_as_staged_and_an_unguarded_expert_update_is_caught(two_ranks):
    for r in two_ranks:
        assert r["staged"] == 0.0  # the expert update waited for the staging copy
        assert r["planted staged"] > 1e-6  # planted: the copy saved the updated experts
