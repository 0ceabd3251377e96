"""ZeRO-3 after a forward that raised (out of memory, a refused batch): no saved-tensor hooks left on the thread's
stack, nothing gathered held, and the next step is a fresh engine's, bitwise."""

import contextlib

import pytest
import torch
from conftest import tiny_config
from test_engine import run_steps

from zerotrain.data import BatchSchedule, make_source
from zerotrain.parallel import ShardedParameters, sharded
from zerotrain.training.loop import accumulate_gradients, build_engine


class RefusedBatch(RuntimeError):
    pass


def raise_in_block(engine) -> None:
    """Block 1's attention raises in the next forward (once), while its unit and the root are whole and the
    engine's saved-tensor hooks active."""
    attn = engine.model.transformer.h[1].attn

    def refuse(_module, _args):
        handle.remove()
        raise RefusedBatch("refused batch")

    handle = attn.register_forward_pre_hook(refuse)


def saved_tensor_hooks_on_the_stack():
    return sharded._current_saved_tensors_hooks()


def failed_step_then_steps(cfg, comm):
    """An engine whose first step raised in block 1's forward, then trained 2 steps; what the failure left."""
    engine = build_engine(cfg, comm)
    batch = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum, rank=0,
                          world_size=1).batch(0)
    raise_in_block(engine)
    engine.zero_grad()
    with pytest.raises(RefusedBatch):
        accumulate_gradients(engine, batch)
    left = {"hooks": saved_tensor_hooks_on_the_stack() is not None, "whole": sorted(engine.placement.whole),
            "running": list(engine.placement._current)}
    if left["hooks"]:  # the planted engine's: taken off, so that the tests after this one start clean
        torch._C._autograd._pop_saved_tensors_default_hooks()
    return engine, left


def old_hooks(self):
    """Planted: the saved-tensor hooks entered and left apart (as by the root's pre-hook and forward hook), so a
    forward that raises between them leaves them entered."""

    @contextlib.contextmanager
    def entered_and_left_apart():
        if not torch.is_grad_enabled() or sharded.in_backward():
            yield
            return
        self._outer_hooks = sharded._current_saved_tensors_hooks()
        self._saved_hooks.__enter__()
        yield
        self._saved_hooks.__exit__(None, None, None)

    return entered_and_left_apart()


def test_a_forward_that_raises_at_stage3_leaves_no_saved_tensor_hooks_and_the_next_steps_are_a_fresh_engines(
        tmp_path, one_rank, monkeypatch):
    cfg = tiny_config(tmp_path, zero=3, micro=4, accum=2, steps=2)
    assert saved_tensor_hooks_on_the_stack() is None
    engine, left = failed_step_then_steps(cfg, one_rank)
    assert left == {"hooks": False, "whole": [], "running": []}
    fresh = build_engine(cfg, one_rank)
    assert run_steps(engine, cfg, 2) == run_steps(fresh, cfg, 2)
    assert torch.equal(engine.held_params, fresh.held_params)
    assert saved_tensor_hooks_on_the_stack() is None

    monkeypatch.setattr(ShardedParameters, "saved_tensor_hooks", old_hooks)
    _, planted = failed_step_then_steps(cfg, one_rank)
    assert planted["hooks"] and planted["running"] and saved_tensor_hooks_on_the_stack() is None
