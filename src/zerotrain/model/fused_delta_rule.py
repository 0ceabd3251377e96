"""Which kernels compute Qwen3.5's Gated DeltaNet: flash-linear-attention's (`fla`) fused Triton kernels on CUDA
tensors where the package is installed, as transformers' modeling_qwen3_5 picks them, delta_rule.py's plain torch
otherwise.

`causal_conv` and `chunk_gated_delta_rule` take delta_rule.py's arguments and give its results (the outputs in the
query's dtype, the state after the last token in fp32), so a caller swaps one for the other: fla's
`chunk_gated_delta_rule` (q, k L2-normalised in the kernel, scale 1 / sqrt(key width), each key head serving
consecutive value heads as repeat_interleave groups them) and `causal_conv1d` (no activation: SiLU is the caller's).
Both take (B, T, heads, width), time before heads. The rule takes an initial state and gives the final state (fla's
with its gradient, which context parallelism composes into the next chunks' states).

Packed records: fla keeps documents apart only as one sequence of batch 1 with `cu_seqlens`, its segments'
boundaries. The rows are laid end to end, and a segment starts at every row's first token and every record's first
token, so the state and the convolution restart where the torch path restarts them. A row's initial state is
its first segment's (none where a record starts at the row's first token, as the torch path ignores it there), its
final state its last segment's.

Host reads: without records, none. With records, the segments' boundaries are read once a call (their count sizes
cu_seqlens), as fla itself reads cu_seqlens to the host to lay out its chunks.

Stays on torch: CPU tensors, `--linear-attention-kernel torch`, a machine without fla, and the convolution through a
KV cache (its cached inputs continue one sequence; the delta rule there takes the cached state as its initial state).
The memory plan (model/activation_memory.py) counts the torch path's saved tensors, not fla's: a run does not
measure its first micro-batch against it under fla (training/loop.py's fused_linear_layers).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from . import delta_rule

KERNELS = ("auto", "torch", "fla")
_chosen = "auto"  # --linear-attention-kernel, for this process (`choose`)


def choose(kernel: str) -> None:
    """--linear-attention-kernel: auto (fla on CUDA where installed), torch, or fla (config.py and cli/flags.py
    refuse it without CUDA or the package, before the run)."""
    global _chosen
    if kernel not in KERNELS:
        raise ValueError(f"linear-attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    _chosen = kernel


@functools.cache
def fla_kernels() -> SimpleNamespace | None:
    """fla's `chunk_gated_delta_rule` and `causal_conv1d`, or None where the package does not import."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule, causal_conv1d=causal_conv1d)


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def fused_on(device: torch.device) -> bool:
    """Whether the layers on `device` go through fla's kernels: CUDA, the package there, and not turned off."""
    return _chosen != "torch" and on_cuda(device) and fla_kernels() is not None


def segment_starts(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where fla's segments start, every record's first token and every row's."""
    first = torch.zeros_like(starts)
    first[:, 0] = True
    return starts | first


def to_fla(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """(B, T, ...) in fla's layout: as it is (fla takes time before heads); packed, the rows end to end as one
    sequence of batch 1."""
    return x.reshape(1, -1, *x.shape[2:]) if packed else x


def from_fla(y: torch.Tensor, rows: int, packed: bool) -> torch.Tensor:
    """to_fla undone on an output: (rows, T, ...)."""
    return y.reshape(rows, -1, *y.shape[2:]) if packed else y


def cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """fla's cumulative segment lengths (N + 1,) of the rows laid end to end: each segment's first token, then the
    total (reads the boundaries to the host: their count sizes it)."""
    first = segment_starts(starts).flatten().nonzero().squeeze(1)
    return torch.cat([first, first.new_tensor([starts.numel()])])


def causal_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> torch.Tensor:
    """delta_rule.causal_conv: x (B, channels, T) by `weight` (channels, 1, K), records restarting at `starts`."""
    if past is not None or not fused_on(x.device):
        return delta_rule.causal_conv(x, weight, starts, past)
    packed = starts is not None
    y, _ = fla_kernels().causal_conv1d(to_fla(x.transpose(1, 2), packed), weight.squeeze(1), activation=None,
                                       cu_seqlens=cu_seqlens(starts) if packed else None)
    return from_fla(y, x.shape[0], packed).transpose(1, 2)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, starts: torch.Tensor | None = None,
                           initial_state: torch.Tensor | None = None, state_gradient: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule.chunk_gated_delta_rule: the outputs (B, T, value heads, value width) in query's dtype and the state
    after each row's last token (B, value heads, key width, value width); `state_gradient` as there (fla's final
    state always keeps its graph)."""
    if not fused_on(query.device):
        return delta_rule.chunk_gated_delta_rule(query, key, value, g, beta, starts, initial_state,
                                                 state_gradient=state_gradient)
    rows, packed = query.shape[0], starts is not None
    # one dtype for the kernel's q, k and v (a caller may widen the query alone, as context parallelism does)
    key, value = key.to(query.dtype), value.to(query.dtype)
    bounds = cu_seqlens(starts) if packed else None
    if packed and initial_state is not None:  # a row's state enters its first segment only
        first = segment_starts(starts).sum(dim=1).cumsum(0).roll(1)
        first[0] = 0
        kept = initial_state * (~starts[:, 0]).to(initial_state.dtype)[:, None, None, None]
        initial_state = initial_state.new_zeros(len(bounds) - 1, *initial_state.shape[1:]).index_copy(0, first, kept)
    out, state = fla_kernels().chunk_gated_delta_rule(
        *(to_fla(t, packed) for t in (query, key, value, g, beta)), initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    if packed:  # each row's last segment's
        state = state[segment_starts(starts).sum(dim=1).cumsum(0) - 1]
    return from_fla(out, rows, packed), state
