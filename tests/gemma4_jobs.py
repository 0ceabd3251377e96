"""Jobs of the Gemma 4 tests run by spawned ranks (importable by module name); planted bugs patch the product's own
functions."""

from __future__ import annotations

from unittest import mock

from zerotrain.config import Config
from zerotrain.model import gemma4
from zerotrain.parallel import Comm
from zerotrain.training.loop import train_job


def after_the_blocks(model, modules):
    """The per-layer inputs' modules registered after the blocks and the final norm."""
    model.update(modules)
    return model


def per_layer_inputs_after_the_blocks_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: `zerotrain train` with Gemma 4's per-layer input modules registered after the blocks (where the
    final norm is), so that their buckets are the first the backward reduces."""
    with mock.patch.object(gemma4, "beside_the_embedding", after_the_blocks):
        return train_job(cfg, comm)
