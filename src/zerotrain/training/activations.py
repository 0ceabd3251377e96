"""What autograd keeps for the backward: the bytes of the tensors saved while a forward builds its graph.

Counted with saved-tensor hooks, each storage once, the parameters left out (they are held anyway), and the op
outputs a selective checkpoint keeps (held by the checkpoint, out of the hooks' sight: model/recompute.py tells them):
the activation memory of one micro-batch, which --activation-checkpointing blocks cuts to each block's
input plus what the layers outside the blocks (embedding, final norm, head, loss) save.
"""

from __future__ import annotations

from typing import Callable

import torch

from zerotrain.model.recompute import kept_outputs_seen_by


def saved_for_backward(run: Callable[[], torch.Tensor], params) -> tuple[int, torch.Tensor]:
    """(bytes saved for the backward while `run()` builds its graph, its result); `params` are not counted."""
    saved, out = saved_storages(run, params)
    return sum(saved.values()), out


def saved_storages(run: Callable[[], torch.Tensor], params) -> tuple[dict[int, int], torch.Tensor]:
    """({storage address: bytes} of each storage saved for the backward while `run()` builds its graph, its
    result); `params` are not counted. The largest of them is the largest activation kept."""
    held = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kept_outputs_seen_by(pack):
        out = run()
    return saved, out
