"""Full tensors from TP ranks' flat buffers: how the engine and checkpoints put TP slices together."""

from __future__ import annotations

import torch

from zerotrain.model.tensor_parallel import TPSlice


def full_tensors(layout, slices: dict[str, TPSlice], flats) -> dict[str, torch.Tensor]:
    """The full model's tensors by name, from flats[t] = TP rank t's padded flat buffer (T = len(flats)).

    Split parameters are placed from every TP rank's slice (a KV head on several TP ranks from the first of
    them, whose replicas hold it bitwise equal: once); replicated ones are TP rank 0's copy (views of flats[0],
    which every TP rank holds bitwise equal). All in the flats' dtype and device.
    """
    full = {}
    for s in layout.slots:
        local = [flat[s.offset : s.offset + s.numel].view(s.shape) for flat in flats]
        if s.name in slices:
            tp_slice = slices[s.name]
            full[s.name] = torch.empty(tp_slice.full_shape, dtype=flats[0].dtype, device=flats[0].device)
            for t, piece in enumerate(local):
                if tp_slice.first_holder(t) == t:
                    tp_slice.place(full[s.name], piece, t)
        else:
            full[s.name] = local[0]
    return full

