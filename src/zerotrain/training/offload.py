"""--offload-activations: what a forward saves for its backward waits in host memory in between, not on the GPU.

Saved-tensor hooks (as torch.autograd.graph.save_on_cpu) entered around the model's forward: each saved tensor is
copied into pinned host memory as it is saved (non-blocking, on the current stream) and copied back when the
backward unpacks it. Parameters are left where they are (they are held anyway; save_on_cpu would copy every weight
to the host in every forward). With --activation-checkpointing the two compose: torch's checkpoint saves each
block's input through the hooks of the enclosing forward (its inputs are saved for backward before its own hooks
are entered), so the block inputs, all that the blocks keep, wait on the host; what a block saves when it is
recomputed in the backward is used there and never offloaded. Under ZeRO-3 the engine's own hooks (entered inside
the model's forward) keep the unit weights where they lie and pass every other saved tensor on to these.

The device then holds one micro-batch's activations only while its forward and backward run through them; the host
holds them all (each saved tensor's copy, a storage saved twice copied twice). On the CPU the copy moves nothing
anywhere useful: the flag is refused there (config.validate).
"""

from __future__ import annotations

import torch
from torch import nn


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t`, its layout kept; pinned and non-blocking from a GPU, so the copy overlaps the forward."""
    host = torch.empty_like(t, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    return host


def to_device(host: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    return host.to(device, non_blocking=pin)


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep every saved tensor but the parameters on the host. `packed` and `packed_bytes`:
    what the forwards since construction moved (the memory plan's host row; a test's proof that they run)."""

    def __init__(self, model: nn.Module):
        self.model, self.packed, self.packed_bytes = model, 0, 0
        self.held: set[int] = set()
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        # the parameters' storages now: ZeRO-3 points them at gathered buffers, which its own hooks keep
        self.held = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        return super().__enter__()

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.held:
            return t
        pin = t.device.type == "cuda"
        self.packed += 1
        self.packed_bytes += t.numel() * t.element_size()
        return t.device, to_host(t, pin)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return to_device(host, device, device.type == "cuda")


def offload_activations(model: nn.Module) -> HostActivations:
    """Enter HostActivations around every forward of `model` (a forward hook that runs also when the forward raises
    leaves them, so none stays on the thread's stack); returns them, for their counts. Entered outside the model's
    own forward, so that hooks entered inside it (ZeRO-3's) pass activations on to them. A forward without grad, or
    the recompute of a checkpoint in the backward, saves nothing, so they cost nothing there."""
    hooks = HostActivations(model)

    def enter(_module, _args) -> None:  # returns nothing: a pre-hook's result would replace the forward's inputs
        hooks.__enter__()

    def leave(_module, _args, _output) -> None:
        hooks.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return hooks
