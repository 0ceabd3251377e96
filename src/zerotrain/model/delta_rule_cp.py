"""Qwen3.5's linear attention over rows split by context parallelism (--cp C): delta_rule.py's convolution and gated
delta rule (or fla's kernels, fused_delta_rule.py) on this rank's two chunks of each row (chunks i and 2C-1-i of 2C, parallel/context.py), exact up to float
rounding, without any rank holding more of a row than its own tokens.

The state after a chunk is affine in the state before it: in the kernel's convention (the state S is key width x
value width, written by k v^T)

    S_out = M S_in + B

B the state the chunk leaves from a zero state, M (key width x key width) the one it leaves from the identity with
no values written. One run of the kernel gives both, and the outputs: its values widened by key-width zeros and its
initial state [0 | I], whose columns evolve independently, leave [B | M] and output [O_0 | O_I], the outputs from a
zero state and the readout of the identity; from a true initial state S_in the outputs are O_0 + O_I S_in. A record
starting in the chunk (or at its first token) zeroes the state there (delta_rule.py's resets): M and the rows of O_I
from that token on are 0 without anything here knowing of records.

Every rank's (M, B) of its two chunks are all-gathered (with their gradient: backward, each rank's gradients of every
chunk's summed, parallel/context.py), each rank composes the states before its chunks in row order (S_0 = 0, S_{j+1}
= M_j S_j + B_j: 2C - 2 small matmuls at most) and corrects its outputs. The convolution's first K - 1 outputs of a
chunk read the K - 1 inputs before it, the previous chunk's last (zeros before the row; a record's start masks them
as it masks its own chunk's): every rank's chunk tails all-gathered the same way.

Costs beside the kernel on T / C tokens: the kernel's values key-width wider (Qwen3.5's key and value heads are of
one width: twice the values), every chunk's (M, B) per layer (2C B H dk (dk + dv) fp32) and the tails (2C B W (K - 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .fused_delta_rule import Packed, SegmentBounds, causal_conv, chunk_gated_delta_rule


@dataclass
class SplitRows:
    """What the linear layers compute with when each row is split over a context-parallel group (parallel/context.py
    makes it once per forward). `gather(x)`: this rank's figures of its two chunks (2, ...) as every chunk's, in row
    order (2C, ...), with their gradient; `chunks`: the row-order indices of this rank's two; `starts` (B, 2 L): the
    record starts among this rank's tokens, as in the whole row (a chunk's first token where a record starts there),
    None for one document a row; `starts_before` (2, B, K - 1): those of the K - 1 tokens before each of its chunks;
    `bounds`: through fla, the segments' boundaries of split_starts' two layouts, computed with the micro-batch on the
    host (fused_delta_rule.segment_bounds), None where they are not."""

    gather: Callable[[torch.Tensor], torch.Tensor]
    chunks: tuple[int, int]
    starts: torch.Tensor | None = None
    starts_before: torch.Tensor | None = None
    bounds: tuple[SegmentBounds, SegmentBounds] | None = None

    def kernel_starts(self, which: int) -> torch.Tensor | Packed | None:
        """The starts the kernels take: split_starts' layout `which` (0 the convolution's, 1 the rule's), with its
        bounds where they came with the micro-batch."""
        if self.starts is None:
            return None
        starts = convolution_starts(self.starts, self.starts_before) if which == 0 else by_chunk(self.starts, 1)
        return starts if self.bounds is None else Packed(starts, self.bounds[which])


def convolution_starts(starts: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The record starts of this rank's chunks (`starts` (B, 2 L), `before` (2, B, K - 1): SplitRows') as the
    convolution takes them: each chunk after the K - 1 tokens before it (2 B, K - 1 + L)."""
    return torch.cat([before, torch.stack(starts.chunk(2, dim=1))], dim=-1).flatten(0, 1)


def split_starts(starts: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two layouts of record starts the kernels take for this rank's chunks: the convolution's and the rule's
    (each chunk alone, (2 B, L))."""
    return convolution_starts(starts, before), by_chunk(starts, 1)


def by_chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, ..., 2 L, ...) -> (2 B, ..., L, ...): this rank's two chunks stacked along the batch, the first's first."""
    return torch.cat(x.chunk(2, dim), dim=0)


def by_row(x: torch.Tensor, dim: int) -> torch.Tensor:
    """by_chunk undone: (2 B, ..., L, ...) -> (B, ..., 2 L, ...)."""
    return torch.cat(x.chunk(2, dim=0), dim=dim)


def split_causal_conv(x: torch.Tensor, weight: torch.Tensor, rows: SplitRows) -> torch.Tensor:
    """delta_rule.causal_conv of this rank's part x (B, channels, 2 L) of each row, each chunk's taps reaching into
    the inputs before it."""
    reach = weight.shape[-1] - 1
    if reach == 0:  # one tap: each output its own token's
        return causal_conv(x, weight)
    chunks = torch.stack(x.chunk(2, dim=-1))  # (2, B, channels, L)
    before = inputs_before(rows.gather(chunks[..., -reach:]), rows.chunks)  # (2, B, channels, K - 1)
    extended = torch.cat([before, chunks], dim=-1).flatten(0, 1)
    # the K - 1 inputs before each chunk stand where causal_conv pads with zeros: its outputs there are dropped
    return by_row(causal_conv(extended, weight, rows.kernel_starts(0))[..., reach:], dim=-1)


def inputs_before(tails: torch.Tensor, chunks: tuple[int, int]) -> torch.Tensor:
    """The K - 1 convolution inputs before each of this rank's chunks: the previous chunk's last, zeros before the
    row's first. `tails` (2C, ...) every chunk's last K - 1, in row order."""
    return torch.stack([tails[j - 1] if j else torch.zeros_like(tails[0]) for j in chunks])


def split_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, rows: SplitRows) -> torch.Tensor:
    """delta_rule.chunk_gated_delta_rule's outputs (B, 2 L, value heads, value width) for this rank's part of each row
    (its arguments' shapes, 2 L tokens), each chunk from the state the row's earlier chunks leave it (module
    docstring)."""
    B, value_width, key_width = value.shape[0], value.shape[-1], key.shape[-1]
    heads = value.shape[2]
    work = torch.promote_types(query.dtype, torch.float32)  # the kernel's (fp64 inputs: fp64)
    widened = torch.cat([value, value.new_zeros(*value.shape[:-1], key_width)], dim=-1)
    identity = torch.cat([value.new_zeros(key_width, value_width, dtype=work),
                          torch.eye(key_width, dtype=work, device=value.device)], dim=-1)
    starts = rows.kernel_starts(1)
    # outputs in the kernel's precision (a query in it): the two terms are summed before the one cast to the model's
    out, state = chunk_gated_delta_rule(by_chunk(query.to(work), 1), by_chunk(key, 1), by_chunk(widened, 1),
                                        by_chunk(g, 1), by_chunk(beta, 1), starts,
                                        identity.expand(2 * B, heads, key_width, key_width + value_width),
                                        state_gradient=True)
    transitions = rows.gather(state.unflatten(0, (2, B)))  # (2C, B, heads, key width, value width + key width)
    before = states_before(transitions[..., value_width:], transitions[..., :value_width], rows.chunks)
    # O_0 + O_I S_in, per head: (2B, heads, L, key width) @ (2B, heads, key width, value width)
    read = (out[..., value_width:].transpose(1, 2) @ before.flatten(0, 1)).transpose(1, 2)
    return by_row(out[..., :value_width] + read, dim=1).to(value.dtype)


def states_before(M: torch.Tensor, B: torch.Tensor, chunks: tuple[int, int]) -> torch.Tensor:
    """The states before this rank's chunks (2, B, heads, key width, value width), composed in row order from every
    chunk's (M_j, B_j) (2C, ...): S_0 = 0, S_{j+1} = M_j S_j + B_j."""
    states, state = {0: torch.zeros_like(B[0])}, None
    for j in range(max(chunks)):
        state = B[j] if state is None else M[j] @ state + B[j]
        states[j + 1] = state
    return torch.stack([states[j] for j in chunks])
