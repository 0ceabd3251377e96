"""The global gradient norm: fp32 sums of squares of fixed chunks, summed exactly, the same bits at every world size.

A float64 norm over the whole shard converts every value (373 ms of a 4.7 s step at 124M on one rank; measured here
for 124M values on one thread: 737 ms, against 84 ms for the fp32 sums of 256-value chunks and 5 ms for their
exact sum). The chunks are one grid fixed in each bucket: the layout pads every bucket so that each rank's share
is whole chunks (layout.NORM_CHUNK), hence a rank's shard, cut at multiples of NORM_CHUNK, holds chunks of that
grid whatever the world size; each chunk is summed by one fixed pairwise tree of elementwise adds, so every world
size (and every device) computes the same chunk sums, bit for bit. Those are then summed exactly, so no split over
ranks and no order of the all-reduce can change the result:

    each chunk's sum of squares, fp32, by a fixed tree     = m x 2^(e - 53) in float64, m a 53-bit integer
    this rank's sum of them, exact, as one integer        in units of 2^(E_MIN - 53), cut into 32-bit limbs
    the limbs summed over ranks, in the step's all-reduce  float64 sums of integers below 2^53: exact
    the world's exact sum rounded once to float64, sqrt   -> the norm

The chunk sums' own rounding (fp32, a pairwise tree of 256 values) is the norm's whole error: measured 1e-9
relative to a float64 norm. With tensor parallelism the counted ranges (gradients.GradientReducer._counted_ranges)
start and end at parameters, and are cut at the same grid, so their pieces are the same at every DP size too.
"""

from __future__ import annotations

import math

import torch

from .layout import NORM_CHUNK

# Exponents (frexp's) of the values summed exactly: every fp32 value (a chunk's sum) and its square lies in
# [2^-298, 2^256).
E_MIN, E_MAX = -300, 300
LIMB_BITS = 32
# The exact sum of up to 2^40 squares below 2^E_MAX, in units of 2^(E_MIN - 53), in 32-bit limbs.
N_LIMBS = -(-(E_MAX - E_MIN + 53 + 40) // LIMB_BITS)
# What a rank adds to the step's all-reduce: the limbs, then the float64 sum of its squares where that is not
# finite (0 otherwise).
N_VALUES = N_LIMBS + 1
# Values chunk_squares squares at once (the bits do not depend on it): on the CPU a block that stays in cache
# (measured 84 ms for 124M values, 600 ms with 16 MiB blocks; torch's row norms, whose order may change with
# the number of rows, took 30 ms), on a GPU fewer launches.
BLOCK_VALUES = {False: 1 << 19, True: 1 << 24}


def grid_cut(a: int, z: int) -> tuple[int, int]:
    """The first and the last multiple of NORM_CHUNK within [a, z], or (z, z) where none is: [a, head) is the end of a
    chunk, [head, body) whole chunks, [body, z) the start of one."""
    head = min(z, -(-a // NORM_CHUNK) * NORM_CHUNK)  # the first multiple at or after a
    return head, max(head, z // NORM_CHUNK * NORM_CHUNK)  # the last at or before z


def norm_chunks(shard: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The `ranges` of `shard` cut at every multiple of NORM_CHUNK, as 2-D views: one row per chunk (or piece of one).

    A shard's multiples of NORM_CHUNK are its buckets' grid (each rank's share of a bucket is whole chunks), so the
    rows are the same values at every world size.
    """
    C, pieces = NORM_CHUNK, []
    for a, z in ranges:
        head, body = grid_cut(a, z)
        if head > a:
            pieces.append(shard[a:head].view(1, -1))
        if body > head:
            pieces.append(shard[head:body].view(-1, C))
        if z > body:
            pieces.append(shard[body:z].view(1, -1))
    return pieces


def chunk_squares(shard: torch.Tensor, ranges: list[tuple[int, int]], scratch: Scratch | None = None) -> torch.Tensor:
    """The sum of squares of every row of norm_chunks(shard, ranges), in fp32, as float64 (exact there).

    Each row is summed by one fixed pairwise tree of elementwise adds (a reduction kernel's order may change with
    the number of rows, on a GPU at least): the same bits on any device, whichever rows are summed together. Rows
    go a block at a time (BLOCK_VALUES) through one scratch block, squared into it and halved in place, so the
    squares never take a shard's worth of memory and no block allocates (a fresh tensor per level cost 123,000
    page faults and 270 ms for 124M values on one thread, against 1,900 and 132 ms in place: the same bits).
    Callers that sum many tensors pass one `scratch` for all of them (scattered_chunk_squares).
    """
    sums, block_values = [], BLOCK_VALUES[shard.device.type == "cuda"]
    scratch = Scratch() if scratch is None else scratch
    for rows in norm_chunks(shard, ranges):
        n = rows.shape[1]
        width = 1 << (n - 1).bit_length()  # a piece of a chunk: padded with zeros (x + 0 == x)
        per_block = max(1, min(block_values // width, rows.shape[0]))
        for block in rows.split(per_block):
            squares = scratch.take(block.shape[0] * width, shard.device).view(block.shape[0], width)
            torch.square(block.float(), out=squares[:, :n])
            if n < width:
                squares[:, n:] = 0
            half = width
            while half > 1:
                half //= 2
                squares[:, :half].add_(squares[:, half : 2 * half])
            sums.append(squares[:, 0].clone())
    if not sums:
        return torch.zeros(0, dtype=torch.float64, device=shard.device)
    return torch.cat(sums).double()


class Scratch:
    """The one block chunk_squares squares into, grown as needed and kept across calls: a fresh block per tensor
    was fresh memory to fault in (one rank's norm of SmolLM-135M's 272 gradients, each read where it is: 250 ms of
    CPU time a step on one thread, against 120 ms for the same values in one flat buffer; the same bits)."""

    def __init__(self):
        self.block: torch.Tensor | None = None

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """The first `numel` values of the block (on `device`; contents undefined)."""
        if self.block is None or self.block.numel() < numel or self.block.device != device:
            self.block = torch.empty(numel, dtype=torch.float32, device=device)
        return self.block[:numel]


def scattered_chunk_squares(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """chunk_squares of the flat buffer that holds each 1-D tensor of `pieces` at its offset and zeros elsewhere,
    without that buffer: the rows inside one tensor are read where they are, and each row that spans tensors (or
    padding) is put together from its parts, zeros in between. The rows are the buffer's, value for value, so the
    sums are its bits (a row of zeros, all padding, adds 0); their order is another, which the exact sum ignores.
    """
    C, parts, sums, scratch = NORM_CHUNK, {}, [], Scratch()
    for offset, t in pieces:
        end = offset + t.numel()
        head, body = grid_cut(offset, end)
        if body > head:
            sums.append(chunk_squares(t[head - offset : body - offset], [(0, body - head)], scratch))
        for lo, hi in ((offset, head), (body, end)):
            if hi > lo:
                if lo // C not in parts:
                    parts[lo // C] = t.new_zeros(C)
                row = parts[lo // C]
                row[lo % C : lo % C + hi - lo] = t[lo - offset : hi - offset]
    if parts:
        sums.append(chunk_squares(torch.stack(list(parts.values())).reshape(-1), [(0, C * len(parts))], scratch))
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)


def exact_sum_limbs(squares: torch.Tensor) -> torch.Tensor:
    """This rank's part of the step's all-reduce (N_VALUES float64, on the squares' device, never read by the host):
    the exact sum of `squares` (float64, 0 or at least 2^-298, as every fp32 value and every square of one is) as
    N_LIMBS integer limbs, each below 2^33, then 0; or, where one is not finite or beyond 2^E_MAX, no limbs and their
    float64 sum."""
    v = squares.detach().reshape(-1).to(torch.float64)
    rough = v.sum()
    # an inf or nan gradient (or one near fp32's limit): the guard's business, not ours
    beyond = ~(rough < 2.0**E_MAX)
    m, e = torch.frexp(v.masked_fill(beyond, 0.0))  # v = m x 2^e, m in [0.5, 1): e >= -297 for every fp32 value
    mantissa = (m * 2.0**53).to(torch.int64)  # exact
    index = e.to(torch.int64) - E_MIN
    # Two halves of each 53-bit mantissa, so that a rank's sum of up to 2^36 of them stays an exact int64.
    bins = torch.zeros(2, E_MAX - E_MIN + 1, dtype=torch.int64, device=v.device)
    bins[0].index_add_(0, index, mantissa >> 26)
    bins[1].index_add_(0, index, mantissa & (2**26 - 1))
    limbs = _limbs_of_bins(bins)
    values = torch.cat([limbs.to(torch.float64), torch.zeros(1, dtype=torch.float64, device=v.device)])
    rest = torch.cat([torch.zeros(N_LIMBS, dtype=torch.float64, device=v.device), rough.reshape(1)])
    return torch.where(beyond, rest, values)


# The bins' values are cut into pieces of PIECE_BITS, so that each piece shifted within its 32-bit limb, and the
# sum of every piece that lands in one limb, stay exact int64s (pieces below 2^16, shifted below 2^48, at most 256
# of them a limb).
PIECE_BITS = 16


def _limbs_of_bins(bins: torch.Tensor) -> torch.Tensor:
    """sum over k of (bins[0, k] x 2^26 + bins[1, k]) x 2^k as N_LIMBS int64 limbs of LIMB_BITS, each below 2^33
    (carried twice, not to the end: the all-reduce sums them as float64 integers, exact below 2^53), on the device:
    the host computed this with Python's integers, one read a step."""
    device, n_bins = bins.device, bins.shape[1]
    position = torch.arange(n_bins, device=device) + torch.tensor([[26], [0]], device=device)
    limbs = torch.zeros(N_LIMBS + 2, dtype=torch.int64, device=device)
    for j in range(64 // PIECE_BITS):
        piece = (bins >> (PIECE_BITS * j)) & (2**PIECE_BITS - 1)
        at = position + PIECE_BITS * j
        limbs.index_add_(0, (at >> 5).reshape(-1), (piece << (at & 31)).reshape(-1))
    for _ in range(2):
        limbs = _carry(limbs)
    return limbs[:N_LIMBS]


def _carry(limbs: torch.Tensor) -> torch.Tensor:
    """One carry of every limb's bits above LIMB_BITS into the next limb (the top limb's are dropped: the sum is
    sized to fit)."""
    mask = 2**LIMB_BITS - 1
    carried = limbs & mask
    carried[1:] += limbs[:-1] >> LIMB_BITS
    return carried


def exact_sum(summed: torch.Tensor) -> torch.Tensor:
    """The sum of squares from exact_sum_limbs' values summed over every rank, on their device (0-d float64, unread):
    the exact sum rounded once to float64 (the host did this with Python's integers, a read a step)."""
    device = summed.device
    limbs = summed[:N_LIMBS].to(torch.int64)
    for _ in range(N_LIMBS + 1):  # canonical limbs, below 2^32: a carry may run from the lowest limb to the top
        limbs = _carry(limbs)
    # Rounded once: the top three limbs (96 bits, at least 65 of them significant) with a sticky quarter for anything
    # below them, which breaks a tie as the rest would (ties lie at multiples of 2^11 there).
    padded = torch.cat([torch.zeros(2, dtype=torch.int64, device=device), limbs])
    places = torch.arange(padded.numel(), device=device)
    top = torch.where(padded != 0, places, 0).max().clamp(min=2)
    a, b, c = (padded[top - i].to(torch.float64) for i in range(3))
    sticky = ((padded != 0) & (places < top - 2)).any().to(torch.float64) * 0.25
    high, low = a * 2.0**64, b * 2.0**32
    s = high + low
    err = (high - (s - (s - high))) + (low - (s - high))  # TwoSum: s + err == high + low exactly
    rounded = s + (err + (c + sticky))  # err + c + sticky is exact: a multiple of 2^-2 below 2^46
    # scaled by powers of two (exact): c is limb top - 4 (two zeros were put below limb 0), in units 2^(E_MIN - 53)
    return rounded * torch.pow(2.0, (top - 4).to(torch.float64) * LIMB_BITS - (53 - E_MIN)) + summed[N_LIMBS]


def norm_tensor(summed: torch.Tensor) -> torch.Tensor:
    """The global norm, on the device (0-d float64, unread): exact_sum's sqrt there (torch's: on the CPU it may differ
    from a correctly rounded sqrt by an ulp; the same bits at every world size all the same). The clip factor is
    computed from it on the device; the host reads it at the log steps."""
    return torch.sqrt(exact_sum(summed))

