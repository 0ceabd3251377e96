"""A small on-device fingerprint of a flat parameter buffer, for the cross-rank drift check.

Invariant (b) says every replica holds bitwise identical parameters. Hashing the buffer with sha256
means copying it to the host (498 MB for GPT-2 small); instead we reduce the values' bit
patterns, read as integers, to two int64 numbers on the buffer's own device, with wrap-around
(mod 2**64) arithmetic:

    plain = sum(v[i])            poly = sum(v[i] * K**i)     (i: global position in `flat`, K odd)

Integer sums are exact in any order, so the digest is bitwise deterministic on any thread count or
device. One changed value changes `plain` (its bit pattern moves by 1 .. 2**32 - 1 for fp32). A swap
of two different values leaves `plain` alone but moves `poly` by d * K**j * (K**(i-j) - 1), which is
nonzero mod 2**64 whenever 2-adic valuations add up to < 64: v(d) <= 31, v(K**m - 1) = 2 + v(m) for
K = 5 mod 8, so every swap in an fp32 buffer under 2**31 values is caught. Powers of K (unlike linear
weights 2i+1) also catch the +1, -2, +1 ulp pattern that cancels both plain and linear sums.
It is a checksum against accidental drift, not a cryptographic hash.
"""

from __future__ import annotations

import torch

# 2**64 / golden ratio: odd, and = 5 mod 8 so that v2(K**m - 1) = 2 + v2(m) (see the docstring).
K = 0x9E3779B97F4A7C15
_MOD = 1 << 64
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed64(x: int) -> int:
    """x mod 2**64 as the int64 that has the same bits."""
    x %= _MOD
    return x - _MOD if x >= 1 << 63 else x


def _powers_of_k(n: int, device: torch.device) -> torch.Tensor:
    """K**t mod 2**64 for t in [0, n), built by doubling: P[m:2m] = K**m * P[:m]."""
    powers = torch.empty(n, dtype=torch.int64, device=device)
    powers[:1] = 1
    filled = 1
    while filled < n:
        m = min(filled, n - filled)
        torch.mul(powers[:m], _signed64(pow(K, filled, _MOD)), out=powers[filled:filled + m])
        filled += m
    return powers


def tensor_digest(flat: torch.Tensor, ranges: list[tuple[int, int]] | None = None,
                  chunk: int = 1 << 20) -> torch.Tensor:
    """[plain, poly]: int64 tensor of shape (2,) on flat's device; equal iff (almost surely) bits equal.

    `ranges` picks [lo, hi) pieces of `flat` (positions stay global, so the same values at other
    positions give another digest); None hashes all of it. Work goes in pieces of `chunk` values, so
    temporaries stay at 2 * 8 * chunk bytes (16 MB at the default) whatever the buffer size, small
    enough for the CPU's cache. On a GPU a larger chunk means fewer kernel launches.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"tensor_digest wants a contiguous 1-D buffer, got shape {tuple(flat.shape)} "
                         f"(contiguous={flat.is_contiguous()}); pass the flat parameter buffer")
    if flat.element_size() not in _BITS_DTYPE:
        raise ValueError(f"tensor_digest cannot read {flat.dtype} ({flat.element_size()} bytes per value) as integers")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of values, got {chunk}")
    n = flat.numel()
    ranges = [(0, n)] if ranges is None else ranges
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"range [{lo}, {hi}) is outside the buffer of {n} values")

    # Bit patterns, sign-extended to int64 in one reused work buffer: distinct bits stay distinct
    # integers, and int64 mul/sum wrap mod 2**64 (checked on CPU, torch 2.13: tests/test_digest.py).
    # Reusing the buffer matters: a fresh int64 temporary per piece cost 7x on CPU (page faults).
    bits = flat.detach().view(_BITS_DTYPE[flat.element_size()])
    longest = min(chunk, max((hi - lo for lo, hi in ranges), default=0))
    powers = _powers_of_k(longest, flat.device)
    work = torch.empty(longest, dtype=torch.int64, device=flat.device)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    poly = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo, hi in ranges:
        for start in range(lo, hi, chunk):
            v = work[:min(chunk, hi - start)]
            v.copy_(bits[start:start + v.numel()])
            plain += v.sum()
            # sum_t v[start+t] * K**(start+t) = K**start * sum_t v[start+t] * K**t
            poly += v.mul_(powers[:v.numel()]).sum() * _signed64(pow(K, start, _MOD))
    return torch.stack([plain, poly])


def digest_hex(d: torch.Tensor) -> str:
    """The digest's values as unsigned 64-bit hex, joined by '-', for reports and error messages."""
    return "-".join(f"{x % _MOD:016x}" for x in d.tolist())


def moved(digest: torch.Tensor, offset: int) -> torch.Tensor:
    """The digest of the same values lying `offset` positions further on (poly x K**offset; plain is unchanged):
    a shard's chunk digested where it sits in the shard becomes its digest where it lies in the full buffer. Digests
    of disjoint pieces add up (mod 2**64) to the digest of their union, so the sum of every rank's chunk digests is
    the digest of the buffer they make when gathered."""
    return torch.stack([digest[0], digest[1] * _signed64(pow(K, offset, _MOD))])
