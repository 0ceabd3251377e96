"""Full tensors from TP ranks' flat buffers: how the engine and checkpoints put TP slices together."""

from __future__ import annotations

import torch

from zerotrain.model.tensor_parallel import TPSlice


def full_tensors(layout, slices: dict[str, TPSlice], flats) -> dict[str, torch.Tensor]:
    """The full model's tensors by name, from flats[t] = TP rank t's padded flat buffer, in their dtype and device:
    split ones from every TP rank's slice (a KV head from its first holder), replicated ones TP rank 0's (views)."""
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

