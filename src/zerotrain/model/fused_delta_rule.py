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

Host reads: none in a step. With records, fla needs the segments' boundaries on the host too (their count sizes its
chunks' layout): a step computes them once per micro-batch from its segments while they are still on the host
(`segment_bounds`, which data/batches.on_device calls where `bounds_for` says the model runs fla) and copies them to
the device with the batch; the model hands them to every linear layer of that forward (`Packed`), and each call
gives fla both copies (cu_seqlens, cu_seqlens_cpu), so that neither it nor fla reads the device. Under --cp the
whole rows give them for each rank's chunks (parallel/context.py's part, delta_rule_cp.py). Starts given without
them (a caller outside the step's batches: evaluation, the tests) are read to the host once a call.

Stays on torch: CPU tensors, `--linear-attention-kernel torch`, a machine without fla, and the convolution through a
KV cache (its cached inputs continue one sequence; the delta rule there takes the cached state as its initial state).
The memory plan (model/activation_memory.py) counts the torch path's saved tensors, not fla's: a run does not
measure its first micro-batch against it under fla (training/loop.py's fused_linear_layers).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

from zerotrain.config import QWEN35, ModelConfig

from . import delta_rule
from .delta_rule import record_starts

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
    total (their count sizes it: on the host, without a read)."""
    first = segment_starts(starts).flatten().nonzero().squeeze(1)
    return torch.cat([first, first.new_tensor([starts.numel()])])


class SegmentBounds(NamedTuple):
    """fla's cu_seqlens of one packed micro-batch: on the kernels' device, and on the host (the same values)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor


class Packed(NamedTuple):
    """Packed records as the linear layers take them through fla: their starts (B, T) bool and their segments'
    SegmentBounds, computed with the micro-batch."""

    starts: torch.Tensor
    bounds: SegmentBounds


def segment_bounds(segments: torch.Tensor, device: torch.device) -> tuple[SegmentBounds, ...]:
    """The SegmentBounds of a micro-batch's `segments` (B, T) on the host, the device's copies queued (pinned, not
    waited for) on the current stream: on_device's side stream, beside the batch's own copy. One for the rows; under
    --cp, the two layouts of this rank's chunks that ContextParallel.part left on its part's segments
    (`split_starts`: the convolution's and the rule's, delta_rule_cp.split_starts)."""
    bounds = []
    for starts in getattr(segments, "split_starts", None) or (record_starts(segments),):
        host = cu_seqlens(starts)
        bounds.append(SegmentBounds(host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host,
                                    host))
    return tuple(bounds)


def bounds_for(cfg: ModelConfig, device: torch.device
               ) -> Callable[[torch.Tensor, torch.device], tuple[SegmentBounds, ...]] | None:
    """What data/batches.on_device computes beside each packed micro-batch for a model `cfg` on `device`:
    `segment_bounds` where its linear layers run fla, None (nothing) otherwise."""
    return segment_bounds if cfg.arch in QWEN35 and fused_on(device) else None


def with_bounds(starts: torch.Tensor | Packed) -> Packed:
    """`starts` with its segments' bounds: those computed with the micro-batch, or else from `starts` (one read of
    the device)."""
    if isinstance(starts, Packed):
        return starts
    host = cu_seqlens(starts.cpu())
    return Packed(starts, SegmentBounds(host.to(starts.device), host))


def plain(starts: torch.Tensor | Packed | None) -> torch.Tensor | None:
    """The record starts alone, as delta_rule.py takes them."""
    return starts.starts if isinstance(starts, Packed) else starts


def fla_bounds(records: Packed | None) -> dict[str, torch.Tensor | None]:
    """fla's cu_seqlens and cu_seqlens_cpu arguments: `records`' (None: one sequence a row)."""
    return records.bounds._asdict() if records is not None else {"cu_seqlens": None, "cu_seqlens_cpu": None}


def causal_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | Packed | None = None,
                past: torch.Tensor | None = None) -> torch.Tensor:
    """delta_rule.causal_conv: x (B, channels, T) by `weight` (channels, 1, K), records restarting at `starts`."""
    if past is not None or not fused_on(x.device):
        return delta_rule.causal_conv(x, weight, plain(starts), past)
    packed = starts is not None
    records = with_bounds(starts) if packed else None
    y, _ = fla_kernels().causal_conv1d(to_fla(x.transpose(1, 2), packed), weight.squeeze(1), activation=None,
                                       **fla_bounds(records))
    return from_fla(y, x.shape[0], packed).transpose(1, 2)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, starts: torch.Tensor | Packed | None = None,
                           initial_state: torch.Tensor | None = None, state_gradient: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule.chunk_gated_delta_rule: the outputs (B, T, value heads, value width) in query's dtype and the state
    after each row's last token (B, value heads, key width, value width); `state_gradient` as there (fla's final
    state always keeps its graph)."""
    if not fused_on(query.device):
        return delta_rule.chunk_gated_delta_rule(query, key, value, g, beta, plain(starts), initial_state,
                                                 state_gradient=state_gradient)
    rows, packed = query.shape[0], starts is not None
    # one dtype for the kernel's q, k and v (a caller may widen the query alone, as context parallelism does)
    key, value = key.to(query.dtype), value.to(query.dtype)
    records = with_bounds(starts) if packed else None
    starts = plain(starts)
    if packed and initial_state is not None:  # a row's state enters its first segment only
        first = segment_starts(starts).sum(dim=1).cumsum(0).roll(1)
        first[0] = 0
        kept = initial_state * (~starts[:, 0]).to(initial_state.dtype)[:, None, None, None]
        segments = len(records.bounds.cu_seqlens) - 1
        initial_state = initial_state.new_zeros(segments, *initial_state.shape[1:]).index_copy(0, first, kept)
    out, state = fla_kernels().chunk_gated_delta_rule(
        *(to_fla(t, packed) for t in (query, key, value, g, beta)), initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, **fla_bounds(records))
    if packed:  # each row's last segment's
        state = state[segment_starts(starts).sum(dim=1).cumsum(0) - 1]
    return from_fla(out, rows, packed), state
