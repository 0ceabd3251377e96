"""Jobs of the ZeRO-3 start-up tests (tests/test_zero3_init.py), run by spawned ranks; planted bugs patch the product's
own functions."""

from __future__ import annotations

from unittest import mock

from zerotrain.config import Config
from zerotrain.hub import init_from
from zerotrain.model import init
from zerotrain.parallel import Comm, ZeroEngine
from zerotrain.training.loop import build_engine, train_job


def summary_job(cfg: Config, comm: Comm) -> dict | None:
    """`zerotrain train`'s job; on rank 0 what `zerotrain train` writes to summary.json."""
    return train_job(cfg, comm).get("summary")


def whole_tensor_job(cfg: Config, comm: Comm) -> dict | None:
    """Planted bug: stage 3 takes the whole tensor (its TP slice) of every parameter it owns part of and keeps its
    range, as it did before it asked the source for the range alone."""
    def whole(self, name, p, lo, hi):
        return self.initial_value(name, p).reshape(-1)[lo:hi]

    with mock.patch.object(ZeroEngine, "initial_range", whole):
        return summary_job(cfg, comm)


def initial_model_job(cfg: Config, comm: Comm) -> dict:
    """The engine's initial model, gathered whole after its construction, before any step."""
    return build_engine(cfg, comm).full_state_dict()


def local_positions_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a TP slice is drawn at its own positions, not at those its values have in the full tensor."""
    real = init.full_positions
    with mock.patch.object(init, "full_positions", lambda shape, split, rank, lo, hi: real(shape, None, 0, lo, hi)):
        return initial_model_job(cfg, comm)


def unsliced_reads_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: --init-from's rows are read as if no tensor were TP-split (the slice's parts dropped)."""
    real = init_from._read_rows
    with mock.patch.object(init_from, "_read_rows", lambda f, name, tp_slice, *a: real(f, name, None, *a)):
        return initial_model_job(cfg, comm)
